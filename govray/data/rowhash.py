"""Row hashes: each row's identity, computed a unit of rows at a time, and the holdout split.

A row's hash decides its holdout split, the probe's samples, and what lineage answers cite;
anyone can recompute it from the row: ``sha256`` of the row's canonical binary encoding
(``govray.data.rowcode``: sorted column names, a type tag and a fixed-width or length-prefixed
payload per value). A table's rows are encoded by Arrow and numpy, then digested in one call of the
compiled kernel (``govray/data/_rowdigest.c``; hashlib row by row where it was not built); the same
logical rows hash equally whatever the file format and however the rows are cut into batches.

An ingest records the version it hashed with (``ShardManifest.row_hash_version``:
``ROW_HASH_VERSION``, 2, the numbering going on from the pre-release one); shards of any other
version are refused. Shards store the 32 raw bytes (:func:`row_digests`); every answer govray gives
shows the 64 hex digits.

Example::

    hashes, prefixes = row_hashes(table)        # hex strings; first 64 bits as uint64
    holdout = holdout_mask(prefixes, 0.1)       # == [in_holdout(h, 0.1) for h in hashes]
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import pyarrow as pa

from govray.core.errors import IngestError
from govray.data.rowcode import encode_row, encode_values, header, hex_digests, raw_digests, sha256_each

ROW_HASH_VERSION = 2  # the one version this govray computes and reads


def check_version(version: object) -> int:
    """``version`` if it is the one this govray computes, else an ``IngestError`` saying so."""
    if version != ROW_HASH_VERSION or not isinstance(version, int):
        raise IngestError(
            f"row hash version {version!r} is not the one this govray computes ({ROW_HASH_VERSION}): "
            "ingest the corpora again"
        )
    return version


def row_hash(row: dict[str, Any]) -> str:
    """The hash of one row (source columns only): the definition, value by value."""
    return hashlib.sha256(encode_row(row)).hexdigest()


def row_hashes(table: pa.Table) -> tuple[pa.Array, np.ndarray]:
    """:func:`row_hash` of every row of ``table``: the hex digests (a string array) and their first
    64 bits (uint64, for :func:`holdout_mask`)."""
    return hex_digests(_digests(table))


def row_digests(table: pa.Table) -> tuple[pa.FixedSizeBinaryArray, np.ndarray]:
    """:func:`row_hashes` as raw digests: a ``binary(32)`` array (the shards' ``_row_hash``: half
    the bytes of the hex, and no hex to build) and their first 64 bits."""
    return raw_digests(_digests(table))


def _digests(table: pa.Table) -> bytes:
    offsets, data = encode_values(table)
    return sha256_each(offsets, data, header(table.column_names))


def in_holdout(digest: str, fraction: float) -> bool:
    """Deterministic split: the first 64 bits of the row hash as a fraction of 2**64."""
    return int(digest[:16], 16) < fraction * 2**64


def holdout_mask(prefixes: np.ndarray, fraction: float) -> np.ndarray:
    """:func:`in_holdout` of every row, from the first 64 bits of its hash (``row_hashes``)."""
    # prefix < fraction * 2**64 (a real number) exactly: prefix < ceil of it, an integer.
    bound = math.ceil(fraction * 2**64)
    if bound <= 0:
        return np.zeros(len(prefixes), dtype=bool)
    if bound >= 2**64:
        return np.ones(len(prefixes), dtype=bool)
    return prefixes < np.uint64(bound)
