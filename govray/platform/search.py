"""Hyperparameter search on Ray Tune: every trial a governed run, recorded in the tracking store.

A strategy (``searchers/`` — grid, random, asha, pbt, bayesian) turns the experiment's
``searcher:`` section into a ``TunePlan``: the parameter space, a search algorithm and a trial
scheduler. govray finds strategies through the ``govray.searchers`` entry points, so it never
imports ``searchers/``. Each Tune trial runs the governed training loop: one worker in Train V2
local mode inside the Tune trial, N workers in a nested ``TorchTrainer``. At every validation it
reports ``objective = metric ± λ·memorization_score`` (all-reduced over ranks), with a signed
govray checkpoint as the Tune checkpoint, so ASHA stops memorizers and PBT clones a donor's full
state (weights, optimizer, ledger).

The driver's ``SearchTracking`` (a Tune ``Callback``) is the only writer of the search's rows:
trials, states, metrics, checkpoints, decisions, ledgers.

Example::

    outcome = run_search(config, checked, experiment, shard_root, store)
    print(outcome.best_trial_id, outcome.best_objective)
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import ray.tune
from ray.tune.schedulers import PopulationBasedTraining
from ray.tune.search.basic_variant import BasicVariantGenerator

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SEARCHER_GROUP
from govray.core.errors import ConfigError, GovrayError
from govray.core.keys import TrustConfig, load_trust, platform_key, platform_trust
from govray.core.storage import open_storage
from govray.data.schedule import SCHEDULE_VERSION
from govray.platform.mlflow_mirror import mirrored
from govray.platform.preflight import CheckedPolicy, config_digest
from govray.platform.recorder import GcSettings, RunRecorder
from govray.platform.runner import governed_trainer, last_step, new_run_spec
from govray.platform.search_progress import SearchProgress, SearchState
from govray.provenance.attest import attest_trial_end
from govray.tracking.store import TrackingStore
from govray.tracking.tables import DecisionKind, Experiment, TrialState
from govray.tracking.tensorboard import TensorBoardLog, tensorboard_dir
from govray.train.checkpoint import (
    checkpoint_report,
    checkpoint_run,
    checkpoint_schedule_version,
    checkpoint_step,
    newest_verified_checkpoint,
)
from govray.train.loop import train_worker
from govray.train.reports import StepReport
from govray.train.reproducibility import build_record
from govray.train.runspec import RunSpec
from govray.train.session import LAST_KEY, TuneSession, open_sink, taken_reports, tune_reports, tune_result

TUNE_TRIAL_MEMORY = 64 * 1024**2  # what the Tune trial of an N-worker trial reserves (bytes)


class SearchError(GovrayError):
    """The search cannot start or finished without a usable trial."""

    exit_code = 15


@dataclass(frozen=True)
class TunePlan:
    """What a strategy asks of Ray Tune for one experiment."""

    param_space: dict[str, Any]
    num_samples: int
    max_concurrent_trials: int
    search_alg: Any = None  # a ray.tune.search.Searcher, or None: Tune's variant generator
    scheduler: Any = None  # a ray.tune.schedulers.TrialScheduler, or None: FIFO
    validation_period: int | None = None  # steps between reports, when the config sets none
    notes: dict[str, Any] = field(default_factory=dict)  # derived settings, shown to the user


Strategy = Callable[[ExperimentConfig, int], TunePlan]  # (config, max steps of one trial)


def strategy(name: str) -> Strategy:
    """The installed strategy called ``name`` (an entry point in ``govray.searchers``)."""
    found = {point.name: point for point in entry_points(group=SEARCHER_GROUP)}
    if name not in found:
        installed = ", ".join(sorted(found)) or "none"
        raise ConfigError(f"no searcher '{name}' is installed (entry points {SEARCHER_GROUP}: {installed})")
    loaded: Strategy = found[name].load()
    return loaded


@dataclass(frozen=True)
class SearchSetup:
    """What every Tune trial needs besides its hyperparameters (plain data: it crosses processes)."""

    config_json: str
    checked: CheckedPolicy
    shard_root: str
    trust_json: str
    reproducibility: dict[str, Any]
    report_every: int
    validation_period: int | None
    database_url: str


def trial_run_name(config: ExperimentConfig, tune_trial_id: str) -> str:
    return f"{config.name}-{tune_trial_id}"


def tune_trial(params: dict[str, Any], setup: SearchSetup) -> None:
    """The Tune function trainable: one governed trial, reporting at every validation with its
    signed checkpoint (Tune hands a restored or PBT-cloned trial that checkpoint back)."""
    config = ExperimentConfig.model_validate_json(setup.config_json)
    hparams = {name: params[name] for name in config.hyperparameters}
    run_name = trial_run_name(config, ray.tune.get_context().get_trial_id())
    restored = ray.tune.get_checkpoint()
    with restored.as_directory() if restored is not None else tempfile.TemporaryDirectory() as scratch:
        # A restored trial or a PBT clone continues its checkpoint's schedule (a search begun
        # before schedule version 2 keeps version 1).
        version = checkpoint_schedule_version(Path(scratch)) if restored is not None else SCHEDULE_VERSION
        spec = new_run_spec(
            config,
            setup.checked,
            Path(setup.shard_root),
            run_name,
            hparams=hparams,
            trial_seed=0,
            reproducibility=setup.reproducibility,
            trust=TrustConfig.model_validate_json(setup.trust_json),
            report_every=setup.report_every,
            validation_period=setup.validation_period,
            schedule_version=version,
        ).model_copy(update={"resume_checkpoint": scratch if restored is not None else ""})
        if config.resources.workers == 1:
            _local_trial(config, spec)
        else:
            _segmented_trial(config, spec)


def ends_trial(trial_id: str, result: Mapping[str, Any]) -> bool:
    """Tune's stopper: a trial's last result ends it before any scheduler
    sees it. Synchronous PBT would otherwise pause a finished trial at its last step to wait for
    the others, and could then hand one's final state to another trial with nothing left to train."""
    return bool(result.get(LAST_KEY))


def _local_trial(config: ExperimentConfig, spec: RunSpec) -> None:
    """One worker, in this Tune trial's process (Ray 2.60 refuses Ray Train's session API inside
    Tune functions, also in Train V2 local mode): a ``TuneSession``."""
    train_worker(spec.model_dump(mode="json"), session=TuneSession)


def _segment_reports(reported: list[StepReport], last: StepReport) -> list[StepReport]:
    """The segment's reports in step order, ending with its result (a restarted worker group
    re-reports the steps after its checkpoint: the later copy counts)."""
    by_step = {report.step: report for report in reported if report.step <= last.step}
    by_step[last.step] = last
    return [by_step[step] for step in sorted(by_step)]


def _segmented_trial(config: ExperimentConfig, spec: RunSpec) -> None:
    """N workers in nested TorchTrainers, one per segment between validations. Each segment ends
    with a signed checkpoint that becomes the Tune checkpoint, so Tune (PBT) can hand any trial's
    state to another; the next segment resumes from it under a fresh Ray Train run name. Every
    report of the segment reaches Tune with its validation."""
    from ray.train import Checkpoint

    resume = spec.resume_checkpoint
    start = checkpoint_step(Path(resume)) if resume else 0
    period = spec.validation_period or spec.max_steps
    # A PBT clone of a finished donor has nothing left to train: one segment ends it with the
    # donor's state checkpointed under this trial's name.
    cloned = bool(resume) and checkpoint_run(Path(resume)) != spec.run_name
    while start < spec.max_steps or cloned:
        cloned = False
        end = min(spec.max_steps, (start // period + 1) * period)
        segment = spec.model_copy(update={"max_steps": end, "resume_checkpoint": resume})
        name = f"{Path(spec.run_dir).name}-{end:06d}-{uuid.uuid4().hex[:6]}"
        storage = open_storage(config.storage_path)
        run_dir = storage.root / "ray" / name
        sink = open_sink(f"govray-reports-{name}")  # rank 0's reports, for Tune
        try:
            segment = segment.model_copy(
                update={"run_dir": str(run_dir), "report_sink": f"govray-reports-{name}"}
            )
            governed_trainer(config, segment, name).fit()
            reported = taken_reports(sink)
        finally:
            ray.kill(sink)
        # The segment's end is its newest verified checkpoint, by the rule its workers resume by
        # (Ray Train's result lacks it when a worker died before Ray collected the last report);
        # the report that went with it is in the checkpoint.
        final = newest_verified_checkpoint(run_dir, spec.trust, storage if storage.is_remote else None)
        last = checkpoint_report(final) if final is not None else {}
        if final is None or not last:
            raise SearchError(f"segment {start}..{end} of {spec.run_dir} ended without a checkpoint")
        relayed = tune_result(_segment_reports(reported, StepReport.parse(last)), spec.max_steps)
        ray.tune.report(relayed, checkpoint=Checkpoint(storage.ray_path(final), storage.filesystem))
        if StepReport.parse(last).stop == "early_stop":
            return  # the trial's last report (with its ledger): the rest of its steps never run
        # The next segment resumes from it: a directory in the nodes' cache of object storage.
        resume, start = str(final), end


class SearchTracking(ray.tune.Callback):
    """On the driver: the search's trials in the tracking store, each through its ``RunRecorder``
    (one owner per row)."""

    def __init__(
        self, database_url: str, config: ExperimentConfig, layers: dict[str, int | None], gc: GcSettings
    ) -> None:
        self.database_url = database_url
        self.experiment_id = gc.experiment_id
        self.config = config
        self.layers = layers
        self.gc = gc
        self._store: TrackingStore | None = None
        self.recorders: dict[str, RunRecorder] = {}  # Tune trial id → its trial's recorder

    @property
    def store(self) -> TrackingStore:
        if self._store is None:
            self._store = TrackingStore.open(self.database_url)
        return self._store

    def recorder(self, trial: Any) -> RunRecorder:
        """The trial's recorder; its row is created on first sight (a restored search finds its
        rows by run name)."""
        if trial.trial_id in self.recorders:
            return self.recorders[trial.trial_id]
        run_name = trial_run_name(self.config, trial.trial_id)
        known = [t for t in self.store.list_trials(self.experiment_id) if t.ray_run_name == run_name]
        if known:
            row_id = known[0].id
        else:
            hparams = {name: trial.config[name] for name in self.config.hyperparameters}
            created = self.store.create_trial(self.experiment_id, json.dumps(hparams, sort_keys=True), seed=0)
            row_id = created.id
            self.store.set_trial_state(row_id, TrialState.ACTIVE, ray_run_name=run_name)  # type: ignore[arg-type]
        assert row_id is not None
        root = open_storage(self.config.storage_path).root
        self.recorders[trial.trial_id] = RunRecorder(
            self.store, row_id, self.layers, self.gc, events=TensorBoardLog(tensorboard_dir(root, run_name))
        )
        return self.recorders[trial.trial_id]

    def row(self, trial: Any) -> int:
        return self.recorder(trial).trial_id

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.store.set_trial_state(self.row(trial), TrialState.ACTIVE)

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        recorder = self.recorder(trial)
        for report in tune_reports(result):
            recorder.record_once(report)  # a restarted trial re-reports the steps after its checkpoint

    def on_checkpoint(
        self, iteration: int, trials: list[Any], trial: Any, checkpoint: Any, **info: Any
    ) -> None:
        # Tune's copy, by its path in this node's cache (recorded with the stored manifest's digest)
        path = open_storage(self.config.storage_path).cached(checkpoint.path)
        self.recorder(trial).record_checkpoint(str(path), checkpoint_step(path))

    def collect_garbage(self) -> None:
        RunRecorder.collect_all(self.store, self.gc)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        row_id = self.row(trial)
        if not trial.last_result.get(LAST_KEY):  # stopped by the scheduler first: a recorded early stop
            seq = len(self.store.decisions(row_id))
            step = last_step(self.store, row_id)
            decision = {
                "seq": seq,
                "step": step,
                "kind": DecisionKind.EARLY_STOP.value,
                "reason": "scheduler",
                "metric": self.config.searcher.metric,
                "observed": None,
            }
            self.store.record_decisions(row_id, [decision], replayed=False)
        attested = attest_trial_end(self.store, row_id)  # its last checkpoint, signed provenance and coverage
        if attested is not None:  # kept next to the checkpoint, in object storage too
            open_storage(self.config.storage_path).upload(attested.provenance, attested.coverage)
        self.store.set_trial_state(row_id, TrialState.COMPLETED)
        self._close_events(trial)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.store.set_trial_state(self.row(trial), TrialState.ERRORED)
        self._close_events(trial)

    def _close_events(self, trial: Any) -> None:
        if (recorder := self.recorders.get(trial.trial_id)) is not None and recorder.events is not None:
            recorder.events.publish(open_storage(self.config.storage_path))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "recorders": {}}


@dataclass(frozen=True)
class SearchOutcome:
    trial_ids: list[int]  # every trial of the search, in the order Tune started them
    best_trial_id: int
    best_hparams: dict[str, Any]
    best_objective: float
    plan: TunePlan


def search_path(config: ExperimentConfig, experiment: Experiment) -> Path:
    """Where Ray Tune keeps the search's state (in this node's cache, for object storage)."""
    return open_storage(config.storage_path).root / "tune" / f"{config.name}-search{experiment.id}"


def run_search(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    experiment: Experiment,
    shard_root: Path,
    store: TrackingStore,
    *,
    report_every: int = 20,
    progress: Callable[[SearchState], None] | None = None,
) -> SearchOutcome:
    """Run (or, when its Tune state exists, resume) the experiment's search; returns the best trial.
    ``progress`` is shown the search's state whenever it changes (Tune itself prints nothing)."""
    from ray.tune import TuneConfig, Tuner

    assert experiment.id is not None
    max_steps = new_run_spec(
        config,
        checked,
        shard_root,
        "plan",
        hparams=config.default_hparams(),
        trial_seed=0,
        reproducibility={},
        trust=platform_trust(platform_key()),
    ).max_steps
    plan = strategy(config.searcher.name)(config, max_steps)
    key = platform_key()
    trust = platform_trust(key, load_trust(config.policy.trust) if config.policy.trust else None)
    storage = open_storage(config.storage_path)
    record = build_record(config, storage.root, config_digest=config_digest(config), threads=1)
    setup = SearchSetup(
        config_json=config.model_dump_json(),
        checked=checked,
        shard_root=str(shard_root),
        trust_json=trust.model_dump_json(),
        reproducibility=record.model_dump(mode="json"),
        report_every=report_every,
        validation_period=plan.validation_period,
        database_url=config.database_url,
    )
    tracking = SearchTracking(
        config.database_url,
        config,
        checked.routing.tensor_layers(),
        GcSettings(
            experiment.id,
            config.searcher.metric,
            config.searcher.smaller_is_better,
            # PBT may clone any earlier checkpoint it kept for a donor: GC waits for the search's end.
            as_it_goes=not isinstance(plan.scheduler, PopulationBasedTraining),
        ),
    )
    trainable = ray.tune.with_resources(
        ray.tune.with_parameters(tune_trial, setup=setup),
        # An N-worker trial's nested TorchTrainer reserves its workers' CPUs itself (a placement
        # group); a Tune trial holding any CPU would starve it (0.1 + 2 x 1 CPU > 2 cores), and Tune
        # refuses an empty request: the Tune trial asks for a little memory instead.
        {"CPU": config.resources.cpus_per_worker}
        if config.resources.workers == 1
        else {"memory": TUNE_TRIAL_MEMORY},
    )
    callbacks: list[ray.tune.Callback] = [tracking]
    if progress is not None:
        callbacks.append(SearchProgress(progress, config, tracking.row, plan.notes.get("rungs")))
    path = search_path(config, experiment)
    # Object storage: Tune keeps its state and the trials' checkpoints in the bucket.
    location = storage.ray_path(path)
    # Tune saves its experiment state at most this often: a trial finished before an interruption
    # is known finished to the resumed search (Tune's "auto" waits 10 s or more).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    # Tune's new output engine prints its tables even at verbose=0; the old one is silent there.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    store.set_experiment_state(experiment.id, "active")
    try:
        if Tuner.can_restore(location, storage_filesystem=storage.filesystem):
            tuner = Tuner.restore(
                location,
                trainable=trainable,
                resume_errored=True,
                param_space=plan.param_space,
                storage_filesystem=storage.filesystem,
            )
            # Tune resumes with the callbacks it pickled when the search began (there is no public
            # way to pass others): this run's tracking and view take their place.
            if tuner._local_tuner is not None:
                tuner._local_tuner.get_run_config().callbacks = callbacks
        else:
            tuner = Tuner(
                trainable,
                param_space=plan.param_space,
                tune_config=TuneConfig(
                    metric="objective",
                    mode="min" if config.searcher.smaller_is_better else "max",
                    num_samples=plan.num_samples,
                    # A sampler given as search_alg holds its own limit (Tune would ignore this one).
                    max_concurrent_trials=None
                    if isinstance(plan.search_alg, BasicVariantGenerator)
                    else plan.max_concurrent_trials,
                    search_alg=plan.search_alg,
                    scheduler=plan.scheduler,
                ),
                run_config=ray.tune.RunConfig(
                    name=path.name,
                    storage_path=storage.ray_path(path.parent),
                    storage_filesystem=storage.filesystem,
                    callbacks=callbacks,
                    stop=ends_trial,
                    verbose=0,
                ),
            )
        with mirrored(store, config.tracking.mlflow, experiment.id):
            results = tuner.fit()
        tracking.collect_garbage()  # every trial is done: nothing can be cloned any more
    except Exception:
        store.set_experiment_state(experiment.id, "errored")
        raise
    trials = [
        t
        for t in store.list_trials(experiment.id)
        if t.ray_run_name and t.ray_run_name.startswith(config.name)
    ]
    best = results.get_best_result(
        metric="objective", mode="min" if config.searcher.smaller_is_better else "max", scope="all"
    )
    if best.metrics is None or "objective" not in best.metrics:
        store.set_experiment_state(experiment.id, "errored")
        raise SearchError(
            f"search of experiment {experiment.id} finished without any trial reporting an objective"
        )
    best_run = trial_run_name(config, best.metrics["trial_id"])
    best_row = next(t for t in trials if t.ray_run_name == best_run)
    store.set_experiment_state(experiment.id, "completed")
    assert best_row.id is not None
    return SearchOutcome(
        trial_ids=[t.id for t in trials if t.id is not None],
        best_trial_id=best_row.id,
        best_hparams=json.loads(best_row.hparams_json),
        best_objective=float(best.metrics["objective"]),
        plan=plan,
    )
