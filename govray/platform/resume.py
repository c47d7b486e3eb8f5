"""Continuing an interrupted or paused trial from its latest checkpoint, from its recorded run.

A resumed run is not planned again: its ``RunSpec`` was written to storage when it started
(``STORAGE/runs/RUN.json``) and is rebuilt from there, running the trial's recorded code.

Example::

    use_interrupted_trial_code(config, store, experiment)   # before the policy check imports the trial
    checked = check_policy(config, store, allow_unsigned=False)
    outcome = resume_trial(config, checked, experiment, store)
"""

from __future__ import annotations

from govray.config.experiment import ExperimentConfig
from govray.core.storage import open_storage
from govray.platform.mlflow_mirror import mirrored
from govray.platform.plan import code_directory, recorded_trial_code, run_spec_path
from govray.platform.preflight import CheckedPolicy
from govray.platform.runner import Progress, TrainingFailed, TrialOutcome, train_run
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, TrialRecord, TrialState
from govray.train.runspec import RunSpec
from govray.train.snapshots import verify_input_digests
from govray.train.trial import make_trial

RESUMABLE_STATES = (TrialState.ACTIVE.value, TrialState.ERRORED.value, TrialState.PAUSED.value)


def interrupted_trial(store: TrackingStore, experiment: Experiment) -> TrialRecord | None:
    """The experiment's newest trial that started and did not finish (driver died, error, pause)."""
    assert experiment.id is not None
    interrupted = [
        t for t in store.list_trials(experiment.id) if t.state in RESUMABLE_STATES and t.ray_run_name
    ]
    return interrupted[-1] if interrupted else None


def use_interrupted_trial_code(
    config: ExperimentConfig, store: TrackingStore, experiment: Experiment
) -> None:
    """Before a resume's policy check: import the trial from the interrupted trial's recorded code."""
    trial = interrupted_trial(store, experiment)
    if trial is not None:
        recorded_trial_code(open_storage(config.storage_path), trial)


def on_workers(config: ExperimentConfig, workers: int | None) -> ExperimentConfig:
    """``config`` with ``resources.workers`` set to ``workers`` (None: as it is), validated as a
    config (an HSDP shard group must still divide it): a resume on another world size. An elastic
    config resumed on a number of workers continues as a fixed-size run of that many."""
    if workers is None or workers == config.resources.workers:
        return config
    raw = config.model_dump(mode="json")
    resources = {key: value for key, value in raw.get("resources", {}).items() if key != "resize_check_s"}
    raw["resources"] = {**resources, "workers": workers}
    return ExperimentConfig.model_validate(raw)


def resume_trial(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    experiment: Experiment,
    store: TrackingStore,
    *,
    progress: Progress | None = None,
) -> TrialOutcome:
    """Continue the experiment's interrupted or paused trial from its latest checkpoint, on
    ``config.resources.workers`` workers (``on_workers``: another world size continues the
    schedule exactly, each step's slots split among the workers: ``train.rounds``).

    The run keeps its Ray Train name, so Ray Train restores its checkpoint; the workers recompute
    the schedule from there, running the trial's recorded code. Refused if the policy changed
    since the run started, or if a directory the trial reads (its tokenizer's) changed.
    """
    trial = interrupted_trial(store, experiment)
    if trial is None:
        raise TrainingFailed(
            f"experiment {experiment.id} '{experiment.name}' has no interrupted trial to resume"
        )
    assert trial.id is not None and trial.ray_run_name is not None
    storage = open_storage(config.storage_path)
    path = run_spec_path(storage, trial.ray_run_name)
    if not storage.fetch(path):
        raise TrainingFailed(f"trial {trial.id}: {path} is missing; the run cannot be rebuilt")
    spec = RunSpec.model_validate_json(path.read_text())
    if spec.policy_digest != checked.policy.digest:
        raise TrainingFailed(
            f"trial {trial.id} ran under policy digest {spec.policy_digest[:16]}…, the policy is now "
            f"{checked.policy.digest[:16]}…: resume refused"
        )
    # The workers import the trial from its verified snapshot, reading what it read then.
    code = code_directory(storage, recorded_trial_code(storage, trial))
    resumed = make_trial(spec.trial, spec.hparams, spec.settings)
    verify_input_digests(spec.input_digests, resumed, run=f"trial {trial.id}")
    spec = spec.model_copy(update={"code_dir": str(code), "recorded_code": True})
    with mirrored(store, config.tracking.mlflow, trial.experiment_id):
        return train_run(
            config, checked, storage, experiment, store, trial.id, trial.ray_run_name, spec, progress
        )
