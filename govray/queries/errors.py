"""What the query layer raises: a question asked wrongly, or about something the store lacks."""

from __future__ import annotations

from sqlalchemy.exc import SQLAlchemyError

from govray.core.errors import GovrayError

# What the database raises when the store itself fails (unreachable, locked, a dropped connection):
# SQLAlchemy's base error, named here so that the layers above the query layer need not import it.
StoreFailure = SQLAlchemyError


class QueryError(GovrayError):
    """A question the store cannot answer as asked (a bad page window, an unknown filter value)."""

    exit_code = 2


class NotFoundError(QueryError):
    """The question names something the store does not hold (an id, a model, a corpus, a layer)."""
