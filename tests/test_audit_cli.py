"""`govray audit verify|list` on a real store (SQLite, and PostgreSQL too in the cluster tier): the
chain verifies, an edited event is named, and listing filters by experiment, type and time."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from govray.cli import main
from govray.core.errors import TrackingError
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore


@pytest.fixture
def database(database_url: str) -> str:
    url = database_url
    store = TrackingStore.open(url)
    alpha = store.create_experiment("alpha", "{}", "d1", "/runs/a")
    beta = store.create_experiment("beta", "{}", "d2", "/runs/b")
    log = AuditLog(store)
    log.append(AuditEventType.POLICY_VERIFIED, {"policy": "digits"}, experiment_id=alpha.id)
    log.append(AuditEventType.MEMORIZATION_GATE, {"corpus_id": "news", "step": 300}, experiment_id=alpha.id)
    log.append(AuditEventType.MEMORIZATION_ROLLBACK, {"to_step": 200, "step": 400}, experiment_id=beta.id)
    return url


def listed(capsys: pytest.CaptureFixture[str], *options: str) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(["audit", "list", *options, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # one document per line


def test_verify_counts_an_intact_chain_and_names_the_edited_event(
    database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", "verify", "--database", database]) == 0
    assert "3 events, hash chain verified" in capsys.readouterr().out
    store = TrackingStore.open(database)
    with store.session() as session:
        session.execute(
            text('UPDATE audit_events SET payload_json = \'{"corpus_id": "other"}\' WHERE seq = 2')
        )
    assert main(["audit", "verify", "--database", database]) == TrackingError.exit_code
    assert "audit chain broken at seq 2: content was edited" in capsys.readouterr().err


def test_list_filters_by_experiment_type_and_time(database: str, capsys: pytest.CaptureFixture[str]) -> None:
    every = listed(capsys, "--database", database)
    assert [event["seq"] for event in every] == [1, 2, 3]
    assert every[1]["payload"] == {"corpus_id": "news", "step": 300}
    alpha = listed(capsys, "--database", database, "--experiment", "alpha")
    assert [event["seq"] for event in alpha] == [1, 2]
    gates = listed(capsys, "--database", database, "--type", "memorization.gate")
    assert [event["event_type"] for event in gates] == ["memorization.gate"]
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert listed(capsys, "--database", database, "--since", later) == []
    assert len(listed(capsys, "--database", database, "--until", later)) == 3


def test_bad_filters_are_refused_with_a_message(database: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "list", "--database", database, "--since", "yesterday"]) == TrackingError.exit_code
    assert "--since 'yesterday' is not an ISO time" in capsys.readouterr().err
    assert main(["audit", "list", "--database", database, "--type", "vibes"]) != 0
    assert "vibes" in capsys.readouterr().err
