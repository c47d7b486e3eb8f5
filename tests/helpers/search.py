"""Searches of the digits example the search tests share: experiments, plans, runs, what they record."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from govray.config.experiment import load_experiment
from govray.core.keys import platform_key, platform_trust
from govray.core.storage import open_storage
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.search.began import search_path
from govray.platform.search.driver import SearchOutcome, TunePlan, run_search, strategy
from govray.platform.search.progress import SearchState
from govray.provenance.recompute import check_attested_ledger
from govray.provenance.statement_types import COVERAGE_TYPE
from govray.provenance.verify import verify_attestation
from govray.tracking.lineage import attestations, checkpoints
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import model_file
from jobs.examples.digits.golden import golden_example as golden_example_at

SEARCH_HPARAMS: dict[str, Any] = {
    "hidden": {"type": "categorical", "vals": [8, 16]},
    "dropout": 0.0,
    "lr": {"type": "log", "minval": -2.0, "maxval": -1.0, "base": 10, "count": 2},
    "optimizer": "sgd",
    "batch_size": 16,
}


def search_example(
    root: Path,
    searcher: dict[str, Any],
    workers: int = 1,
    cpus_per_worker: float = 1.0,
    lr_schedule: dict[str, Any] | None = None,
    validation_period: int = 5,
) -> Path:
    path = golden_example_at(root, workers=workers, max_length={"batches": 20}, hparams=SEARCH_HPARAMS)
    raw = yaml.safe_load(path.read_text())
    raw["resources"]["cpus_per_worker"] = cpus_per_worker
    raw["searcher"] = {"metric": "validation_loss", "smaller_is_better": True, **searcher}
    del raw["lr_schedule"], raw["min_validation_period"]
    if lr_schedule is not None:  # metric-driven decisions in every trial, at validations
        raw["lr_schedule"], raw["min_validation_period"] = lr_schedule, validation_period
    raw["checkpoint"] = {"period": 10, "save_trial_latest": 1, "save_trial_best": 1}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def plan_of(root: Path, searcher: dict[str, Any], max_steps: int = 64) -> TunePlan:
    config = load_experiment(search_example(root, searcher))
    return strategy(config.searcher.name)(config, max_steps)


def searched(
    root: Path,
    searcher: dict[str, Any],
    workers: int = 1,
    report_every: int = 5,
    cpus_per_worker: float = 1.0,
    progress: Callable[[SearchState], None] | None = None,
    lr_schedule: dict[str, Any] | None = None,
) -> tuple[SearchOutcome, TrackingStore]:
    config = load_experiment(search_example(root, searcher, workers, cpus_per_worker, lr_schedule))
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    outcome = run_search(
        config, checked, experiment, ingested.root, store, report_every=report_every, progress=progress
    )
    return outcome, store


def assert_recorded(outcome: SearchOutcome, store: TrackingStore, trials: int) -> None:
    assert len(outcome.trial_ids) == trials
    for trial_id in outcome.trial_ids:
        trial = store.get_trial(trial_id)
        assert trial.state == "completed", trial
        assert set(json.loads(trial.hparams_json)) == set(SEARCH_HPARAMS)
        assert [m.step for m in store.metrics(trial_id, "objective")], "no objective reported"
        assert_attested(store, trial_id)
    objectives = {t: store.metrics(t, "objective")[-1].value for t in outcome.trial_ids}
    best = min(objectives, key=objectives.__getitem__)
    assert outcome.best_trial_id == best and math.isclose(outcome.best_objective, objectives[best])


def assert_attested(store: TrackingStore, trial_id: int) -> None:
    """A search trial's last checkpoint (Tune's copy) is attested at its end, and the attested
    ledger is the one its recorded schedule gives (a PBT clone's too: it continued one schedule)."""
    final = [c for c in checkpoints(store, trial_id) if c.state == "active"][-1]
    records = attestations(store, final.id)  # type: ignore[arg-type]
    assert len(records) == 2, f"trial {trial_id}: {len(records)} attestations of its last checkpoint"
    trust = platform_trust(platform_key())
    for record in records:
        envelope = Path(final.path).parent / f"check-{record.id}.dsse.json"
        envelope.write_text(record.envelope_json)
        verified = verify_attestation(envelope, model_dir=Path(final.path), trust=trust)
        envelope.unlink()
        if verified.statement["predicateType"] == COVERAGE_TYPE:
            assert check_attested_ledger(verified.statement, Path(final.path), trust) > 0


def searched_from(path: Path) -> tuple[SearchOutcome, TrackingStore, Path]:
    """The search of the experiment file ``path``, its store, and where Tune kept its state."""
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    outcome = run_search(config, checked, experiment, ingested.root, store, report_every=5)
    return outcome, store, search_path(open_storage(config.storage_path), config, experiment)


def grid_of_lrs(root: Path, lrs: list[float]) -> Path:
    """A 1-worker grid search of 10 batches a trial over learning rates ``lrs`` (hidden 8)."""
    path = search_example(root, {"name": "grid", "max_length": {"batches": 10}})
    raw = yaml.safe_load(path.read_text())
    raw["hyperparameters"]["hidden"] = 8
    raw["hyperparameters"]["lr"] = {"type": "categorical", "vals": lrs}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def final_model(store: TrackingStore, trial_id: int) -> bytes:
    final = [c for c in checkpoints(store, trial_id) if c.state == "active"][-1]
    return model_file(Path(final.path)).read_bytes()
