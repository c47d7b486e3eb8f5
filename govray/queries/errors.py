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


class LedgerNotStored(NotFoundError):
    """A recorded checkpoint's ledger is not in the store (it could not be stored when the
    checkpoint was recorded): its verified ``state.json`` holds it, and a writer may store it from
    there, or say why it cannot."""

    def __init__(self, message: str, checkpoint_id: int) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
