"""A refused run leaves its audit events and nothing else: no experiment left in ``created``
(or any) state, nothing ``govray experiment list`` would show, and README's exit code."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from govray.cli import main
from govray.config.experiment import load_experiment
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore

pytestmark = pytest.mark.usefixtures("ray_session")


def corrupt_writer_country(config_path: Path, row: int, value: str) -> Path:
    """Set ``writer_country`` of 0-based row ``row`` of the example's per-row-credential CSV."""
    path = config_path.parent / "data" / "pii.csv"
    with open(path, newline="") as handle:
        records = list(csv.reader(handle))
    column = records[0].index("writer_country")
    records[1 + row][column] = value
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(records)
    return path


def assert_nothing_but_audit_events(config_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = TrackingStore.open(load_experiment(config_path).database_url)
    assert store.list_experiments() == [], "a refused run creates no experiment"
    assert main(["experiment", "list", "--config", str(config_path)]) == 0
    listing = capsys.readouterr().out
    rows = [line for line in listing.splitlines() if line.startswith("│")]
    assert rows == [], f"the listing shows experiments:\n{listing}"
    assert AuditLog(store).verify() >= 2  # the policy verified, then the refusal


def test_bad_row_credential_refuses_the_run_with_exit_3(
    example_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = corrupt_writer_country(example_copy, 5, "Germany")
    assert main(["run", str(example_copy)]) == 3  # README: 3 bad credential
    err = capsys.readouterr().err
    assert "CredentialError: corpus 'digits-writers' row 5: invalid credential: jurisdiction" in err
    assert f"(at {data} row 5 (line 7))" in err  # rows count from 0, lines from 1
    assert main(["data", "ingest", str(example_copy)]) == 3  # the same refusal, the same code
    capsys.readouterr()
    assert_nothing_but_audit_events(example_copy, capsys)
    store = TrackingStore.open(load_experiment(example_copy).database_url)
    refused = AuditLog(store).list(event_type=AuditEventType.INGEST_REFUSED)
    assert len(refused) == 2 and all("digits-governed" in event.payload_json for event in refused)


def test_run_refused_after_ingest_leaves_no_experiment(
    example_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-checkpoint"
    code = main(["run", str(example_copy), "--from-checkpoint", str(missing)])
    err = capsys.readouterr().err
    assert code == 10, err  # README: 10 checkpoint refused
    assert str(missing) in err
    assert_nothing_but_audit_events(example_copy, capsys)
    store = TrackingStore.open(load_experiment(example_copy).database_url)
    assert [e.event_type for e in AuditLog(store).list()][-1] == AuditEventType.RUN_REFUSED
