"""The golden runs many tests read: a few real Ray Train runs of the digits example, built by
``jobs/examples/digits/golden.py`` (which the golden digest uses too); the fixtures that make them
are in ``tests/conftest.py``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.examples.digits.golden import GOLDEN_REPORT_EVERY, GOLDEN_STEPS, opened


@dataclass
class GoldenRun:
    config: Any
    checked: Any
    shard_root: Path
    store: Any
    outcome: Any


def golden_run_at(path: Path) -> GoldenRun:
    from govray.platform.run.runner import run_trial

    config, store, checked, experiment, ingested = opened(path)
    outcome = run_trial(config, checked, experiment, ingested.root, store, report_every=GOLDEN_REPORT_EVERY)
    return GoldenRun(config, checked, ingested.root, store, outcome)


def final_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint of a golden run's Ray Train directory: that of its last step."""
    from govray.train.checkpoints.files import checkpoint_step, find_checkpoints

    found = find_checkpoints(run_dir)
    assert found and checkpoint_step(found[-1]) == GOLDEN_STEPS
    return found[-1]


def assert_run_as_planned(storage_path: str, run_name: str, run_dir: Path) -> None:
    """Nothing edited the run's spec after planning: every checkpoint of the run keeps, as its
    ``run.json``, the spec the run recorded when it started (``runs/RUN.json``), whatever its
    attempts asked besides (a report sink, a pause, the recorded code of a resume)."""
    from govray.core.storage import open_storage
    from govray.platform.run.plan import run_spec_path
    from govray.train.checkpoints.files import find_checkpoints
    from govray.train.runspec import RUN_SPEC_FILE, read_run_spec

    planned = read_run_spec(run_spec_path(open_storage(storage_path), run_name))
    checkpoints = find_checkpoints(run_dir)
    assert checkpoints, run_dir
    for checkpoint in checkpoints:
        assert read_run_spec(checkpoint / RUN_SPEC_FILE) == planned, checkpoint.name


@dataclass(frozen=True)
class RegisteredPair:
    """A registered version of the one-epoch golden run and the version made from it by removing
    its PII adapter: what the tools users already run (model_signing, CycloneDX, MLflow) read."""

    store: Any
    version: Any  # RegisteredVersion
    without_adapter: Any  # RegisteredVersion, without adapter REMOVED_ADAPTER


REMOVED_ADAPTER = "pii-lora"
