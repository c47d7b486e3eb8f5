"""What the query layer raises: a question asked wrongly, or about something the store lacks."""

from __future__ import annotations

from govray.errors import GovrayError


class QueryError(GovrayError):
    """A question the store cannot answer as asked (a bad page window, an unknown filter value)."""

    exit_code = 2


class NotFoundError(QueryError):
    """The question names something the store does not hold (an id, a model, a corpus, a layer)."""
