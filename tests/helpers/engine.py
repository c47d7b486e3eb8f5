"""The run spec a golden run recorded, as the engine tests read it back."""

from __future__ import annotations

from govray.train.checkpoints.files import find_checkpoints
from govray.train.runspec import RunSpec
from tests.helpers.golden import GoldenRun


def run_spec(run: GoldenRun) -> RunSpec:
    return RunSpec.model_validate_json((find_checkpoints(run.outcome.run_dir)[-1] / "run.json").read_text())
