"""Opening a tracking store for reading: a read-only engine, and a value that tells a reader when
anyone wrote to the store.

``StoreGeneration`` reads SQLite's ``PRAGMA data_version`` on one dedicated connection, or
PostgreSQL's current snapshot (which moves with every write transaction), in microseconds; a store
whose changes cannot be seen this way has no generation (None).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import SQLAlchemyError

from govray.core.errors import TrackingError
from govray.tracking.database import tracking_url
from govray.tracking.store import SQLITE_BUSY_TIMEOUT_MS, alembic_config, current_revision, masked


def read_only_engine(url: str) -> Engine:
    """An engine that can only read the store at ``url``: SQLite opened with ``mode=ro``,
    PostgreSQL in read-only transactions. Connected once, so a bad URL fails here, and so does a
    store whose schema is not this govray's (a reader never migrates)."""
    parsed = tracking_url(url)  # a bare postgresql:// means psycopg, as for the writers
    options: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise TrackingError("an in-memory tracking store cannot be read by another process")
        path = Path(parsed.database).expanduser().resolve()
        if not path.is_file():
            raise TrackingError(f"no tracking store at {path}")
        parsed = parsed.set(database=f"file:{path}", query={"mode": "ro", "uri": "true"})
        options["connect_args"] = {"check_same_thread": False}
    elif parsed.get_backend_name() == "postgresql":
        options["execution_options"] = {"postgresql_readonly": True}
    try:
        engine = create_engine(parsed, **options)
        if parsed.get_backend_name() == "sqlite":
            event.listen(engine, "connect", _read_only_pragmas)
        found = current_revision(engine)
    except (SQLAlchemyError, ImportError) as exc:
        reason = getattr(exc, "orig", None) or exc
        raise TrackingError(f"cannot open tracking store {masked(url)} read-only: {reason}") from exc
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if found != head:
        engine.dispose()
        raise TrackingError(
            f"tracking store {masked(url)} is at schema revision {found!r}, this govray reads {head!r}: "
            "migrate it first (any govray command that opens it, e.g. govray audit verify --database URL)"
        )
    return engine


def _read_only_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA query_only=ON")
    finally:
        cursor.close()


class StoreGeneration:
    """A value that differs after any commit to the store (None: this store cannot tell)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._sqlite: Any = None
        if engine.dialect.name == "sqlite":
            # data_version compares against what THIS connection saw: keep one connection for it
            self._sqlite = engine.raw_connection()

    def current(self) -> object | None:
        if self._sqlite is not None:
            with self._lock:
                cursor = self._sqlite.cursor()
                try:
                    cursor.execute("PRAGMA data_version")
                    return cursor.fetchone()[0]
                finally:
                    cursor.close()
        if self.engine.dialect.name == "postgresql":
            with self.engine.connect() as connection:
                return connection.execute(text("SELECT pg_current_snapshot()::text")).scalar_one()
        return None

    def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()
