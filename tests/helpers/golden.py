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


@dataclass(frozen=True)
class RegisteredPair:
    """A registered version of the one-epoch golden run and the version made from it by removing
    its PII adapter: what the tools users already run (model_signing, CycloneDX, MLflow) read."""

    store: Any
    version: Any  # RegisteredVersion
    without_adapter: Any  # RegisteredVersion, without adapter REMOVED_ADAPTER


REMOVED_ADAPTER = "pii-lora"
