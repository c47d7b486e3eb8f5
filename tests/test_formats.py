"""One format at release: run.json, a trial's reproducibility record and a checkpoint's
``state.json`` and ``manifest.json`` name their format, and a reader refuses another (a newer
govray's, or a file that is not govray's) naming what it found and what it reads; none of the
pre-release defaults ("a file written before X") is left to guess a missing field with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from govray.core.formats import REPRODUCIBILITY_FORMAT, RUN_SPEC_FORMAT, known_format
from govray.train.checkpoints.files import CheckpointError
from govray.train.checkpoints.manifest import CHECKPOINT_FORMAT, Manifest
from govray.train.reproduce.record import ReproducibilityRecord
from govray.train.runspec import read_run_spec
from tests.helpers.golden import GoldenRun, final_checkpoint


def test_known_format_names_both() -> None:
    assert known_format("govray-run-v1", "govray-run-v1", "run.json") == "govray-run-v1"
    with pytest.raises(
        ValueError, match="run.json is in format 'govray-run-v9'; this govray reads 'govray-run-v1'"
    ):
        known_format("govray-run-v9", "govray-run-v1", "run.json")


def test_every_file_a_run_writes_names_its_format(golden_run: GoldenRun) -> None:
    checkpoint = final_checkpoint(golden_run.outcome.run_dir)
    assert json.loads((checkpoint / "run.json").read_text())["format"] == RUN_SPEC_FORMAT
    assert json.loads((checkpoint / "state.json").read_text())["format"] == CHECKPOINT_FORMAT
    assert json.loads((checkpoint / "manifest.json").read_text())["format"] == CHECKPOINT_FORMAT
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["reproducibility"]["format"] == REPRODUCIBILITY_FORMAT


def test_a_run_json_of_another_format_or_missing_a_field_is_refused(
    golden_run: GoldenRun, tmp_path: Path
) -> None:
    written = json.loads((final_checkpoint(golden_run.outcome.run_dir) / "run.json").read_text())
    assert read_run_spec(_written(tmp_path / "same.json", written)).format == RUN_SPEC_FORMAT
    newer = _written(tmp_path / "newer.json", {**written, "format": "govray-run-v2"})
    with pytest.raises(CheckpointError, match="'govray-run-v2'; this govray reads 'govray-run-v1'"):
        read_run_spec(newer)
    for field in ("settings", "routing", "shards_sha256", "eval_rows", "storage"):  # once "written before"
        older = _written(tmp_path / f"without-{field}.json", {k: v for k, v in written.items() if k != field})
        with pytest.raises(CheckpointError, match=f"{older}: not a run spec this govray reads: .*{field}"):
            read_run_spec(older)


def test_a_reproducibility_record_of_another_format_or_without_its_engine_settings_is_refused(
    golden_run: GoldenRun,
) -> None:
    state = json.loads((final_checkpoint(golden_run.outcome.run_dir) / "state.json").read_text())
    record = state["reproducibility"]
    assert ReproducibilityRecord.model_validate(record).format == REPRODUCIBILITY_FORMAT
    with pytest.raises(ValidationError, match="'govray-reproducibility-v2'"):
        ReproducibilityRecord.model_validate({**record, "format": "govray-reproducibility-v2"})
    for field in ("device", "precision", "deterministic"):
        with pytest.raises(ValidationError, match=field):
            ReproducibilityRecord.model_validate({k: v for k, v in record.items() if k != field})


def test_a_manifest_needs_its_signing_time_and_its_format() -> None:
    with pytest.raises(ValidationError, match="signed_at"):
        Manifest.model_validate({"step": 1, "files": {}})
    with pytest.raises(ValidationError, match="'govray-checkpoint-v0'"):
        Manifest.model_validate(
            {"format": "govray-checkpoint-v0", "step": 1, "files": {}, "signed_at": "2026-01-01T00:00:00Z"}
        )


def _written(path: Path, document: dict[str, object]) -> Path:
    path.write_text(json.dumps(document))
    return path
