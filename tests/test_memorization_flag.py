"""The memorization score in a real governed run: a configuration made to memorize (random labels
on a corpus, a wide model, many epochs) gets that corpus flagged; a normal one gets none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import yaml

from govray.config import load_experiment
from govray.preflight import check_policy, ingest_experiment
from govray.runner import TrialOutcome, run_trial
from govray.tracking.store import TrackingStore
from tests.conftest import _golden_example


def trained(
    root: Path, hparams: dict[str, Any], steps: int, random_labels: bool
) -> tuple[TrialOutcome, TrackingStore]:
    path = _golden_example(root, workers=1, max_length={"batches": steps}, hparams=hparams, lr_schedule=False)
    if random_labels:
        public = root / "data" / "public.parquet"
        table = pq.read_table(public)
        shuffled = np.random.default_rng(0).permutation(table.column("label").to_numpy())
        pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", [shuffled]), public)
    raw = yaml.safe_load(path.read_text())
    raw["min_validation_period"] = steps  # one validation, at the end
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    return run_trial(config, checked, experiment, ingested.root, store, report_every=steps), store


def latest(store: TrackingStore, trial_id: int) -> dict[str, float]:
    return {metric.name: metric.value for metric in store.metrics(trial_id)}


def test_a_memorizing_configuration_is_flagged_and_a_normal_one_is_not(
    ray_session: None, tmp_path: Path
) -> None:
    memorizer = {"hidden": 256, "dropout": 0.0, "lr": 0.003, "optimizer": "adamw", "batch_size": 32}
    outcome, store = trained(tmp_path / "memorizer", memorizer, steps=1500, random_labels=True)
    metrics = latest(store, outcome.trial_id)
    # Random labels can only be memorized: training rows are fit, held-out rows stay at chance.
    assert metrics["loss_gap/digits-public"] > 1.0, metrics
    assert metrics["memorization_score"] >= 1.0 and metrics["memorization_flagged"] >= 1

    normal = {"hidden": 64, "dropout": 0.1, "lr": 0.01, "optimizer": "adamw", "batch_size": 32}
    outcome, store = trained(tmp_path / "normal", normal, steps=200, random_labels=False)
    metrics = latest(store, outcome.trial_id)
    assert metrics["validation_accuracy"] > 0.8, metrics  # it learned, and generalizes
    assert metrics["memorization_flagged"] == 0 and metrics["memorization_score"] < 1.0, metrics
    assert all(abs(value) < 0.5 for name, value in metrics.items() if name.startswith("loss_gap/"))
