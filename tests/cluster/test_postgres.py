"""The tracking store on a real PostgreSQL server: Debian's postgresql, installed by the test scripts
when missing and started as the postgres user in a throwaway directory (tests/helpers/postgres.py).

The store-level suites run on it too, through the ``postgresql`` variant of their ``database_url``
fixture (tests/conftest.py): test_tracking.py, test_tracking_databases.py (8 concurrent writer
processes among them), test_gc.py, test_audit_cli.py and test_tracking_cli.py. This module holds
what only PostgreSQL raises: the server itself, the audit appenders' lock, the lineage queries'
indexes and answers, the URL forms, and the controller's write path.
"""

from __future__ import annotations

import os
import pwd
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from govray.config.experiment import parse_experiment
from govray.core.errors import ConfigError
from govray.queries import StoreReader, Window, read_only_engine
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.database import create_tracking_engine, current_revision, upgrade
from govray.tracking.lineage import (
    checkpoints,
    ledger_rows,
    record_attestation,
    record_checkpoint,
    record_ledger,
)
from govray.tracking.store import TrackingStore
from govray.tracking.tables import ModelVersion, RegisteredModel
from jobs.examples.digits.golden import EXAMPLE_CONFIG
from tests.helpers.postgres import PostgresServer

pytestmark = pytest.mark.cluster


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    with postgres.database() as url:
        yield url


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[TrackingStore]:
    store = TrackingStore.open(pg_url)
    yield store
    store.close()


def test_the_server_is_postgresql_run_by_the_postgres_user(pg_store: TrackingStore) -> None:
    with pg_store.engine.connect() as connection:
        version = int(connection.exec_driver_sql("SHOW server_version_num").scalar_one())
        backend = int(connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
    assert version >= 150000
    owner = Path(f"/proc/{backend}").stat().st_uid
    assert pwd.getpwuid(owner).pw_name == (
        "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    )


def test_appenders_wait_in_turn_on_a_lock_while_readers_read_on(pg_store: TrackingStore) -> None:
    log = AuditLog(pg_store)
    log.append(AuditEventType.POLICY_VERIFIED, {"first": True})
    appended: list[Any] = []
    with pg_store.engine.connect() as other_appender:
        other_appender.exec_driver_sql("LOCK TABLE audit_events IN SHARE ROW EXCLUSIVE MODE")
        waiting = threading.Thread(
            target=lambda: appended.append(log.append(AuditEventType.RUN_REFUSED, {"second": True}))
        )
        waiting.start()
        _until_a_lock_is_awaited(pg_store, "audit_events")
        assert log.verify() == 1  # readers are not held up
        assert appended == []
        other_appender.commit()
    waiting.join(timeout=30)
    assert [event.seq for event in appended] == [2]
    assert log.verify() == 2


def _until_a_lock_is_awaited(store: TrackingStore, table: str) -> None:
    query = sa.text("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = CAST(:t AS regclass)")
    deadline = time.monotonic() + 30
    with store.engine.connect() as connection:
        while connection.execute(query, {"t": table}).scalar_one() == 0:
            assert time.monotonic() < deadline, f"no one waited for the lock on {table}"
            time.sleep(0.02)
            connection.rollback()


# -- lineage queries ----------------------------------------------------------------------------


def lineage_fixture(store: TrackingStore) -> None:
    """Two trials: the first with a trial ledger (its last checkpoint's), an earlier checkpoint's
    own ledger and an adapter; two registered versions of its last checkpoint, one without the
    adapter."""
    experiment = store.create_experiment("lineage", "{}", "d", "/runs/lineage")
    assert experiment.id is not None
    tensors = [("fc1.weight", 0), ("fc1.bias", 0), ("fc2.weight", 1), ("head.scale", None)]
    adapter = [("adapter/pii/fc1.lora_A", 0), ("adapter/pii/fc1.lora_B", 0)]
    last = None
    for seed in range(2):
        trial = store.create_trial(experiment.id, "{}", seed=seed)
        assert trial.id is not None
        early = record_checkpoint(store, trial.id, f"/ck/{seed}/10", 10)
        last = record_checkpoint(store, trial.id, f"/ck/{seed}/20", 20)
        rows = [("public", t, layer, 100 + seed, 0, 5) for t, layer in tensors]
        rows += [("writers", t, layer, 7, 0, 2) for t, layer in tensors[:2] + adapter]
        record_ledger(store, trial.id, rows)
        record_ledger(
            store, trial.id, [(c, t, la, e // 2, 0, s // 2) for c, t, la, e, _, s in rows], early.id
        )
        record_attestation(store, last.id, "sha256:" + "0" * 64, '{"not": "an envelope"}')
    assert last is not None and last.id is not None
    with store.session() as session:
        session.add(RegisteredModel(name="digits"))
        session.flush()
        session.add(ModelVersion(model_name="digits", version=1, checkpoint_id=last.id))
        session.add(
            ModelVersion(
                model_name="digits", version=2, checkpoint_id=last.id, removed_adapters_json='["pii"]'
            )
        )


@pytest.fixture
def lineage_stores(pg_store: TrackingStore, tmp_path: Path) -> tuple[str, str]:
    """The URLs of a PostgreSQL and a SQLite store holding the same lineage rows."""
    sqlite = TrackingStore.open(f"sqlite:///{tmp_path / 'tracking.db'}")
    for store in (pg_store, sqlite):
        lineage_fixture(store)
    sqlite.close()
    return pg_store.url, sqlite.url


def reader_of(url: str) -> StoreReader:
    return StoreReader(read_only_engine(url))


def test_lineage_answers_on_postgresql_equal_sqlites(lineage_stores: tuple[str, str]) -> None:
    answers = []
    for url in lineage_stores:
        reader = reader_of(url)
        influence = reader.influence("writers", Window(0, 10)).model_dump()
        answers.append(
            {
                "checkpoint": reader.checkpoint_lineage(4).model_dump(),
                "early checkpoint": reader.checkpoint_lineage(3).model_dump(),
                "layer": reader.checkpoint_lineage(2, layer="1").model_dump(),
                "version": reader.version_lineage("digits", 2).model_dump(),
                "influence total": influence["total"],
                "influence": sorted(influence["items"], key=lambda i: (i["trial_id"], i["checkpoint_id"])),
            }
        )
        reader.engine.dispose()
    on_postgresql, on_sqlite = answers

    assert on_postgresql == on_sqlite
    layers = {layer["layer"] for layer in on_postgresql["checkpoint"]["layers"]}
    assert layers == {"layer 0", "layer 1", "(outside layers)", "adapter:pii"}
    assert "adapter:pii" not in {layer["layer"] for layer in on_postgresql["version"]["layers"]}
    assert on_postgresql["influence total"] == 4  # (trial ledger, early checkpoint) x 2 trials


def test_influence_pages_hold_the_same_items_on_both_databases(lineage_stores: tuple[str, str]) -> None:
    pages = []
    for url in lineage_stores:
        reader = reader_of(url)
        pages.append([reader.influence("public", Window(offset, 1)).model_dump() for offset in range(4)])
        reader.engine.dispose()
    assert pages[0] == pages[1]


def test_every_table_the_lineage_queries_filter_is_read_through_an_index(
    pg_store: TrackingStore,
) -> None:
    lineage_fixture(pg_store)
    reader = reader_of(pg_store.url)
    issued: list[tuple[str, Any]] = []
    sa.event.listen(reader.engine, "before_cursor_execute", lambda *a: issued.append((a[2], a[3])))
    reader.checkpoint_lineage(4)
    reader.checkpoint_lineage(3, layer="0")
    reader.version_lineage("digits", 2)
    reader.influence("writers", Window(0, 10))
    reader.engine.dispose()
    assert len(issued) > 10

    scans = []
    with pg_store.engine.connect() as connection:
        connection.exec_driver_sql("SET enable_seqscan = off")  # any usable index beats a scan now
        for statement, parameters in issued:
            plan = connection.exec_driver_sql(f"EXPLAIN {statement}", parameters).scalars().all()
            scans += [f"{line.strip()} in: {statement}" for line in plan if "Seq Scan" in line]
    assert scans == []


# -- URLs and the controller's write path -------------------------------------------------------


def test_libpq_and_explicit_driver_urls_reach_the_server_through_psycopg(pg_url: str) -> None:
    upgrade(pg_url)
    given = sa.engine.make_url(pg_url)
    for drivername in ("postgresql", "postgresql+psycopg"):
        url = given.set(drivername=drivername).render_as_string(hide_password=False)
        engine = create_tracking_engine(url)
        try:
            assert engine.dialect.driver == "psycopg"
            assert current_revision(engine) is not None
        finally:
            engine.dispose()
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["tracking"] = {"database": "mysql://govray@db/tracking"}
    with pytest.raises(ConfigError, match=r"sqlite:/// or postgresql://"):
        parse_experiment(yaml.safe_dump(raw), source=EXAMPLE_CONFIG)


def test_the_run_recorder_writes_a_run_to_postgresql(pg_url: str, tmp_path: Path) -> None:
    from govray.platform.run.recorder import GcSettings, RunRecorder
    from govray.train.run.reports import StepReport
    from govray.train.step.ledger import Ledger, LedgerEntry

    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["tracking"] = {"database": pg_url}
    raw["storage_path"] = str(tmp_path / "storage")
    config = parse_experiment(yaml.safe_dump(raw), source=EXAMPLE_CONFIG)
    assert config.database_url == pg_url
    store = TrackingStore.open(config.database_url)  # what the driver does before a run
    try:
        experiment = store.create_experiment(config.name, config.model_dump_json(), "d", config.storage_path)
        assert experiment.id is not None
        trial = store.create_trial(experiment.id, "{}", seed=0)
        assert trial.id is not None
        layers: dict[str, int | None] = {"fc1.weight": 0, "fc2.weight": 1}
        gc = GcSettings(experiment.id, "validation_loss", smaller_is_better=True)
        recorder = RunRecorder(store, trial.id, layers, gc)
        for step in (10, 20, 30):
            saved = tmp_path / f"checkpoint_{step}"
            saved.mkdir()
            metrics = {"training_loss": 1 / step, "validation_loss": 2 / step}
            recorder.record(StepReport(step=step, epoch=0, metrics=metrics, checkpoint=str(saved)))
        ledger = Ledger({("digits-public", name): LedgerEntry(300, 3 * 2**31, 30) for name in layers})
        recorder.record(
            StepReport(step=31, epoch=0, metrics={"training_loss": 0.01}, ledger=ledger.to_json())
        )

        assert [m.step for m in store.metrics(trial.id, "validation_loss")] == [10, 20, 30]
        assert [c.step for c in checkpoints(store, trial.id)] == [10, 20, 30]
        assert store.get_trial(trial.id).last_step == 31
        stored = {(r.parameter, r.layer_index, r.examples, r.tokens) for r in ledger_rows(store, trial.id)}
        assert stored == {("fc1.weight", 0, 300, 3 * 2**31), ("fc2.weight", 1, 300, 3 * 2**31)}
    finally:
        store.close()


BAD_TEXT = ("dig\x00its", "a" * 5000, "digits\n", "x:5", "\x00")
BAD_NUMBERS = ("\x00", "1\x00", "9" * 40, "-1", "1e999")


def test_bad_input_on_postgresql_is_a_4xx_never_a_503(pg_store: TrackingStore, tmp_path: Path) -> None:
    """NUL bytes and very long strings, which PostgreSQL would refuse (and a driver error would
    turn into 503 "try again"), are refused at the edge with 422/404 on PostgreSQL too."""
    from urllib.parse import quote

    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    from govray.config.serve import ServeSettings
    from serve.app import create_app

    settings = ServeSettings(database_url=pg_store.url, token=SecretStr("pg-token"))
    paths = []
    for text in BAD_TEXT:
        name = quote(text, safe="")
        paths += [
            f"/api/models/{name}/versions",
            f"/api/models/{name}/versions/1",
            f"/api/models/{name}/versions/1/lineage",
            f"/api/corpora/{name}/influence",
            f"/api/corpora/{name}/rows/0",
            f"/api/audit?event_type={name}",
            f"/api/trials/1/metrics?name={name}",
            f"/lineage/models/{name}/1",
        ]
    for number in BAD_NUMBERS:
        value = quote(number, safe="")
        paths += [
            f"/api/experiments/{value}",
            f"/api/trials/{value}",
            f"/api/checkpoints/{value}/lineage",
            f"/api/attestations/{value}",
            f"/api/models/digits/versions/{value}",
            f"/api/corpora/digits-public/rows/{value}",
            f"/api/experiments?offset={value}",
        ]
    headers = {"Authorization": "Bearer pg-token"}
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        answers = {path: client.get(path).status_code for path in paths}
        for text in BAD_TEXT:
            name = quote(text, safe="")
            answers[f"POST {name}"] = client.post(
                f"/api/models/{name}/versions", json={"checkpoint_id": 1}, headers=headers
            ).status_code
            answers[f"verify {text[:8]!r}"] = client.post(
                "/api/verify", json={"model": f"{text}:1", "attestation_id": 1}
            ).status_code
    server_errors = {path: code for path, code in answers.items() if code >= 500}
    assert server_errors == {}
    assert all(400 <= code < 500 for code in answers.values()), answers
    assert pg_store.list_experiments() == []  # nothing was written
