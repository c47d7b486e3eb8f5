"""Running a governed trial on Ray Train, from the driver.

The driver owns lifecycle states (trial pending → running → completed/failed) and is the only
writer of the trial's rows: its ``RunRecorder`` records the reports rank 0 makes every K steps
(sent to the driver's ``ReportSink`` without waiting; in local mode, one worker in-process,
handed over directly), each signed checkpoint, and the ledger of the last report.

Example::

    outcome = run_trial(config, checked, experiment, shard_root, store)
    print(outcome.metrics["validation_accuracy"])
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray.train
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from govray.config.experiment import ExperimentConfig, load_canaries
from govray.config.training import TrainingSettings
from govray.core.canonical import canonical_json, file_sha256
from govray.core.errors import ConfigError, GovrayError
from govray.core.keys import TrustConfig, load_trust, platform_key, platform_key_path, platform_trust
from govray.core.logs import log_dir
from govray.core.storage import open_storage
from govray.data.ingest import IngestResult
from govray.data.packed import PackedStore
from govray.data.packing import pack_shards
from govray.data.schedule import SCHEDULE_VERSION, ScheduleSpec, derive_seed
from govray.data.shards import MANIFEST, ShardManifest, ShardSet
from govray.governance.canaries import CanaryProbe
from govray.platform.mlflow_mirror import mirrored
from govray.platform.preflight import CheckedPolicy, config_digest
from govray.platform.recorder import GcSettings, RunRecorder
from govray.provenance.attest import attest_trial_end
from govray.tracking.lineage import ledger_rows
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, ExperimentState, TrialRecord, TrialState
from govray.tracking.tensorboard import TensorBoardLog, tensorboard_dir
from govray.train.checkpoint import load_checkpoint
from govray.train.decisions import RecordedDecision
from govray.train.ledger import Ledger, LedgerEntry
from govray.train.loop import train_worker
from govray.train.reports import StepReport
from govray.train.reproducibility import (
    CodeSnapshot,
    ReproducibilityRecord,
    build_record,
    deterministic_worker_env,
    use_recorded_code,
)
from govray.train.runspec import RunSpec
from govray.train.session import LocalSession, open_sink, taken_reports
from govray.train.trial import (
    defines_sequence_scores,
    defines_tokenize,
    load_trial_class,
    make_trial,
    resolve_trial_routes,
)
from govray.train.worker import default_threads

Progress = Callable[[int, int, dict[str, float]], None]  # (step, max_steps, latest metrics)
RAY_CHECKPOINT_INDEX = "checkpoint_manager_snapshot.json"  # Ray Train V2's, in its run directory


class TrainingFailed(GovrayError):
    """The Ray Train run failed; the message carries the workers' error."""


def governed_trainer(
    config: ExperimentConfig,
    spec: RunSpec,
    run_name: str,
    *,
    deliver: Callable[[StepReport], None] | None = None,
) -> TorchTrainer:
    """The TorchTrainer that runs ``spec``'s governed loop: one worker in the driver's process
    (Train V2 local mode: ``deliver`` hears each report), or N Ray Train workers whose rank 0 sends
    its reports to the driver's sink (``spec.report_sink``)."""
    workers = config.resources.workers
    storage = open_storage(config.storage_path)
    local = workers == 1 and deliver is not None
    loop = partial(train_worker, session=partial(LocalSession, deliver=deliver)) if deliver else train_worker
    return TorchTrainer(
        loop if local else train_worker,
        train_loop_config=spec.model_dump(mode="json"),
        scaling_config=ScalingConfig(
            num_workers=0 if local else workers,
            use_gpu=config.resources.use_gpu,
            resources_per_worker={"CPU": config.resources.cpus_per_worker},
            placement_strategy=config.resources.placement_strategy.value,
        ),
        torch_config=TorchConfig(backend="nccl" if config.resources.use_gpu else "gloo"),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage.ray_path(storage.root / "ray"),
            storage_filesystem=storage.filesystem,
            failure_config=FailureConfig(max_failures=config.max_restarts),
            # Set when each worker process starts, before Ray Train creates its process group
            # (NCCL reads its algorithm and protocol then): training.deterministic's variables.
            # A Train V2 field; mypy resolves ray.train.RunConfig to V1's, which lacks it.
            worker_runtime_env={"env_vars": deterministic_worker_env(spec.settings or config.training)},  # type: ignore[call-arg]
        ),
    )


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


def plan_steps(
    config: ExperimentConfig,
    manifest_root: Path,
    hparams: dict[str, Any],
    trial_seed: int,
    schedule_version: int = SCHEDULE_VERSION,
    packed: PackedStore | None = None,
) -> int:
    """Total steps from the searcher's ``max_length`` (batches, or epochs of the schedule: of its
    ``packed`` windows under data.packing)."""
    length = config.searcher.max_length
    if length.batches is not None:
        return length.batches
    assert length.epochs is not None
    trial = make_trial(config.trial, hparams, config.training.with_hyperparameters(hparams))
    schedule = ScheduleSpec.from_manifest(
        ShardSet.open(manifest_root).manifest,
        seed=derive_seed(config.seed, trial_seed, "schedule"),
        world_size=config.resources.workers,
        batch_size=trial.batch_size,
        version=schedule_version,
        windows=packed.layouts() if packed is not None else None,
    )
    return length.epochs * schedule.steps_per_epoch


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
    schedule_version: int = SCHEDULE_VERSION,
) -> TrialOutcome:
    """Train one trial data-parallel on Ray Train and record it; raises ``TrainingFailed``.

    ``trial_seed`` (with the experiment seed) fixes initialisation, schedule and per-step
    randomness: a replay with the same seeds and ``excluded_corpora`` leaves those corpora's
    schedule slots empty and everything else identical, and applies ``recorded_decisions`` (the
    source trial's) instead of taking its own. ``start_checkpoint`` starts from another run's
    verified weights and ledger (recorded as the trial's lineage source); ``start_model`` names
    the registered model version that checkpoint is (``govray.platform.registry.start_reference``), whose
    attestation the trial's own then lists as its base model. A replay names the trial it reruns
    (``replay_of``) and runs that trial's recorded ``code`` (see :func:`recorded_trial_code`) on
    its ``schedule_version``. A run started from a checkpoint is a new run: the current version.
    """
    assert experiment.id is not None
    values = hparams if hparams is not None else config.default_hparams()
    key = platform_key()
    trust = platform_trust(key, load_trust(config.policy.trust) if config.policy.trust else None)
    # A tampered or foreign source checkpoint is refused before anything is recorded.
    source = load_checkpoint(start_checkpoint, trust) if start_checkpoint is not None else None
    # The trial row keeps the trial seed: with the experiment's seed it fixes init, schedule and
    # per-step randomness, which is what a replay needs.
    trial_row = store.create_trial(
        experiment.id, json.dumps(values, sort_keys=True), seed=trial_seed, replay_of=replay_of
    )
    assert trial_row.id is not None
    trial_id = trial_row.id
    run_name = f"{config.name}-trial{trial_id}-{uuid.uuid4().hex[:8]}"  # fresh: never resume by accident
    if source is not None:
        recorded = {
            "path": str(source.directory),
            "manifest_sha256": source.manifest_digest,
            **(start_model or {}),
        }
        store.set_trial_source(trial_id, json.dumps({**recorded, "step": source.state.step}))
    threads = default_threads(config.resources.cpus_per_worker)
    record = build_record(
        config,
        open_storage(config.storage_path).root,
        config_digest=config_digest(config),
        threads=threads,
        code=code,
    )
    store.set_trial_reproducibility(trial_id, record.model_dump_json())
    open_storage(config.storage_path).upload(code_directory(config, record.code))  # replays fetch it
    spec = new_run_spec(
        config,
        checked,
        shard_root,
        run_name,
        hparams=values,
        trial_seed=trial_seed,
        reproducibility=record.model_dump(mode="json"),
        trust=trust,
        excluded_corpora=excluded_corpora,
        report_every=report_every,
        recorded_decisions=recorded_decisions,
        start_checkpoint=str(start_checkpoint) if start_checkpoint is not None else "",
        start_model=start_model,
        schedule_version=schedule_version,
    )
    if code is not None:
        spec = on_recorded_code(spec, code_directory(config, code))
    spec_path = run_spec_path(config, run_name)
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(spec.model_dump_json(indent=1))  # what `govray resume` rebuilds the run from
    open_storage(config.storage_path).upload(spec_path)
    with mirrored(store, config.tracking.mlflow, experiment.id):
        return _train(config, checked, experiment, store, trial_id, run_name, spec, progress)


def packed_store(
    config: ExperimentConfig, shard_root: Path, hparams: dict[str, Any], settings: TrainingSettings
) -> PackedStore | None:
    """Under ``data.packing``, the shards' training rows packed into windows by the trial's
    ``tokenize`` (built once per shards, window length and tokenizer — the trial's class, the
    bytes of its module and the hyperparameters — then reused); None otherwise."""
    packing = config.data.packing
    if packing is None:
        return None
    trial_class = load_trial_class(config.trial)
    if not defines_tokenize(trial_class):
        raise ConfigError(
            f"data.packing packs tokens, but trial {config.trial} defines no tokenize(rows) to make them"
        )
    source = inspect.getsourcefile(trial_class)
    tokenizer = canonical_json(
        {"trial": config.trial, "module": file_sha256(Path(source)) if source else "", "hparams": hparams}
    ).decode()
    return pack_shards(
        ShardSet.open(shard_root),
        seq_len=packing.seq_len,
        tokenize=make_trial(config.trial, hparams, settings).tokenize,
        tokenizer=tokenizer,
        storage=config.storage_path if "://" in config.storage_path else "",
    )


def new_run_spec(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    shard_root: Path,
    run_name: str,
    *,
    hparams: dict[str, Any],
    trial_seed: int,
    reproducibility: dict[str, Any],
    trust: TrustConfig,
    excluded_corpora: tuple[str, ...] = (),
    report_every: int = 20,
    recorded_decisions: tuple[RecordedDecision, ...] | None = None,
    start_checkpoint: str = "",
    start_model: Mapping[str, str] | None = None,
    validation_period: int | None = None,
    schedule_version: int = SCHEDULE_VERSION,
) -> RunSpec:
    """Everything the workers of run ``run_name`` need, from the experiment and one hyperparameter
    sample (a searcher may impose a ``validation_period`` when the config sets none)."""
    canaries = load_canaries(config)
    if canaries and not defines_sequence_scores(load_trial_class(config.trial)):
        raise ConfigError(
            f"corpora {sorted(canaries)} declare canaries, but trial {config.trial} defines no "
            "sequence_scores(model, texts) to score them"
        )
    check_memorization_inputs(checked, ShardSet.open(shard_root).manifest, canaries)
    settings = config.training.with_hyperparameters(hparams)
    policy = checked.policy.policy
    packed = packed_store(config, shard_root, hparams, settings)
    return RunSpec(
        trial=config.trial,
        hparams=hparams,
        settings=settings,
        policy=policy,
        # This sample's model (hyperparameters may change its shape), on the meta device.
        routing=resolve_trial_routes(policy, make_trial(config.trial, hparams, settings)),
        shard_root=str(shard_root),
        shards_sha256=file_sha256(shard_root / MANIFEST),
        eval_rows=config.data.eval_rows,
        seed=config.seed,
        trial_seed=trial_seed,
        packed_root=str(packed.root) if packed is not None else "",
        packed_sha256=file_sha256(packed.root / MANIFEST) if packed is not None else "",
        max_steps=plan_steps(config, shard_root, hparams, trial_seed, schedule_version, packed),
        excluded_corpora=excluded_corpora,
        schedule_version=schedule_version,
        report_every=report_every,
        threads=default_threads(config.resources.cpus_per_worker),
        use_gpu=config.resources.use_gpu,
        strategy=config.resources.strategy,
        reproducibility=reproducibility,
        code_dir=os.getcwd(),
        checkpoint_period=config.checkpoint.period,
        platform_key=str(platform_key_path()),
        trust=trust,
        config_digest=config_digest(config),
        policy_digest=checked.policy.digest,
        run_dir=str(open_storage(config.storage_path).root / "ray" / run_name),
        run_name=run_name,
        experiment=config.name,
        validation_period=config.min_validation_period or validation_period,
        lr_schedule=config.lr_schedule,
        recorded_decisions=recorded_decisions,
        early_stopping=config.early_stopping,
        control_file=str(control_path(config, run_name)),
        log_dir=str(log_dir(open_storage(config.storage_path).root, run_name)),
        storage=config.storage_path if "://" in config.storage_path else "",
        start_checkpoint=start_checkpoint,
        start_model=dict(start_model or {}),
        objective_metric=config.searcher.metric,
        smaller_is_better=config.searcher.smaller_is_better,
        memorization_lambda=config.searcher.memorization_lambda,
        canaries=canaries,
    )


def check_memorization_inputs(
    checked: CheckedPolicy, manifest: ShardManifest, canaries: dict[str, CanaryProbe]
) -> None:
    """Refuse, before any worker starts, what the memorization measures cannot honour: canary
    rows outside their corpus, and a monitored corpus with nothing to measure (no training rows,
    or neither held-out rows nor canaries)."""
    summaries = {corpus.corpus_id: corpus for corpus in manifest.corpora}
    for corpus_id, probe in canaries.items():
        rows = summaries[corpus_id].rows
        if outside := sorted(row for c in probe.canaries.canaries for row in c.rows if row >= rows):
            raise ConfigError(
                f"corpus '{corpus_id}' has {rows} rows, but its canaries name rows {outside[:5]}"
            )
    thresholds = checked.policy.policy.memorization
    for corpus_id in (thresholds.monitored_corpora or []) if thresholds else []:
        summary = summaries.get(corpus_id)
        if summary is None:
            raise ConfigError(
                f"the policy monitors corpus '{corpus_id}', which this experiment does not have "
                f"(corpora: {', '.join(sorted(summaries))})"
            )
        if not summary.train_rows or not (summary.holdout_rows or corpus_id in canaries):
            raise ConfigError(
                f"the policy monitors corpus '{corpus_id}', but it has {summary.train_rows} training "
                f"rows, {summary.holdout_rows} held-out rows and no canaries: nothing to measure"
            )


def code_directory(config: ExperimentConfig, code: CodeSnapshot) -> Path:
    """Where the experiment keeps a trial's code snapshot: ``STORAGE/code/DIGEST``."""
    return open_storage(config.storage_path).root / "code" / code.digest


def recorded_trial_code(config: ExperimentConfig, trial: TrialRecord) -> CodeSnapshot:
    """Make this process import the trial class from ``trial``'s recorded code snapshot,
    verified against its digests (a changed or missing file is refused, named), whatever the
    working directory: what a replay or a resume of it runs. Call it before anything imports
    the trial (the policy check does)."""
    if trial.reproducibility_json is None:
        raise TrainingFailed(f"trial {trial.id} recorded no code snapshot: it cannot be rerun as it ran")
    code = ReproducibilityRecord.model_validate_json(trial.reproducibility_json).code
    use_recorded_code(code, code_directory(config, code), open_storage(config.storage_path))
    return code


def on_recorded_code(spec: RunSpec, directory: Path) -> RunSpec:
    """``spec`` with its workers importing the trial from the verified snapshot at ``directory``."""
    return spec.model_copy(update={"code_dir": str(directory), "recorded_code": True})


def run_spec_path(config: ExperimentConfig, run_name: str) -> Path:
    return open_storage(config.storage_path).root / "runs" / f"{run_name}.json"


def control_path(config: ExperimentConfig, run_name: str) -> Path:
    """Where the driver passes a pause/kill request to the run's rank 0 (shared storage)."""
    return open_storage(config.storage_path).root / "control" / run_name


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
        recorded_trial_code(config, trial)


def resume_trial(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    experiment: Experiment,
    store: TrackingStore,
    *,
    progress: Progress | None = None,
) -> TrialOutcome:
    """Continue the experiment's interrupted or paused trial from its latest checkpoint.

    The run keeps its Ray Train name, so Ray Train restores its checkpoint; the workers recompute
    the schedule from there, running the trial's recorded code. Refused if the policy changed
    since the run started.
    """
    trial = interrupted_trial(store, experiment)
    if trial is None:
        raise TrainingFailed(
            f"experiment {experiment.id} '{experiment.name}' has no interrupted trial to resume"
        )
    assert trial.id is not None and trial.ray_run_name is not None
    path = run_spec_path(config, trial.ray_run_name)
    if not open_storage(config.storage_path).fetch(path):
        raise TrainingFailed(f"trial {trial.id}: {path} is missing; the run cannot be rebuilt")
    spec = RunSpec.model_validate_json(path.read_text())
    if spec.policy_digest != checked.policy.digest:
        raise TrainingFailed(
            f"trial {trial.id} ran under policy digest {spec.policy_digest[:16]}…, the policy is now "
            f"{checked.policy.digest[:16]}…: resume refused"
        )
    spec = on_recorded_code(spec, code_directory(config, recorded_trial_code(config, trial)))
    with mirrored(store, config.tracking.mlflow, trial.experiment_id):
        return _train(config, checked, experiment, store, trial.id, trial.ray_run_name, spec, progress)


def _train(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    experiment: Experiment,
    store: TrackingStore,
    trial_id: int,
    run_name: str,
    spec: RunSpec,
    progress: Progress | None,
) -> TrialOutcome:
    """Fit the trial's TorchTrainer (a run name that exists in storage resumes that run).

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
    events = TensorBoardLog(tensorboard_dir(open_storage(config.storage_path).root, run_name))
    recorder = RunRecorder(
        store,
        trial_id,
        (spec.routing or checked.routing).tensor_layers(),  # this trial's model (its hparams)
        gc,
        replaying=spec.recorded_decisions is not None,
        events=events,
        storage_path=config.storage_path,
        run_dir=spec.run_dir,
        trust=spec.trust,
    )
    sink = None
    if config.resources.workers > 1:  # rank 0 sends its reports here without waiting
        spec = spec.model_copy(update={"report_sink": f"govray-reports-{run_name}-{uuid.uuid4().hex[:6]}"})
        sink = open_sink(spec.report_sink)
    trainer = governed_trainer(config, spec, run_name, deliver=recorder.record)
    recorder.settle()  # a resumed run: what its killed attempt (or its orphaned workers) left on storage
    recorder.rewrite_events()
    # Ray Train's own index of a run's checkpoints (written by runs from before govray sealed its
    # checkpoints itself) may name folders GC deleted since; a resumed controller refuses those.
    open_storage(config.storage_path).delete_file(Path(spec.run_dir) / RAY_CHECKPOINT_INDEX)
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
        control.unlink(missing_ok=True)
        store.request(experiment.id, None)
        events.publish(open_storage(config.storage_path))  # written here
    _close_sink(sink, recorder)
    recorder.settle()
    metrics = {metric.name: metric.value for metric in store.metrics(trial_id)}  # latest value per name
    trial = store.get_trial(trial_id)
    steps_done = trial.last_step or 0
    if steps_done < max_steps and trial.stop_reason != "early_stop":
        stopped = _requested_stop(trial.stop_reason, trial_id, run_name, steps_done, max_steps)
        store.set_trial_state(trial_id, stopped)
        store.set_experiment_state(experiment.id, stopped.value)
        return TrialOutcome(
            trial_id, run_name, Path(spec.run_dir), max_steps, metrics, None, stopped.value, steps_done
        )
    ledger = stored_ledger(store, trial_id)
    # Rank 0 may have written the final checkpoint on another node: fetch it.
    storage = open_storage(config.storage_path)
    storage.fetch_latest(Path(spec.run_dir), "checkpoint_")
    attested = attest_trial_end(store, trial_id, Path(spec.run_dir))  # signed provenance and coverage
    if attested is not None:  # kept next to the checkpoint, in object storage too
        storage.upload(attested.provenance, attested.coverage)
    store.set_trial_state(trial_id, TrialState.COMPLETED)
    store.set_experiment_state(experiment.id, ExperimentState.COMPLETED)
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
    """``trainer.fit()`` in a thread while the driver records the reports its sink queued, shows
    them, and passes a pause/kill request (``govray experiment pause|kill``) to rank 0."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:  # re-raised in the driver thread
            outcome["error"] = error

    thread = threading.Thread(target=fit, name="govray-fit", daemon=True)
    thread.start()
    seen = 0
    passed: str | None = None
    while thread.is_alive():
        thread.join(timeout=0.5)
        requested = store.get_experiment(experiment_id).requested
        if requested is not None and requested != passed:
            control.parent.mkdir(parents=True, exist_ok=True)
            scratch = control.with_suffix(".tmp")
            scratch.write_text(requested)
            scratch.replace(control)  # rank 0 never reads half a word
            passed = requested
        if sink is not None:
            for report in taken_reports(sink):
                recorder.record(report)
        latest = recorder.latest
        if progress is not None and latest is not None and latest.step > seen:
            seen = latest.step
            progress(seen, max_steps, latest.metrics)
    if "error" in outcome:
        raise outcome["error"]
    result: ray.train.Result = outcome["result"]
    return result


def _worker_error(error: BaseException) -> str:
    """The innermost cause, which is usually the worker's own exception."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"


def refusals(
    config: ExperimentConfig, checked: CheckedPolicy, start_checkpoint: Path | None = None
) -> Callable[[IngestResult], None]:
    """A ``check`` for ``ingest_experiment``: what ``run_trial`` and ``run_search`` would refuse
    on these shards (canaries, monitored corpora, a tampered or foreign start checkpoint), refused
    before the experiment is created, so a refused run leaves only its audit events."""

    def check(ingested: IngestResult) -> None:
        trust = platform_trust(
            platform_key(), load_trust(config.policy.trust) if config.policy.trust else None
        )
        if start_checkpoint is not None:
            load_checkpoint(start_checkpoint, trust)
        hparams = config.default_hparams()
        new_run_spec(
            config,
            checked,
            ingested.root,
            "preflight",
            hparams=hparams,
            trial_seed=0,
            reproducibility={},
            trust=trust,
        )

    return check
