"""Hyperparameter search on Ray Tune: every trial a governed run, recorded in the tracking store.

A strategy (``searchers/`` — grid, random, asha, pbt, bayesian) turns the experiment's
``searcher:`` section into a ``TunePlan``: the parameter space, a search algorithm and a trial
scheduler. govray finds strategies through the ``govray.searchers`` entry points, so it never
imports ``searchers/``. Each Tune trial runs the governed training loop: one worker inside the
Tune trial (a 1-worker CPU trial in a warm trial host the job keeps across searches:
``govray.platform.search.hosts``), N workers in one nested ``TorchTrainer`` run that keeps its
workers across rungs. At
every validation it reports ``objective = metric ± λ·memorization_score`` (all-reduced over
ranks), with a signed govray checkpoint as the Tune checkpoint, so ASHA stops memorizers and PBT
clones a donor's full state (weights, optimizer, ledger).

The driver's ``SearchTracking`` (a Tune ``Callback``) is the only writer of the search's rows:
trials, states, metrics, checkpoints, decisions, ledgers.

Example::

    outcome = run_search(config, checked, experiment, shard_root, store)
    print(outcome.best_trial_id, outcome.best_objective)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.tune
from ray.tune.schedulers import PopulationBasedTraining
from ray.tune.search.basic_variant import BasicVariantGenerator

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SEARCHER_GROUP, TunePlan, installed_searchers
from govray.core.errors import ConfigError
from govray.core.storage import Storage, open_storage
from govray.data.shards import ShardSet
from govray.platform.mlflow_mirror import mirrored
from govray.platform.run.plan import RunPlan, plan_run
from govray.platform.run.preflight import CheckedPolicy, ingest_experiment
from govray.platform.run.recorder import GcSettings
from govray.platform.search.began import began_record, check_corpora, keep_record, search_path
from govray.platform.search.hosts import hosted_trial, hosts_enabled, trial_hosts
from govray.platform.search.progress import SearchProgress, SearchState
from govray.platform.search.tracking import SearchTracking
from govray.platform.search.tune_state import StateSealer, restore_sealed_state
from govray.platform.search.tune_trial import (
    TUNE_TRIAL_MEMORY,
    SearchError,
    SearchSetup,
    ends_trial,
    trial_run_name,
    tune_trial,
)
from govray.signer.local import close_channel, open_channel
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, TrialKind
from govray.train.reproduce.record import ReproducibilityRecord, build_record
from govray.train.reproduce.snapshots import verify_corpora_unchanged

Strategy = Callable[[ExperimentConfig, int], TunePlan]  # (config, max steps of one trial)


def strategy(name: str) -> Strategy:
    """The installed strategy called ``name`` (an entry point in ``govray.searchers``)."""
    found = installed_searchers()
    if name not in found:
        installed = ", ".join(sorted(found)) or "none"
        raise ConfigError(f"no searcher '{name}' is installed (entry points {SEARCHER_GROUP}: {installed})")
    loaded: Strategy = found[name].load()
    return loaded


@dataclass(frozen=True)
class SearchOutcome:
    trial_ids: list[int]  # every trial of the search, in the order Tune started them
    best_trial_id: int
    best_hparams: dict[str, Any]
    best_objective: float
    plan: TunePlan


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
    """Plan the search's default sample (:func:`govray.platform.run.plan.plan_run`), then run it
    (:func:`search_planned`)."""
    planned = plan_run(config, checked, shard_root, report_every=report_every)
    return search_planned(planned, experiment, store, progress=progress)


def resume_search(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    experiment: Experiment,
    store: TrackingStore,
    *,
    progress: Callable[[SearchState], None] | None = None,
) -> SearchOutcome:
    """`govray resume` of a search: the experiment's shards (ingested again, refused if a corpus's
    bytes changed), then its search where Ray Tune left off, running the code and threads it
    began with, without rerunning finished trials."""
    began = began_record(store, open_storage(config.storage_path), config, experiment)
    if began is not None:  # refused before the ingest records other bytes
        verify_corpora_unchanged(config.data.corpora, began.corpora, since="the search began")
    ingested_into, ingested = ingest_experiment(config, checked, store)
    if ingested_into.id != experiment.id:
        raise SearchError(
            f"experiment {experiment.id} is not the newest of its config (experiment {ingested_into.id} "
            f"is): resume that one"
        )
    return search_planned(plan_run(config, checked, ingested.root), experiment, store, progress=progress)


def search_planned(
    planned: RunPlan,
    experiment: Experiment,
    store: TrackingStore,
    *,
    progress: Callable[[SearchState], None] | None = None,
) -> SearchOutcome:
    """Run (or, when its Tune state exists, resume) the experiment's search; returns the best trial.
    ``planned`` (the default sample's plan) gives the trials' length to the strategy, and the
    storage, checked policy and trust every trial shares. ``progress`` is shown the search's state
    whenever it changes (Tune itself prints nothing)."""
    from ray.tune import Tuner

    assert experiment.id is not None
    config, storage, checked = planned.config, planned.storage, planned.checked
    plan = strategy(config.searcher.name)(config, planned.spec.max_steps)
    path = search_path(storage, config, experiment)
    # Object storage: Tune keeps its state and the trials' checkpoints in the bucket.
    restoring = Tuner.can_restore(storage.ray_path(path), storage_filesystem=storage.filesystem)
    # Tune unpickles its state on a resume: only the state the signer sealed goes back there.
    restored = restore_sealed_state(storage, path, checked.trust) if restoring else -1
    # Every trial of the search imports this code snapshot and trains on these threads, and its
    # row keeps the record before it trains (as a run's does): a replay reruns exactly that. A
    # resumed search goes on with the code and threads it began with, on the same corpus bytes.
    record = _search_record(planned, experiment, store, restoring, path)
    setup = SearchSetup(
        config_json=config.model_dump_json(),
        checked=checked,
        shard_root=str(planned.shard_root),
        reproducibility=record.model_dump(mode="json"),
        report_every=planned.spec.report_every,
        validation_period=plan.validation_period,
        database_url=config.database_url,
        code=record.code,
        threads=record.threads,
    )
    tracking = SearchTracking(
        config.database_url,
        config,
        storage,
        checked.routing.tensor_layers(),
        GcSettings(
            experiment.id,
            config.searcher.metric,
            config.searcher.smaller_is_better,
            # PBT may clone any earlier checkpoint it kept for a donor: GC waits for the search's end.
            as_it_goes=not isinstance(plan.scheduler, PopulationBasedTraining),
        ),
        reproducibility=record.model_dump_json(),
    )
    trainable = _trainable(config, setup, record)
    channel = open_channel(path, None)  # the driver's own, for the search's Tune state: no checkpoint
    callbacks: list[ray.tune.Callback] = [tracking, StateSealer(storage, path, channel, after=restored)]
    if progress is not None:
        callbacks.append(SearchProgress(progress, config, tracking.row, plan.notes.get("rungs")))
    # Tune saves its experiment state at most this often: a trial finished before an interruption
    # is known finished to the resumed search (Tune's "auto" waits 10 s or more).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    # Tune's new output engine prints its tables even at verbose=0; the old one is silent there.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    store.set_experiment_state(experiment.id, "active")
    tracking.guard.begin()
    try:
        tuner = _tuner(config, plan, trainable, callbacks, storage, path, restoring=restoring)
        with mirrored(store, config.tracking.mlflow, experiment.id):
            try:
                results = tuner.fit()  # its end releases every group of its runs (the guard)
            except BaseException:  # an interrupted or failed search's groups go too
                with contextlib.suppress(Exception):  # never in place of what stopped it
                    tracking.guard.release_all()
                raise
        tracking.collect_garbage()  # every trial is done: nothing can be cloned any more
    except Exception:
        store.set_experiment_state(experiment.id, "errored")
        raise
    finally:
        close_channel(channel)
    return _outcome(store, experiment.id, config, results, plan)


def _search_record(
    planned: RunPlan, experiment: Experiment, store: TrackingStore, restoring: bool, path: Path
) -> ReproducibilityRecord:
    """The record every trial of the search keeps: a new search's (kept now, vouched for by the audit
    log's ``search.began``), or the one a resumed search began with (its corpora unchanged)."""
    config, storage = planned.config, planned.storage
    began = began_record(store, storage, config, experiment) if restoring else None
    if restoring and began is None:
        raise SearchError(
            f"search {path.name} has Ray Tune state but no record of how it began (the audit log's "
            "search.began): its trials cannot go on as they began; start a new experiment"
        )
    if began is not None:
        check_corpora(began, ShardSet.open(planned.shard_root).manifest)
    record = build_record(
        config,
        storage.root,
        config_digest=planned.spec.config_digest,
        threads=began.threads if began is not None else planned.spec.threads,
        code=began.code if began is not None else None,
    )
    if began is None:
        keep_record(store, storage, config, experiment, record)
    return record


def _trainable(config: ExperimentConfig, setup: SearchSetup, record: ReproducibilityRecord) -> Any:
    """The function each Tune trial runs: in a warm trial host (a 1-worker CPU trial) or in its Tune
    actor, with the resources its Tune trial holds."""
    if hosts_enabled(config.resources.max_workers, config.resources.use_gpu):
        # A 1-worker CPU trial trains in a warm trial host; its Tune actor never opens the setup.
        function = ray.tune.with_parameters(
            hosted_trial, setup=[ray.put(setup)], hosts=trial_hosts(), code=record.code.digest
        )
        # Tune restores a search by its trainable's name: one begun in Tune actors resumes hosted.
        function.__name__ = tune_trial.__name__
    else:
        function = ray.tune.with_parameters(tune_trial, setup=setup)
    return ray.tune.with_resources(
        function,
        # An N-worker trial's nested TorchTrainer reserves its workers' CPUs itself (a placement
        # group); a Tune trial holding any CPU would starve it (0.1 + 2 x 1 CPU > 2 cores), and Tune
        # refuses an empty request: the Tune trial asks for a little memory instead.
        {"CPU": config.resources.cpus_per_worker}
        if config.resources.max_workers == 1
        else {"memory": TUNE_TRIAL_MEMORY},
    )


def _tuner(
    config: ExperimentConfig,
    plan: TunePlan,
    trainable: Any,
    callbacks: list[ray.tune.Callback],
    storage: Storage,
    path: Path,
    *,
    restoring: bool,
) -> Any:
    """A new search's Tuner, or the interrupted one's restored with this run's callbacks."""
    from ray.tune import TuneConfig, Tuner

    if restoring:
        tuner = Tuner.restore(
            storage.ray_path(path),
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
                # A 1-worker trial trains in the Tune actor or its trial host: a reused one
                # saves a start (per-step seeding: nothing of an earlier trial reaches the next).
                # An N-worker trial's run is owned by its actor, which must end with it.
                reuse_actors=config.resources.max_workers == 1,
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
    return tuner


def _outcome(
    store: TrackingStore, experiment_id: int, config: ExperimentConfig, results: Any, plan: TunePlan
) -> SearchOutcome:
    """The finished search's trials and its best one (refused when no trial reported an objective)."""
    trials = [  # (replays of its trials are trials of the experiment too, not of the search)
        t
        for t in store.list_trials(experiment_id)
        if t.ray_run_name and t.ray_run_name.startswith(config.name) and t.kind == TrialKind.ORIGINAL
    ]
    best = results.get_best_result(
        metric="objective", mode="min" if config.searcher.smaller_is_better else "max", scope="all"
    )
    if best.metrics is None or "objective" not in best.metrics:
        store.set_experiment_state(experiment_id, "errored")
        raise SearchError(
            f"search of experiment {experiment_id} finished without any trial reporting an objective"
        )
    best_run = trial_run_name(config, best.metrics["trial_id"])
    best_row = next(t for t in trials if t.ray_run_name == best_run)
    store.set_experiment_state(experiment_id, "completed")
    assert best_row.id is not None
    return SearchOutcome(
        trial_ids=[t.id for t in trials if t.id is not None],
        best_trial_id=best_row.id,
        best_hparams=json.loads(best_row.hparams_json),
        best_objective=float(best.metrics["objective"]),
        plan=plan,
    )
