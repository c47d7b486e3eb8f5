"""The digits example as the golden runs build it: the tests' shared runs (``tests/conftest.py``)
and the restructuring proof (``jobs/benchmarks/golden_digest.py``) use this one builder, so what
the tests check and what the digest proves are the same runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import yaml

REPO = Path(__file__).resolve().parents[3]
EXAMPLE_CONFIG = REPO / "jobs" / "examples" / "digits" / "experiment.yaml"
GOLDEN_HPARAMS: dict[str, Any] = {
    "hidden": 24,
    "dropout": 0.1,  # exercises per-step randomness
    "lr": 0.05,
    "optimizer": "sgd",  # the reference test recovers updates exactly from SGD steps
    "batch_size": 16,
    "max_grad_norm": 0.25,  # per-route-group clipping in play (it clips most early steps)
}
GOLDEN_STEPS = 30
GOLDEN_REPORT_EVERY = 10
# Made to memorize: wide, no dropout, trained for many epochs on a corpus with random labels
# (``with_random_labels``), which only memorizing can fit.
MEMORIZER: dict[str, Any] = {
    "hidden": 256,
    "dropout": 0.0,
    "lr": 0.003,
    "optimizer": "adamw",
    "batch_size": 32,
}


def with_random_labels(table: pa.Table) -> pa.Table:
    """``table`` with its ``label`` column shuffled by a fixed seed: the same random labels every run."""
    shuffled = np.random.default_rng(0).permutation(table.column("label").to_numpy())
    return table.set_column(table.schema.get_field_index("label"), "label", [shuffled])


def copy_example(root: Path) -> dict[str, Any]:
    """Copy the digits example's data and policies under ``root``; returns its experiment file's
    contents pointing at them, with storage under ``root`` too."""
    shutil.copytree(REPO / "jobs" / "examples" / "digits" / "data", root / "data")
    shutil.copytree(REPO / "policies", root / "policies")
    raw: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["policy"] = {"file": "policies/digits.policy.yaml", "trust": "policies/trust.yaml"}
    raw["storage_path"] = "storage"
    return raw


def golden_example(
    root: Path,
    workers: int,
    max_length: dict[str, int],
    hparams: dict[str, Any] | None = None,
    *,
    keep_checkpoints: int | None = 100,
    lr_schedule: bool = True,
    **overrides: Any,
) -> Path:
    """The digits example under ``root`` (its data, policies and storage): signed policy, checkpoints
    every 10 steps (``keep_checkpoints`` of them kept; None: the default GC), and unless
    ``lr_schedule`` is false a validation every 10 steps with a metric-driven LR schedule.
    ``overrides`` set (or, given None, remove) top-level keys of the experiment file."""
    raw = copy_example(root)
    raw["hyperparameters"] = hparams or GOLDEN_HPARAMS
    raw["resources"] = {"workers": workers, "cpus_per_worker": 1}
    raw["searcher"] = {"name": "single", "max_length": max_length}
    raw["checkpoint"] = {"period": GOLDEN_REPORT_EVERY}
    # A metric-driven LR schedule in play: demanding a 90% better validation loss each time, it
    # cuts the learning rate at steps 20 and 30 — decisions a replay must apply, not recompute.
    raw["min_validation_period"] = GOLDEN_REPORT_EVERY
    raw["lr_schedule"] = {"metric": "validation_loss", "factor": 0.5, "patience": 0, "threshold": 0.9}
    if not lr_schedule:
        del raw["lr_schedule"], raw["min_validation_period"]
    if keep_checkpoints is not None:
        raw["checkpoint"]["save_trial_latest"] = keep_checkpoints  # tests read every one
    for name, value in overrides.items():
        if value is None:
            raw.pop(name, None)
        else:
            raw[name] = value
    return save_experiment(root, raw)


def save_experiment(root: Path, raw: dict[str, Any]) -> Path:
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def opened(path: Path) -> tuple[Any, Any, Any, Any, Any]:
    """The experiment at ``path`` loaded, its store opened, its policy checked and its data
    ingested: ``(config, store, checked, experiment, ingested)``."""
    from govray.config.experiment import load_experiment
    from govray.platform.run.preflight import check_policy, ingest_experiment
    from govray.tracking.store import TrackingStore

    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    return config, store, checked, experiment, ingested
