"""The tracking database itself: its URL, an engine for it, and its migrations.

Two backends, one schema and one set of Alembic migrations:

- ``sqlite:///PATH`` — a file, embedded, the default (``<storage_path>/govray.db``);
- ``postgresql+psycopg://USER:PASSWORD@HOST:5432/DB`` — a shared server, for clusters, where the
  Ray Train controller may sit on any node. govray pins the psycopg (3) driver; a bare
  ``postgresql://`` URL is read as psycopg too (SQLAlchemy would pick psycopg2, which govray does
  not install).

>>> upgrade("postgresql+psycopg://govray@db.internal/tracking")   # doctest: +SKIP
'0001_release'
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from govray.core.errors import TrackingError

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
POSTGRESQL_DRIVER = "psycopg"


def masked(url: str | URL) -> str:
    """``url`` with its password hidden, fit for an error message or a log line."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        return "<unparseable database URL>"


def tracking_url(url: str | URL) -> URL:
    """``url`` parsed, with PostgreSQL's driver made explicit (``postgresql://`` → psycopg).

    Raises TrackingError when it is not a database URL.
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        # Not shown: an unparseable URL cannot be masked, and it may hold a password.
        raise TrackingError(f"the tracking store URL is not a database URL: {exc}") from exc
    if parsed.drivername == "postgresql":
        return parsed.set(drivername=f"postgresql+{POSTGRESQL_DRIVER}")
    return parsed


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers run beside the one writer; the busy timeout makes writers queue instead
    # of failing at once; SQLite leaves foreign keys off unless asked, per connection.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def create_tracking_engine(url: str) -> Engine:
    """An engine for ``url``, connected once so a bad URL fails here with a TrackingError."""
    parsed = tracking_url(url)
    where = masked(url)
    options: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        options["connect_args"] = {"check_same_thread": False}
        if parsed.database in (None, "", ":memory:"):
            options["poolclass"] = StaticPool  # one shared connection, or each sees its own db
        else:
            try:
                Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TrackingError(f"cannot open tracking store {where}: {exc}") from exc
    elif parsed.get_backend_name() == "postgresql":
        # A controller holds its pool for hours; a server restart or an idle timeout in between
        # would otherwise surface as an error on the next metric write.
        options["pool_pre_ping"] = True
    try:
        engine = create_engine(parsed, **options)
        if parsed.get_backend_name() == "sqlite":
            event.listen(engine, "connect", _sqlite_pragmas)
        with engine.connect():
            pass
    except (SQLAlchemyError, ImportError) as exc:
        reason = getattr(exc, "orig", None) or exc
        raise TrackingError(f"cannot open tracking store {where}: {reason}") from exc
    return engine


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config for the packaged migrations, independent of the working directory."""
    from alembic.config import Config  # Alembic only where a store is opened: ~0.2 s at import

    config = Config()
    # ConfigParser interpolates '%', so a path containing one must be escaped.
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def current_revision(engine: Engine) -> str | None:
    """The migration revision the database is at (``None`` for an empty database)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(target: str | Engine) -> str:
    """Run ``alembic upgrade head`` on a URL or an engine; return the revision reached.

    Raises TrackingError if the database is at a revision this govray does not know (written
    by a newer govray, say) or a migration fails.
    """
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    engine = create_tracking_engine(target) if isinstance(target, str) else target
    where = masked(engine.url)
    scripts = ScriptDirectory.from_config(alembic_config())
    known = [script.revision for script in scripts.walk_revisions()]  # newest first
    try:
        with engine.begin() as connection:
            _lock_for_migration(connection)
            found = MigrationContext.configure(connection).get_current_revision()
            if found is not None and found not in known:
                raise TrackingError(
                    f"tracking store {where} is at revision {found!r}, which this govray does "
                    f"not know (newest known: {known[0]!r}): a store written by a newer govray "
                    "needs that govray; one from before 1.0 cannot be migrated (start a new store)"
                )
            command.upgrade(alembic_config(connection), "head")
    except (SQLAlchemyError, CommandError) as exc:
        raise TrackingError(f"migrating tracking store {where} failed: {exc}") from exc
    finally:
        if isinstance(target, str):
            engine.dispose()
    return known[0]


MIGRATION_LOCK = 0x676F7672  # "govr": the PostgreSQL advisory lock that serializes migrations


def _lock_for_migration(connection: Connection) -> None:
    """Make the processes that open one store at the same moment (a job's controllers, several
    engineers' drivers) migrate it one after the other: the second waits, then finds the schema
    current. SQLite: the database's write lock, taken now (``BEGIN IMMEDIATE``; waits up to the
    busy timeout); PostgreSQL: a transaction-scoped advisory lock (its DDL is transactional)."""
    if connection.dialect.name == "sqlite":
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    elif connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
