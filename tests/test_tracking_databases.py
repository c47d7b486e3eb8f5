"""What must hold on every database the tracking store runs on (SQLite here, PostgreSQL as well in
the cluster tier): migrations go down and up again, timestamps come back as the same instant in UTC,
JSON documents and counts past 32 bits come back unchanged, and 8 writer processes at once lose
no row and leave the audit chain valid, and processes opening an empty store at once all succeed."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlmodel import SQLModel

from govray.tracking.audit import AuditLog
from govray.tracking.database import alembic_config, current_revision, tracking_url, upgrade
from govray.tracking.lineage import checkpoint_ledger_rows, checkpoints, ledger_rows, record_ledger
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, TrialRecord
from tests.helpers.concurrent_writers import BIG_COUNT, ledger_of, metric_values, run_openers, run_writers

WRITERS, STEPS = 8, 25


def test_migrations_go_down_to_an_empty_database_and_up_again(store: TrackingStore) -> None:
    store.create_experiment("before", "{}", "d", "/runs/b")
    with store.engine.begin() as connection:
        command.downgrade(alembic_config(connection), "base")
    assert set(sa.inspect(store.engine).get_table_names()) <= {"alembic_version"}
    assert current_revision(store.engine) is None

    head = upgrade(store.engine)

    assert current_revision(store.engine) == head
    with store.engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), SQLModel.metadata) == []
    assert store.list_experiments() == []
    store.create_experiment("after", "{}", "d", "/runs/a")
    assert [e.name for e in store.list_experiments()] == ["after"]


def test_timestamps_come_back_as_the_same_instant_in_utc(store: TrackingStore) -> None:
    # India's +05:30, and a moment in the hour New York's clocks skip in spring.
    created = datetime(2026, 3, 8, 7, 30, 15, 123456, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    ended = datetime(2026, 3, 8, 7, 30, 59, 999999, tzinfo=UTC)
    with store.session() as session:
        experiment = Experiment(
            name="clock", config_json="{}", config_digest="d", storage_path="/s", created_at=created
        )
        session.add(experiment)
        session.flush()
        assert experiment.id is not None
        session.add(TrialRecord(experiment_id=experiment.id, hparams_json="{}", seed=0, ended_at=ended))

    reopened = TrackingStore(store.url)  # nothing cached: read back through a new engine
    try:
        found = reopened.get_experiment("clock")
        (trial,) = reopened.list_trials(found.id or 0)
    finally:
        reopened.close()
    assert found.created_at == created and found.created_at.tzinfo == UTC
    assert found.created_at.isoformat() == "2026-03-08T02:00:15.123456+00:00"
    assert trial.ended_at == ended and trial.ended_at is not None and trial.ended_at.tzinfo == UTC
    naive = Experiment(name="naive", config_json="{}", config_digest="d", storage_path="/s")
    naive.created_at = datetime(2026, 1, 1)
    with pytest.raises(sa.exc.StatementError, match="naive datetime"), store.session() as session:
        session.add(naive)


def test_json_documents_come_back_byte_for_byte(store: TrackingStore) -> None:
    documents = {
        "unicode": json.dumps({"name": "Zürich — 東京 🦜", "escaped": '\u0000\n\t"\\'}, ensure_ascii=False),
        "ascii escapes": json.dumps({"name": "Zürich", "nul": "\u0000"}),
        "spacing kept": '  {"b": 1,   "a": [1.0, 1e-300, -0.0]}\n',
        "large": json.dumps({f"key{i}": list(range(i % 50)) for i in range(20_000)}),
    }
    ids = {
        label: store.create_experiment(label, document, "d", "/s").id for label, document in documents.items()
    }
    reopened = TrackingStore(store.url)
    try:
        for label, document in documents.items():
            assert reopened.get_experiment(ids[label] or 0).config_json == document, label
    finally:
        reopened.close()
    assert len(documents["large"]) > 1_000_000


def test_counts_past_32_bits_come_back_exactly(store: TrackingStore) -> None:
    experiment = store.create_experiment("web-scale", "{}", "d", "/s")
    assert experiment.id is not None
    rows = 5 * 2**31
    corpus = {
        "corpus_id": "crawl",
        "role": "train",
        "fingerprint": "ab" * 32,
        "rows": rows,
        "train_rows": rows - 7,
        "holdout_rows": 7,
        "credential_json": "{}",
        "route_counts_json": "{}",
    }
    store.record_corpora(experiment.id, [corpus])
    trial = store.create_trial(experiment.id, "{}", seed=0)
    assert trial.id is not None
    record_ledger(store, trial.id, [("crawl", "fc1.weight", 0, rows - 7, 2**40 + 1, 1)])

    (stored,) = store.list_corpora(experiment.id)
    assert (stored.rows, stored.train_rows) == (rows, rows - 7)
    (row,) = ledger_rows(store, trial.id)
    assert (row.examples, row.tokens) == (rows - 7, 2**40 + 1)


def test_processes_opening_an_empty_store_at_once_migrate_it_one_after_the_other(database_url: str) -> None:
    """Without the migration lock most of them failed ("table experiments already exists")."""
    assert run_openers(database_url, WRITERS) == [0] * WRITERS
    engine = sa.create_engine(tracking_url(database_url))
    try:
        assert current_revision(engine) == upgrade(database_url)  # head, and upgrading is a no-op
    finally:
        engine.dispose()


def test_eight_concurrent_writer_processes_lose_no_row(database_url: str) -> None:
    store = TrackingStore.open(database_url)
    try:
        experiment = store.create_experiment("concurrent", "{}", "d", "/runs/c")
        assert experiment.id is not None
        trial_ids = [store.create_trial(experiment.id, "{}", seed=w).id or 0 for w in range(WRITERS)]

        assert run_writers(database_url, experiment.id, trial_ids, STEPS) == [0] * WRITERS

        for writer, trial_id in enumerate(trial_ids):
            logged = sorted((m.step, m.name, m.value) for m in store.metrics(trial_id))
            expected = [(s, name, v) for s in range(STEPS) for name, v in metric_values(writer, s).items()]
            assert logged == sorted(expected), f"writer {writer}'s metrics"
            saved = checkpoints(store, trial_id)
            assert [c.step for c in saved] == list(range(STEPS))
            recorded = sorted(
                (r.checkpoint_id or 0, r.corpus_id, r.parameter, r.layer_index, r.examples, r.tokens, r.steps)
                for c in saved
                for r in checkpoint_ledger_rows(store, c.id or 0)
            )
            assert recorded == sorted((c.id or 0, *row) for c in saved for row in ledger_of(writer, c.step))
            assert recorded[0][5] >= BIG_COUNT
        log = AuditLog(store)
        events = log.list(experiment_id=experiment.id)
        assert [e.seq for e in events] == list(range(1, WRITERS * STEPS + 1))
        appended = {(p["writer"], p["step"]) for p in (json.loads(e.payload_json) for e in events)}
        assert appended == {(w, s) for w in range(WRITERS) for s in range(STEPS)}
        assert log.verify() == WRITERS * STEPS
    finally:
        store.close()
