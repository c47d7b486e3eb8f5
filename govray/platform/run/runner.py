"""Running a governed trial on Ray Train, from the driver.

The driver owns lifecycle states (trial pending → running → completed/failed) and is the only
writer of the trial's rows: its ``RunRecorder`` records the reports rank 0 makes every K steps
(sent to the driver's ``ReportSink`` without waiting; in local mode, one worker in-process,
handed over directly), each signed checkpoint, and the ledger of the last report.

Example::

    outcome = run_trial(config, checked, experiment, shard_root, store)   # plan_run, then run_planned
    print(outcome.metrics["validation_accuracy"])
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray.train
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from govray.config.experiment import ExperimentConfig
from govray.core.errors import GovrayError
from govray.core.storage import Storage
from govray.platform.mlflow_mirror import mirrored
from govray.platform.run.fitting import fit_polled, pass_request
from govray.platform.run.plan import RunPlan, code_directory, plan_run, run_spec_path
from govray.platform.run.preflight import CheckedPolicy
from govray.platform.run.recorder import GcSettings, RunRecorder
from govray.signer.attesting import attest_trial_end
from govray.signer.local import close_channel, open_channel
from govray.tracking.lineage import ledger_rows
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, ExperimentState, TrialState
from govray.tracking.tensorboard import TensorBoardLog, tensorboard_dir
from govray.train.checkpoints.folders import fetch_referenced
from govray.train.control.decisions import RecordedDecision
from govray.train.reproduce.record import build_record, deterministic_worker_env
from govray.train.reproduce.snapshots import CodeSnapshot
from govray.train.run.loop import train_worker
from govray.train.run.reports import StepReport
from govray.train.run.session import LocalSession, open_sink, taken_reports
from govray.train.runspec import Attempt, RunSpec, train_loop_config
from govray.train.step.ledger import Ledger, LedgerEntry

# (step, max_steps, latest metrics, workers: the world size that reported them, None if unknown)
Progress = Callable[[int, int, dict[str, float], int | None], None]


LOOK_PERIOD = 0.5  # seconds between the driver's looks at its run (reports, requests)


class TrainingFailed(GovrayError):
    """The Ray Train run failed; the message carries the workers' error."""


def governed_trainer(
    config: ExperimentConfig,
    attempt: Attempt,
    storage: Storage,
    *,
    deliver: Callable[[StepReport], None] | None = None,
) -> TorchTrainer:
    """The TorchTrainer of one ``attempt`` at its run's governed loop, named after the run's
    directory: one worker in the driver's process (Train V2 local mode: ``deliver`` hears each
    report), or N Ray Train workers whose rank 0 sends its reports to the driver's sink
    (``attempt.report_sink``)."""
    resources, spec = config.resources, attempt.spec
    local = resources.max_workers == 1 and deliver is not None
    loop = partial(train_worker, session=partial(LocalSession, deliver=deliver)) if deliver else train_worker
    return TorchTrainer(
        loop if local else train_worker,
        train_loop_config=train_loop_config(attempt),
        scaling_config=scaling_config_for(config, local),
        torch_config=TorchConfig(backend="nccl" if config.resources.use_gpu else "gloo"),
        run_config=RunConfig(
            name=Path(spec.run_dir).name,
            storage_path=storage.ray_path(storage.root / "ray"),
            storage_filesystem=storage.filesystem,
            failure_config=failure_config_for(config),
            # Set when each worker process starts, before Ray Train creates its process group
            # (NCCL reads its algorithm and protocol then): training.deterministic's variables.
            # A Train V2 field; mypy resolves ray.train.RunConfig to V1's, which lacks it.
            worker_runtime_env={"env_vars": deterministic_worker_env(spec.settings or config.training)},  # type: ignore[call-arg]
        ),
    )


def scaling_config_for(config: ExperimentConfig, local: bool) -> ScalingConfig:
    """Ray Train's workers: none besides the driver (local), a fixed number, or an elastic range
    (``resources.workers: {min, max}``) whose growth Ray Train checks every ``resize_check_s``."""
    resources = config.resources
    workers: dict[str, Any] = {"num_workers": 0 if local else resources.max_workers}
    if resources.elastic:
        workers = {
            "num_workers": (resources.min_workers, resources.max_workers),
            "elastic_resize_monitor_interval_s": resources.resize_check_s,
        }
    return ScalingConfig(
        use_gpu=resources.use_gpu,
        resources_per_worker={"CPU": resources.cpus_per_worker},
        placement_strategy=resources.placement_strategy.value,
        **workers,
    )


def failure_config_for(config: ExperimentConfig) -> FailureConfig:
    """How often Ray Train restarts the workers from the newest checkpoint. A fixed-size run: up
    to ``max_restarts`` times. An elastic run: without limit, because Ray Train V2 counts a node
    lost without a drain notice (a reclaimed spot node) as a worker-group failure against
    ``max_failures`` (``failure_handling/default.py``; only a drained preemption has its own,
    unlimited, budget) — and a resize after such a loss is the point of the run. A run that fails
    for another reason is stopped with ``govray experiment kill``."""
    return FailureConfig(max_failures=-1 if config.resources.elastic else config.max_restarts)


@dataclass(frozen=True)
class TrialOutcome:
    trial_id: int
    run_name: str
    run_dir: Path  # Ray Train's run directory: checkpoint_* below it
    max_steps: int
    metrics: dict[str, Any]
    ledger: Ledger | None  # None unless the trial completed
    state: str = TrialState.COMPLETED.value  # completed, or paused / killed on request
    steps_done: int = 0


def run_trial(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    experiment: Experiment,
    shard_root: Path,
    store: TrackingStore,
    *,
    hparams: dict[str, Any] | None = None,
    trial_seed: int = 0,
    excluded_corpora: tuple[str, ...] = (),
    report_every: int = 20,
    progress: Progress | None = None,
    recorded_decisions: tuple[RecordedDecision, ...] | None = None,
    start_checkpoint: Path | None = None,
    start_model: Mapping[str, str] | None = None,
    replay_of: int | None = None,
    code: CodeSnapshot | None = None,
) -> TrialOutcome:
    """Plan one trial (:func:`govray.platform.run.plan.plan_run`), then train and record it
    (:func:`run_planned`); raises ``TrainingFailed``.

    ``trial_seed`` (with the experiment seed) fixes initialisation, schedule and per-step
    randomness: a replay with the same seeds and ``excluded_corpora`` leaves those corpora's
    schedule slots empty and everything else identical, and applies ``recorded_decisions`` (the
    source trial's) instead of taking its own. ``start_checkpoint`` starts from another run's
    verified weights and ledger (recorded as the trial's lineage source); ``start_model`` names
    the registered model version that checkpoint is
    (``govray.platform.registry.register.start_reference``), whose attestation the trial's own
    then lists as its base model. A replay names the trial it reruns
    (``replay_of``) and runs that trial's recorded ``code`` (see
    :func:`govray.platform.run.plan.recorded_trial_code`).
    """
    plan = plan_run(
        config,
        checked,
        shard_root,
        hparams=hparams,
        trial_seed=trial_seed,
        excluded_corpora=excluded_corpora,
        report_every=report_every,
        recorded_decisions=recorded_decisions,
        start_checkpoint=start_checkpoint,
        start_model=start_model,
        code=code,
    )
    return run_planned(plan, experiment, store, progress=progress, replay_of=replay_of)


def run_planned(
    plan: RunPlan,
    experiment: Experiment,
    store: TrackingStore,
    *,
    progress: Progress | None = None,
    replay_of: int | None = None,
) -> TrialOutcome:
    """Train the planned trial data-parallel on Ray Train and record it under a fresh run name;
    raises ``TrainingFailed``. A replay names the trial it reruns (``replay_of``)."""
    assert experiment.id is not None
    started = start_planned(plan, experiment, store, replay_of=replay_of)
    with mirrored(store, plan.config.tracking.mlflow, experiment.id):
        return train_run(
            plan.config, plan.checked, plan.storage, experiment, store, *started, progress=progress
        )


def start_planned(
    plan: RunPlan, experiment: Experiment, store: TrackingStore, *, replay_of: int | None = None
) -> tuple[int, str, RunSpec]:
    """Record the planned trial before it trains: its row, its fresh run name, its reproducibility
    record and code snapshot, and its run spec on storage (what `govray resume` rebuilds it from);
    returns (trial id, run name, run spec) for ``train_run``."""
    assert experiment.id is not None
    config, storage, planned = plan.config, plan.storage, plan.spec
    # The trial row keeps the trial seed: with the experiment's seed it fixes init, schedule and
    # per-step randomness, which is what a replay needs.
    trial_row = store.create_trial(
        experiment.id,
        json.dumps(planned.hparams, sort_keys=True),
        seed=planned.trial_seed,
        replay_of=replay_of,
    )
    assert trial_row.id is not None
    trial_id = trial_row.id
    run_name = f"{config.name}-trial{trial_id}-{uuid.uuid4().hex[:8]}"  # fresh: never resume by accident
    if plan.start is not None:
        source = {
            "path": str(plan.start.directory),
            "manifest_sha256": plan.start.manifest_sha256,
            **planned.start_model,
        }
        store.set_trial_source(trial_id, json.dumps({**source, "step": plan.start.step}))
    record = build_record(
        config, storage.root, config_digest=planned.config_digest, threads=planned.threads, code=plan.code
    )
    store.set_trial_reproducibility(trial_id, record.model_dump_json())
    storage.upload(code_directory(storage, record.code))  # replays fetch it
    spec = plan.named(run_name, record.model_dump(mode="json"))
    spec_path = run_spec_path(storage, run_name)
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(spec.model_dump_json(indent=1))  # what `govray resume` rebuilds the run from
    storage.upload(spec_path)
    return trial_id, run_name, spec


def train_run(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    storage: Storage,
    experiment: Experiment,
    store: TrackingStore,
    trial_id: int,
    run_name: str,
    spec: RunSpec,
    progress: Progress | None,
    *,
    pause_at: int | None = None,
    recorded_code_dir: str = "",
) -> TrialOutcome:
    """Fit the trial's TorchTrainer once (a run name that exists in storage resumes that run),
    pausing after ``pause_at`` (a replay's segment) and importing the trial from
    ``recorded_code_dir`` when given (a resume: the run's recorded code snapshot).

    The driver owns the lifecycle: trial and experiment go ``active``, then ``completed``,
    ``paused`` or ``killed`` (on a request) or ``errored``. Callers mirror it to MLflow
    (``mirrored``) when the experiment names a server.
    """
    assert experiment.id is not None
    max_steps = spec.max_steps
    gc = GcSettings(
        experiment_id=experiment.id,
        metric=config.searcher.metric,
        smaller_is_better=config.searcher.smaller_is_better,
    )
    events = TensorBoardLog(tensorboard_dir(storage.root, run_name))
    recorder = RunRecorder(
        store,
        trial_id,
        spec.routing.tensor_layers(),  # this trial's model (its hparams)
        gc,
        replaying=spec.recorded_decisions is not None,
        events=events,
        storage=storage,
        run_dir=spec.run_dir,
        trust=checked.trust,
    )
    sink, sink_name = None, ""
    if config.resources.max_workers > 1:  # rank 0 sends its reports here without waiting
        sink_name = f"govray-reports-{run_name}-{uuid.uuid4().hex[:6]}"
        sink = open_sink(sink_name)
    attempt = Attempt.of(
        spec,
        trust=checked.trust,
        pause_at=pause_at,
        report_sink=sink_name,
        recorded_code_dir=recorded_code_dir,
        signer=open_channel(Path(spec.run_dir), spec),  # its workers seal through it, holding no key
    )
    assert attempt.signer is not None
    trainer = governed_trainer(config, attempt, storage, deliver=recorder.record)
    recorder.settle()  # a resumed run: what its killed attempt (or its orphaned workers) left on storage
    recorder.rewrite_events()
    control = Path(spec.control_file)
    control.unlink(missing_ok=True)
    store.request(experiment.id, None)  # a request made while nothing ran is void
    store.clear_stop(trial_id)
    store.set_trial_state(trial_id, TrialState.ACTIVE, ray_run_name=run_name)
    store.set_experiment_state(experiment.id, ExperimentState.ACTIVE)
    try:
        _fit_with_progress(trainer, store, experiment.id, recorder, sink, max_steps, control, progress)
    except Exception as error:
        store.set_trial_state(trial_id, TrialState.ERRORED)
        store.set_experiment_state(experiment.id, ExperimentState.ERRORED)
        _close_sink(sink, recorder)
        recorder.settle()
        raise TrainingFailed(f"trial {trial_id} ({run_name}) failed: {_worker_error(error)}") from error
    finally:
        close_channel(attempt.signer)  # the fit ended: its capability seals nothing more
        control.unlink(missing_ok=True)
        store.request(experiment.id, None)
        events.publish(storage)  # written here
    _close_sink(sink, recorder)
    recorder.settle()
    return _finished(store, storage, experiment.id, trial_id, run_name, spec)


def _finished(
    store: TrackingStore, storage: Storage, experiment_id: int, trial_id: int, run_name: str, spec: RunSpec
) -> TrialOutcome:
    """The outcome of a run its workers ended: stopped short by a request (paused, killed), or
    completed: its final checkpoint fetched here, attested and uploaded."""
    max_steps = spec.max_steps
    metrics = {metric.name: metric.value for metric in store.metrics(trial_id)}  # latest value per name
    trial = store.get_trial(trial_id)
    steps_done = trial.last_step or 0
    if steps_done < max_steps and trial.stop_reason != "early_stop":
        stopped = _requested_stop(trial.stop_reason, trial_id, run_name, steps_done, max_steps)
        store.set_trial_state(trial_id, stopped)
        store.set_experiment_state(experiment_id, stopped.value)
        return TrialOutcome(
            trial_id, run_name, Path(spec.run_dir), max_steps, metrics, None, stopped.value, steps_done
        )
    ledger = stored_ledger(store, trial_id)
    # Rank 0 may have written the final checkpoint on another node: fetch it (with the base file
    # it refers to).
    run_dir = Path(spec.run_dir)
    storage.fetch_latest(run_dir, "checkpoint_", lambda staged: fetch_referenced(staged, storage, run_dir))
    attested = attest_trial_end(store, trial_id, Path(spec.run_dir))  # signed provenance and coverage
    if attested is not None:  # kept next to the checkpoint, in object storage too
        storage.upload(attested.provenance, attested.coverage)
    store.set_trial_state(trial_id, TrialState.COMPLETED)
    store.set_experiment_state(experiment_id, ExperimentState.COMPLETED)
    return TrialOutcome(
        trial_id, run_name, Path(spec.run_dir), max_steps, metrics, ledger, steps_done=steps_done
    )


def _close_sink(sink: Any, recorder: RunRecorder) -> None:
    """Record what the run's sink still holds, and end it."""
    if sink is None:
        return
    try:
        for report in taken_reports(sink):
            recorder.record(report)
    finally:
        ray.kill(sink)


def last_step(store: TrackingStore, trial_id: int) -> int:
    """The last step the trial reported (0 if none)."""
    return store.get_trial(trial_id).last_step or 0


def _requested_stop(
    stop_reason: str | None, trial_id: int, run_name: str, steps_done: int, max_steps: int
) -> TrialState:
    """The state a run that ended early is in: what the driver had passed to its workers."""
    if stop_reason not in ("pause", "kill"):
        raise TrainingFailed(
            f"trial {trial_id} ({run_name}) ended after {steps_done} of {max_steps} steps without a request"
        )
    return TrialState.PAUSED if stop_reason == "pause" else TrialState.KILLED


def stored_ledger(store: TrackingStore, trial_id: int) -> Ledger:
    """The ledger the trial's final report recorded in the tracking store."""
    rows = ledger_rows(store, trial_id)
    if not rows:
        raise TrainingFailed(f"trial {trial_id} finished without recording its ledger")
    return Ledger(
        entries={
            (row.corpus_id, row.parameter): LedgerEntry(
                examples=row.examples, tokens=row.tokens, steps=row.steps
            )
            for row in rows
        }
    )


def _fit_with_progress(
    trainer: TorchTrainer,
    store: TrackingStore,
    experiment_id: int,
    recorder: RunRecorder,
    sink: Any,
    max_steps: int,
    control: Path,
    progress: Progress | None,
) -> ray.train.Result:
    """``trainer.fit()`` (``fit_polled``) while the driver records the reports its sink queued,
    shows them, and passes a pause/kill request (``govray experiment pause|kill``) to rank 0."""
    seen, passed = 0, None

    def look() -> None:
        nonlocal seen, passed
        requested = store.get_experiment(experiment_id).requested
        if requested is not None and requested != passed:
            pass_request(control, requested)
            passed = requested
        if sink is not None:
            for report in taken_reports(sink):
                recorder.record(report)
        latest = recorder.latest
        if progress is not None and latest is not None and latest.step > seen:
            seen = latest.step
            progress(seen, max_steps, latest.metrics, latest.workers)

    result: ray.train.Result = fit_polled(trainer.fit, look, period=LOOK_PERIOD, name="govray-fit")
    return result


def _worker_error(error: BaseException) -> str:
    """The innermost cause, which is usually the worker's own exception."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"
