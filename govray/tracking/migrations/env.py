"""Alembic environment for the tracking store.

``govray.tracking.store.upgrade`` passes its own connection in ``config.attributes["connection"]``
so migrations run on the store's engine (with its SQLite pragmas); without one, the URL comes
from the ``sqlalchemy.url`` option. Offline mode renders SQL for that URL.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine
from sqlmodel import SQLModel

import govray.tracking.tables  # noqa: F401  (registers the tables on SQLModel.metadata)

target_metadata = SQLModel.metadata


def run_on(connection: Connection) -> None:
    """Run the pending migrations on ``connection``; SQLite needs batch mode to alter tables."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """Emit the migration SQL for ``sqlalchemy.url`` without connecting."""
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
elif (given := context.config.attributes.get("connection")) is not None:
    run_on(given)
else:
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("set sqlalchemy.url or pass a connection in config.attributes")
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            run_on(connection)
    finally:
        engine.dispose()
