"""Read-only questions to the tracking store, answered as pydantic documents: the query layer of
the lineage app (``serve/``) and of the CLI.

Lists come in pages (a ``Window`` of ``offset`` and ``limit`` ≤ ``MAX_LIMIT``; the ``Page`` holds
the ``total``); an unknown id raises ``NotFoundError`` naming it. Lineage and influence are
aggregated in SQL over the ledger's indexed columns, so a store of millions of ledger rows answers
without reading them all::

    reader = StoreReader(read_only_engine("sqlite:///runs/tracking.db"))
    reader.checkpoint_lineage(12, layer="fc1")             # corpora that directly reached fc1
    reader.influence("digits-writers", Window(0, 20))      # checkpoints and layers a corpus reached

Layers are named as the attestation's coverage matrix names them: the trial's layer names (read
from the checkpoint's signed coverage statement; ``layer N`` when it has none), ``adapter:NAME``
for a removable adapter's tensors, or ``(outside layers)``. Per (layer, corpus) the counts are the
largest over the layer's tensors — examples, tokens and steps that directly reached a tensor of
it — and ``tensors`` is how many of its tensors the corpus reached.
"""

from govray.core.identifiers import MAX_ID
from govray.queries.engine import StoreGeneration, read_only_engine
from govray.queries.errors import NotFoundError, QueryError, StoreFailure
from govray.queries.reader import StoreReader
from govray.queries.views import DEFAULT_LIMIT, MAX_LIMIT, Page, Window

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_ID",
    "MAX_LIMIT",
    "NotFoundError",
    "Page",
    "QueryError",
    "StoreFailure",
    "StoreGeneration",
    "StoreReader",
    "Window",
    "read_only_engine",
]
