"""Where a golden run's shards put the rows of its PII corpus (digits-writers)."""

from __future__ import annotations

from govray.data.shards import ShardSet
from tests.helpers.golden import GoldenRun

WRITERS = "digits-writers"  # PII, routed to the adapter pii-lora by the digits policy


def corpus_rows(golden: GoldenRun, route: str) -> dict[int, int]:
    """Row number in WRITERS → position in shards/train/ROUTE."""
    table = ShardSet.open(golden.shard_root).route_table(route, ["_corpus", "_row"])
    corpora, rows = table.column("_corpus").to_pylist(), table.column("_row").to_pylist()
    return {
        row: position for position, (c, row) in enumerate(zip(corpora, rows, strict=True)) if c == WRITERS
    }
