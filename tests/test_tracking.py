"""Promises of the tracking layer: migrations equal the tables, the audit chain catches tampering
and loses nothing when writers race, and the store round-trips what it is given. Tests that take
``store`` or ``database_url`` run on SQLite, and in the cluster tier on PostgreSQL too."""

from __future__ import annotations

import itertools
import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlmodel import SQLModel

from govray.core.canonical import canonical_json, sha256_hex
from govray.core.errors import TrackingError
from govray.tracking import audit
from govray.tracking.audit import GENESIS_HASH, AuditEventType, AuditLog
from govray.tracking.store import TrackingStore, current_revision, upgrade
from govray.tracking.tables import AuditEvent, ExperimentState, TrialState

HEAD = "0001_release"  # the one migration of 1.0


def raw(store: TrackingStore, sql: str, **params: Any) -> None:
    """Tamper with the database the way an attacker with SQL access would."""
    with store.engine.begin() as connection:
        connection.execute(sa.text(sql), params)


def corpus(corpus_id: str, fingerprint: str, rows: int = 10) -> dict[str, Any]:
    return {
        "corpus_id": corpus_id,
        "role": "train",
        "fingerprint": fingerprint,
        "rows": rows,
        "train_rows": rows - 2,
        "holdout_rows": 2,
        "credential_json": json.dumps({"license": "cc-by-4.0"}),
        "route_counts_json": json.dumps({"full": rows - 2}),
    }


# -- migrations ------------------------------------------------------------------------------


def test_migrations_bring_an_empty_database_to_exactly_the_table_metadata(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the migrations are found from the package, not the cwd
    url = database_url

    assert upgrade(url) == HEAD

    engine = sa.create_engine(url)
    try:
        assert current_revision(engine) == HEAD
        with engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), SQLModel.metadata) == []
        tables = set(sa.inspect(engine).get_table_names())
        assert tables == set(SQLModel.metadata.tables) | {"alembic_version"}
    finally:
        engine.dispose()


def test_a_report_is_recorded_whole_or_not_at_all(store: TrackingStore) -> None:
    """A report's metric rows mark it recorded; they and the trial's progress share a transaction,
    so a report refused (here: a NaN) leaves neither, and recording it again records both."""
    experiment = store.create_experiment("atomic", "{}", "digest", "/runs/atomic")
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=0)
    assert trial.id is not None
    store.record_report(trial.id, 10, {"training": {"training_loss": 0.5}})
    with pytest.raises(TrackingError, match="NaN"):
        store.record_report(
            trial.id,
            20,
            {"training": {"training_loss": 0.4}, "validation": {"validation_loss": math.nan}},
            "pause",
        )
    assert store.reported_steps(trial.id) == {10}
    assert (store.get_trial(trial.id).last_step, store.get_trial(trial.id).stop_reason) == (10, None)
    store.record_report(trial.id, 20, {"training": {"training_loss": 0.4}}, "pause")
    assert store.reported_steps(trial.id) == {10, 20}
    assert (store.get_trial(trial.id).last_step, store.get_trial(trial.id).stop_reason) == (20, "pause")


def test_upgrading_twice_is_a_no_op(store: TrackingStore) -> None:
    store.create_experiment("kept", "{}", "digest", "/runs/kept")
    assert upgrade(store.engine) == HEAD
    assert [e.name for e in store.list_experiments()] == ["kept"]


@pytest.mark.parametrize("revision", ["0099_future", "0010_trial_world_history", "0001_initial"])
def test_a_database_from_a_newer_or_a_pre_release_govray_is_refused(
    store: TrackingStore, revision: str
) -> None:
    """A store at a revision this govray does not know (a newer one's, or a pre-release one's, whose
    migrations 1.0 squashed) is refused, naming the revision, and left as it was."""
    raw(store, f"UPDATE alembic_version SET version_num = '{revision}'")
    with pytest.raises(
        TrackingError,
        match=f"at revision '{revision}', which this govray does not know "
        r"\(newest known: '0001_release'\).*start a new store",
    ):
        upgrade(store.engine)
    assert current_revision(store.engine) == revision


def test_an_unreachable_url_names_the_url_without_its_password() -> None:
    url = "postgresql://govray:s3cret-pw@127.0.0.1:1/tracking"
    with pytest.raises(TrackingError) as caught:
        TrackingStore(url)
    message = str(caught.value)
    assert "govray:***@127.0.0.1:1/tracking" in message
    assert "s3cret-pw" not in message


def test_a_sqlite_path_under_a_regular_file_cannot_be_opened(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(TrackingError, match=r"cannot open tracking store sqlite:///.*not-a-dir"):
        TrackingStore(f"sqlite:///{blocker / 'tracking.db'}")


# -- audit chain -----------------------------------------------------------------------------


def append_events(log: AuditLog, count: int) -> None:
    for index in range(count):
        log.append(AuditEventType.POLICY_VERIFIED, {"index": index, "policy": "default"})


def test_the_chain_verifies_and_each_hash_is_the_documented_formula(store: TrackingStore) -> None:
    log = AuditLog(store)
    append_events(log, 12)

    assert log.verify() == 12
    events = log.list()
    assert [e.seq for e in events] == list(range(1, 13))
    assert events[0].prev_hash == GENESIS_HASH
    for before, after in itertools.pairwise(events):
        assert after.prev_hash == before.hash
    for event in events:
        content = {
            "seq": event.seq,
            "at": event.at,
            "event_type": event.event_type,
            "experiment_id": event.experiment_id,
            "actor": event.actor,
            "payload": json.loads(event.payload_json),
            "prev_hash": event.prev_hash,
        }
        assert event.hash == sha256_hex(canonical_json(content))
    assert json.loads(events[4].payload_json) == {"index": 4, "policy": "default"}


def test_an_edited_payload_is_named_by_its_seq(store: TrackingStore) -> None:
    log = AuditLog(store)
    append_events(log, 10)
    raw(store, "UPDATE audit_events SET payload_json = :p WHERE seq = 7", p='{"index":666}')

    with pytest.raises(TrackingError, match=r"broken at seq 7: content was edited"):
        log.verify()


def test_a_deleted_middle_event_is_named_as_missing(store: TrackingStore) -> None:
    log = AuditLog(store)
    append_events(log, 10)
    raw(store, "DELETE FROM audit_events WHERE seq = 5")

    with pytest.raises(TrackingError, match=r"broken at seq 5: expected seq 5 .* seq 6 \(missing\)"):
        log.verify()


def test_relinking_a_forged_hash_is_caught_because_content_no_longer_hashes(
    store: TrackingStore,
) -> None:
    log = AuditLog(store)
    append_events(log, 10)
    forged = "f" * 64
    raw(store, "UPDATE audit_events SET hash = :h WHERE seq = 4", h=forged)
    raw(store, "UPDATE audit_events SET prev_hash = :h WHERE seq = 5", h=forged)

    with pytest.raises(TrackingError, match=r"broken at seq 4: content was edited"):
        log.verify()


def test_a_broken_link_alone_is_named(store: TrackingStore) -> None:
    log = AuditLog(store)
    append_events(log, 6)
    # Re-hash seq 3 over a wrong prev_hash so its content is self-consistent but unlinked.
    with store.session() as session:
        event = session.get(AuditEvent, 3)
        assert event is not None
        event.prev_hash = "a" * 64
        event.hash = audit.event_hash(event)
        session.add(event)

    with pytest.raises(TrackingError, match=r"broken at seq 3: broken link"):
        log.verify()


def test_append_retries_when_another_writer_takes_its_seq(
    store: TrackingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PostgreSQL's appenders queue on a lock first (tests/cluster/test_postgres.py); without it they
    # race as SQLite's do, and the retry is what keeps the chain whole.
    monkeypatch.setattr(audit, "_queue_behind_other_appenders", lambda session: None)
    log, rival = AuditLog(store), AuditLog(store)
    log.append(AuditEventType.POLICY_VERIFIED, {"first": True})
    real_next_event = audit._next_event
    calls = 0

    def racing_next_event(*args: Any) -> AuditEvent:
        nonlocal calls
        calls += 1
        planned = real_next_event(*args)
        if calls == 1:  # a rival commits seq 2 between our read and our insert
            monkeypatch.setattr(audit, "_next_event", real_next_event)
            rival.append(AuditEventType.RUN_REFUSED, {"rival": True})
            monkeypatch.setattr(audit, "_next_event", racing_next_event)
        return planned

    monkeypatch.setattr(audit, "_next_event", racing_next_event)
    mine = log.append(AuditEventType.INGEST_COMPLETED, {"mine": True})

    assert calls == 2
    assert mine.seq == 3
    assert [e.event_type for e in log.list()] == ["policy.verified", "run.refused", "ingest.completed"]
    assert log.verify() == 3


def test_append_accepts_only_the_closed_set_of_event_types(store: TrackingStore) -> None:
    log = AuditLog(store)
    with pytest.raises(TrackingError, match=r"unknown audit event type 'policy\.ignored'"):
        log.append("policy.ignored", {})
    assert log.append("run.refused", {}).event_type == AuditEventType.RUN_REFUSED
    assert log.verify() == 1


def test_list_filters_by_experiment_type_and_time(store: TrackingStore) -> None:
    log = AuditLog(store)
    before = datetime.now(UTC) - timedelta(seconds=1)
    log.append(AuditEventType.EXPERIMENT_CREATED, {}, experiment_id=1, actor="alice")
    log.append(AuditEventType.INGEST_COMPLETED, {}, experiment_id=1)
    log.append(AuditEventType.EXPERIMENT_CREATED, {}, experiment_id=2)
    after = datetime.now(UTC) + timedelta(seconds=1)

    assert [e.seq for e in log.list(experiment_id=1)] == [1, 2]
    assert [e.seq for e in log.list(event_type=AuditEventType.EXPERIMENT_CREATED)] == [1, 3]
    assert [e.seq for e in log.list(experiment_id=2, event_type="experiment.created")] == [3]
    assert len(log.list(since=before, until=after)) == 3
    assert log.list(since=after) == []
    assert log.list(until=before) == []
    assert log.list()[0].actor == "alice"


# -- experiments, corpora, trials, metrics ---------------------------------------------------


def test_experiments_are_created_listed_and_found_by_name(store: TrackingStore) -> None:
    first = store.create_experiment("alpha", '{"lr": 0.1}', "d1", "/runs/a1")
    store.create_experiment("beta", "{}", "d2", "/runs/b", policy_digest="p2")
    newest = store.create_experiment("alpha", '{"lr": 0.2}', "d3", "/runs/a2", description="v2")
    assert first.id is not None

    assert [(e.id, e.name) for e in store.list_experiments()] == [
        (first.id, "alpha"),
        (first.id + 1, "beta"),
        (newest.id, "alpha"),
    ]
    found = store.get_experiment("alpha")
    assert (found.id, found.config_digest, found.description) == (newest.id, "d3", "v2")
    assert store.get_experiment(first.id).config_json == '{"lr": 0.1}'
    assert store.get_experiment("beta").policy_digest == "p2"
    assert found.state == ExperimentState.CREATED
    assert found.created_at.tzinfo == UTC


def test_an_unknown_experiment_is_named_in_the_error(store: TrackingStore) -> None:
    with pytest.raises(TrackingError, match="no experiment 'no-such-run'"):
        store.get_experiment("no-such-run")


def test_experiment_state_changes_are_validated(store: TrackingStore) -> None:
    experiment = store.create_experiment("gamma", "{}", "d", "/runs/g")
    assert experiment.id is not None
    store.set_experiment_state(experiment.id, ExperimentState.ACTIVE)
    assert store.get_experiment("gamma").state == "active"
    with pytest.raises(TrackingError, match="unknown ExperimentState 'sleeping'"):
        store.set_experiment_state(experiment.id, "sleeping")
    assert store.get_experiment("gamma").state == "active"


def test_decisions_are_stored_once_and_a_different_rewrite_is_refused(store: TrackingStore) -> None:
    experiment = store.create_experiment("delta", "{}", "d", "/runs/d")
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=0)
    assert trial.id is not None
    first = {"seq": 0, "step": 20, "kind": "lr_scale", "scale": 0.5, "metric": "validation_loss"}
    assert store.record_decisions(trial.id, [first], replayed=False) == 1
    # A restarted worker group reports the same record again, plus one more decision.
    second = {"seq": 1, "step": 40, "kind": "lr_scale", "scale": 0.25, "metric": "validation_loss"}
    assert store.record_decisions(trial.id, [first, second], replayed=False) == 1
    assert [(d.seq, d.step, json.loads(d.payload_json)["scale"]) for d in store.decisions(trial.id)] == [
        (0, 20, 0.5),
        (1, 40, 0.25),
    ]
    with pytest.raises(TrackingError, match="decision 1 differs"):
        store.record_decisions(trial.id, [{**second, "step": 41}], replayed=False)
    with pytest.raises(TrackingError, match="unknown DecisionKind"):
        store.record_decisions(trial.id, [{"seq": 2, "step": 50, "kind": "vibes"}], replayed=False)
    assert len(store.decisions(trial.id)) == 2


def test_a_pbt_clones_decisions_supersede_those_of_the_state_it_replaced(store: TrackingStore) -> None:
    """A clone took its own LR cut at step 5 (seq 0), then continued a donor's state, which carries
    the donor's cut at step 5 (also seq 0) and its gate: the clone's rows become the donor state's
    (its own cut, of a state that is gone, too), where a plain re-report would be refused."""
    experiment = store.create_experiment("epsilon", "{}", "d", "/runs/e")
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=0)
    assert trial.id is not None
    own = {
        "seq": 0,
        "step": 5,
        "kind": "lr_scale",
        "scale": 0.5,
        "metric": "validation_loss",
        "observed": 0.9,
    }
    mine_later = {**own, "seq": 1, "step": 8, "observed": 0.8}
    store.record_decisions(trial.id, [own, mine_later], replayed=False)
    donors = {**own, "observed": 0.7}
    gate = {"seq": 1, "step": 5, "kind": "gate", "corpus_id": "c", "reason": "canary_exposure"}
    with pytest.raises(TrackingError, match="decision 0 differs"):
        store.record_decisions(trial.id, [donors, gate], replayed=False)
    assert store.record_decisions(trial.id, [donors, gate], replayed=False, superseding=True) == 2
    rows = [
        (d.seq, d.step, d.kind, json.loads(d.payload_json).get("observed")) for d in store.decisions(trial.id)
    ]
    assert rows == [(0, 5, "lr_scale", 0.7), (1, 5, "gate", None)]
    assert store.record_decisions(trial.id, [donors, gate], replayed=False, superseding=True) == 0  # again


def test_pause_and_kill_requests_are_validated(store: TrackingStore) -> None:
    experiment = store.create_experiment("epsilon", "{}", "d", "/runs/e")
    assert experiment.id is not None
    assert store.request(experiment.id, "pause").requested == "pause"
    with pytest.raises(TrackingError, match="unknown ControlRequest 'nap'"):
        store.request(experiment.id, "nap")
    assert store.get_experiment(experiment.id).requested == "pause"
    assert store.request(experiment.id, None).requested is None


def test_record_corpora_replaces_the_previous_ingest(store: TrackingStore) -> None:
    mine = store.create_experiment("mine", "{}", "d", "/runs/m")
    other = store.create_experiment("other", "{}", "d", "/runs/o")
    assert mine.id is not None and other.id is not None
    store.record_corpora(mine.id, [corpus("news", "aa" * 32), corpus("code", "bb" * 32)])
    store.record_corpora(other.id, [corpus("news", "cc" * 32)])

    store.record_corpora(mine.id, [corpus("news", "dd" * 32, rows=40)])

    (news,) = store.list_corpora(mine.id)
    assert (news.corpus_id, news.fingerprint, news.rows, news.train_rows) == ("news", "dd" * 32, 40, 38)
    assert [(c.corpus_id, c.fingerprint) for c in store.list_corpora(other.id)] == [("news", "cc" * 32)]


def test_record_corpora_refuses_unknown_fields_and_keeps_the_old_rows(
    store: TrackingStore,
) -> None:
    experiment = store.create_experiment("strict", "{}", "d", "/runs/s")
    assert experiment.id is not None
    store.record_corpora(experiment.id, [corpus("news", "aa" * 32)])
    with pytest.raises(TrackingError, match="unexpected fields: colour"):
        store.record_corpora(experiment.id, [{**corpus("news", "bb" * 32), "colour": "red"}])
    assert [c.fingerprint for c in store.list_corpora(experiment.id)] == ["aa" * 32]


def test_metrics_round_trip_exactly(store: TrackingStore) -> None:
    experiment = store.create_experiment("metrics", "{}", "d", "/runs/m")
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, '{"lr": 0.1}', seed=7)
    assert trial.id is not None
    store.log_metrics(trial.id, 2, "training", {"loss": 1 / 3, "lr": 1e-300})
    store.log_metrics(trial.id, 1, "training", {"loss": 0.1, "lr": 2.5e-4})
    store.log_metrics(trial.id, 2, "validation", {"val_loss": 0.7})

    loss = store.metrics(trial.id, "loss")
    assert [(m.step, m.kind, m.value) for m in loss] == [(1, "training", 0.1), (2, "training", 1 / 3)]
    everything = [(m.name, m.step, m.value) for m in store.metrics(trial.id)]
    assert everything == [
        ("loss", 1, 0.1),
        ("loss", 2, 1 / 3),
        ("lr", 1, 2.5e-4),
        ("lr", 2, 1e-300),
        ("val_loss", 2, 0.7),
    ]
    with pytest.raises(TrackingError, match="unknown MetricKind 'test'"):
        store.log_metrics(trial.id, 3, "test", {"loss": 0.0})


def test_a_nan_metric_is_refused_and_nothing_of_that_report_is_stored(store: TrackingStore) -> None:
    experiment = store.create_experiment("diverged", "{}", "d", "/runs/d")
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=3)
    assert trial.id is not None
    with pytest.raises(TrackingError, match=f"trial {trial.id} reported NaN at step 5 for: loss"):
        store.log_metrics(trial.id, 5, "training", {"lr": 0.01, "loss": float("nan")})
    store.log_metrics(trial.id, 6, "training", {"loss": float("inf")})
    assert [(m.step, m.value) for m in store.metrics(trial.id)] == [(6, float("inf"))]


def test_record_corpora_refuses_a_corpus_given_twice(store: TrackingStore) -> None:
    experiment = store.create_experiment("twice", "{}", "d", "/runs/t")
    assert experiment.id is not None
    with pytest.raises(TrackingError, match="corpus ids given more than once: news"):
        store.record_corpora(experiment.id, [corpus("news", "aa" * 32), corpus("news", "bb" * 32)])
    assert store.list_corpora(experiment.id) == []


def test_trials_record_their_lifecycle(store: TrackingStore) -> None:
    experiment = store.create_experiment("trials", "{}", "d", "/runs/t")
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=1)
    assert trial.id is not None
    clone = store.create_trial(experiment.id, "{}", seed=1, cloned_from=trial.id)

    running = store.set_trial_state(trial.id, TrialState.ACTIVE, ray_run_name="run-1")
    assert (running.state, running.ray_run_name, running.ended_at) == ("active", "run-1", None)
    done = store.set_trial_state(trial.id, "completed")
    assert done.ended_at is not None and done.ended_at.tzinfo == UTC
    assert [(t.id, t.state, t.cloned_from) for t in store.list_trials(experiment.id)] == [
        (trial.id, "completed", None),
        (clone.id, "pending", trial.id),
    ]
    with pytest.raises(TrackingError, match="no trial with id 999"):
        store.get_trial(999)
