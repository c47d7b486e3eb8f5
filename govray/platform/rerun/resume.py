"""Continuing an interrupted or paused trial from its latest checkpoint, from its recorded run.

A resumed run is not planned again: its ``RunSpec`` was written to storage when it started
(``STORAGE/runs/RUN.json``) and is rebuilt from there, running the trial's recorded code.

Example::

    use_interrupted_trial_code(config, store, experiment)   # before the policy check imports the trial
    checked = check_policy(config, store, allow_unsigned=False)
    outcome = resume_trial(config, checked, experiment, store)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from govray.config.experiment import ExperimentConfig
from govray.core.keys import TrustConfig
from govray.core.storage import Storage, open_storage
from govray.platform.mlflow_mirror import mirrored
from govray.platform.rerun.world_history import (
    WorldHistoryError,
    WorldSegment,
    describe_segments,
    recorded_lineage,
    recorded_world_history,
    replay_segments,
    segments_left,
)
from govray.platform.run.plan import (
    PlanError,
    RunPlan,
    code_directory,
    recorded_final_checkpoint,
    recorded_trial_code,
    run_spec_path,
)
from govray.platform.run.preflight import CheckedPolicy
from govray.platform.run.runner import Progress, TrainingFailed, TrialOutcome, start_planned, train_run
from govray.platform.search.began import search_began
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, TrialRecord, TrialState
from govray.train.checkpoints.files import checkpoint_step, find_checkpoints
from govray.train.checkpoints.manifest import CheckpointError, listed_bytes, signed_manifest
from govray.train.reproduce.snapshots import verify_input_digests
from govray.train.runspec import RUN_SPEC_FILE, RunSpec, read_run_spec
from govray.train.trial import make_trial

# The spec a segment of a replay trains with, from the replay's own (named) spec.
Respec = Callable[[WorldSegment, RunSpec], RunSpec]
RESUMABLE_STATES = (TrialState.ACTIVE.value, TrialState.ERRORED.value, TrialState.PAUSED.value)


def interrupted_trial(store: TrackingStore, experiment: Experiment) -> TrialRecord | None:
    """The experiment's newest trial that started and did not finish (driver died, error, pause)."""
    assert experiment.id is not None
    interrupted = [
        t for t in store.list_trials(experiment.id) if t.state in RESUMABLE_STATES and t.ray_run_name
    ]
    return interrupted[-1] if interrupted else None


def resumes_search(config: ExperimentConfig, store: TrackingStore, experiment: Experiment) -> bool:
    """Whether `govray resume` of ``experiment`` resumes its search: its Ray Tune state is kept
    and no run or replay of it is interrupted (those keep their run spec on storage; a search
    trial has none)."""
    trial = interrupted_trial(store, experiment)
    if trial is not None and trial.ray_run_name is not None:
        storage = open_storage(config.storage_path)
        if storage.fetch(run_spec_path(storage, trial.ray_run_name)):
            return False
    return search_began(config, experiment)


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
    schedule exactly, each step's slots split among the workers: ``train.rounds``); a replay of a
    resized trial on that trial's world sizes (``replay_segments_left``; asked for other workers,
    refused).

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
    refuse_a_changed_run_spec(storage, trial.ray_run_name, checked.trust)
    spec = read_run_spec(path)
    if spec.policy_digest != checked.policy.digest:
        raise TrainingFailed(
            f"trial {trial.id} ran under policy digest {spec.policy_digest[:16]}…, the policy is now "
            f"{checked.policy.digest[:16]}…: resume refused"
        )
    # The workers import the trial from its verified snapshot, reading what it read then.
    code = str(code_directory(storage, recorded_trial_code(storage, trial)))
    resumed = make_trial(spec.trial, spec.hparams, spec.settings)
    verify_input_digests(spec.input_digests, resumed, run=f"trial {trial.id}")
    left = replay_segments_left(store, storage, trial, spec, checked)
    configured = ExperimentConfig.model_validate_json(experiment.config_json)
    if left is not None and config.resources != configured.resources:
        raise WorldHistoryError(
            f"trial {trial.id} replays trial {trial.replay_of}, which was resized: it resumes on that "
            f"trial's world sizes, not on the workers asked (leave out --workers); {describe_segments(left)}"
        )
    fit = Fit(checked, storage, experiment, store, trial.id, trial.ray_run_name, progress, code)
    with mirrored(store, config.tracking.mlflow, trial.experiment_id):
        return fit(config, spec) if left is None else _train_segments(fit, config, spec, left)


def refuse_a_changed_run_spec(storage: Storage, run_name: str, trust: TrustConfig) -> None:
    """The run spec on storage (``runs/RUN.json``: what a resume rebuilds the run from, and a file
    the engineer can write) must be, byte for byte, the one the run's newest checkpoint that
    verifies under ``trust`` sealed: a resume never trains another plan than the run's checkpoints
    are signed for. A run with no such checkpoint yet starts over and has nothing to compare."""
    path = run_spec_path(storage, run_name)
    held = path.read_bytes()
    for folder in reversed(find_checkpoints(storage.root / "ray" / run_name)):
        try:
            manifest, _ = signed_manifest(folder, trust)
            sealed = listed_bytes(folder, manifest, RUN_SPEC_FILE)
        except CheckpointError:
            continue  # (the resume passes over it too)
        if sealed != held:
            raise TrainingFailed(
                f"{path} is not the run spec the run's checkpoint {folder.name} sealed: resume refused "
                "(a spec changed on storage would train another plan than the run's checkpoints are "
                "signed for; put back the sealed one, its run.json)"
            )
        return


def replay_segments_left(
    store: TrackingStore, storage: Storage, trial: TrialRecord, spec: RunSpec, checked: CheckedPolicy
) -> tuple[WorldSegment, ...] | None:
    """What a replay of a resized trial still trains, on its original's world sizes from its own
    latest checkpoint (``world_history.segments_left``); None for any other trial (and a replay of
    one world size), which resumes as any run does."""
    if trial.replay_of is None:
        return None
    original = store.get_trial(trial.replay_of)
    try:  # (a run's, or a search trial's: Tune keeps its checkpoints)
        final = recorded_final_checkpoint(store, storage, original, checked.trust)
    except PlanError as error:
        raise TrainingFailed(f"trial {trial.id} replays trial {original.id}: {error}") from None
    if len(lineage := recorded_lineage(final)) > 1:
        # Its plans are the replay's, not on storage: it is ended (killed), so it no longer stands
        # in the way of resuming the experiment's search.
        assert trial.id is not None
        store.set_trial_state(trial.id, TrialState.KILLED)
        changes = ", ".join(str(entry.from_step) for entry in lineage[1:])
        raise TrainingFailed(
            f"trial {trial.id} replayed trial {original.id} along its PBT lineage (hyperparameters "
            f"changed after steps {changes}), which a resume cannot continue: it is now killed; run "
            "`govray replay` again"
        )
    history = recorded_world_history(final)
    segments = replay_segments(history, spec.max_steps)
    if len(segments) < 2:
        return None
    assert trial.ray_run_name is not None
    ours = find_checkpoints(storage.root / "ray" / trial.ray_run_name)  # what the restore reads
    done = checkpoint_step(ours[-1]) if ours else 0
    return segments_left(segments, done) or segments[-1:]  # all trained: finished on the last world


def run_segments(
    plan: RunPlan,
    experiment: Experiment,
    store: TrackingStore,
    segments: tuple[WorldSegment, ...],
    *,
    progress: Progress | None = None,
    replay_of: int | None = None,
    respec: Respec | None = None,
) -> TrialOutcome:
    """Train the planned trial one segment after another under one trial and run name: each
    segment but the last pauses at its end with a sealed checkpoint, the next resumes from it on
    its own world size (and, given ``respec``, with the spec it gives the segment: a replay of a
    PBT clone's lineage changes hyperparameters between segments). Returns the last segment's
    outcome, or that of a segment that ended otherwise (paused or killed on request elsewhere, or
    completed early: an early stop); a resume of it (``resume_trial``) goes on with the segments
    left."""
    assert experiment.id is not None
    trial_id, run_name, spec = start_planned(plan, experiment, store, replay_of=replay_of)
    fit = Fit(plan.checked, plan.storage, experiment, store, trial_id, run_name, progress)
    with mirrored(store, plan.config.tracking.mlflow, experiment.id):
        return _train_segments(fit, plan.config, spec, segments, respec)


@dataclass(frozen=True)
class Fit:
    """What every fit of one recorded trial shares (``train_run``'s arguments but the workers, the
    spec and where a segment pauses); a resume's fits import the trial's recorded code."""

    checked: CheckedPolicy
    storage: Storage
    experiment: Experiment
    store: TrackingStore
    trial_id: int
    run_name: str
    progress: Progress | None
    recorded_code_dir: str = ""

    def __call__(self, config: ExperimentConfig, spec: RunSpec, pause_at: int | None = None) -> TrialOutcome:
        return train_run(
            config,
            self.checked,
            self.storage,
            self.experiment,
            self.store,
            self.trial_id,
            self.run_name,
            spec,
            self.progress,
            pause_at=pause_at,
            recorded_code_dir=self.recorded_code_dir,
        )


def _train_segments(
    fit: Fit,
    config: ExperimentConfig,
    spec: RunSpec,
    segments: tuple[WorldSegment, ...],
    respec: Respec | None = None,
) -> TrialOutcome:
    """``fit`` each segment on its world size (``config`` on its workers) with its spec
    (``respec``'s, else ``spec``), each but the last to a pause at its end; stops at a segment that
    ended otherwise."""
    outcome: TrialOutcome | None = None
    for segment in segments:
        pause_at = segment.end if segment.end < spec.max_steps else None
        trained = respec(segment, spec) if respec is not None else spec
        outcome = fit(on_workers(config, segment.workers), trained, pause_at)
        paused_at_end = outcome.state == TrialState.PAUSED.value and outcome.steps_done == segment.end
        if pause_at is None or not paused_at_end:
            break
    assert outcome is not None
    return outcome
