"""Row hashes: each row's identity, computed a unit of rows at a time, and the holdout split.

A row's hash decides its holdout split, the probe's samples, and what lineage answers cite;
anyone can recompute it from the row. Two versions exist; an ingest records the one it used
(``ShardManifest.row_hash_version``) and every version here stays readable:

- **2** (``ROW_HASH_VERSION``, new ingests): ``sha256`` of the row's canonical binary encoding
  (``govray.data.rowcode``: sorted column names, a type tag and a fixed-width or length-prefixed
  payload per value). A table's rows are encoded by Arrow and numpy, then digested in one call
  of the compiled kernel (``govray/data/_rowdigest.c``; hashlib row by row where it was not
  built); the same logical rows hash equally whatever the file format and however the rows are
  cut into batches.
- **1** (ingests recorded before version 2): ``sha256`` of the row's canonical JSON
  (``govray.data.rowhash_v1``).

Both are 64 hex digits, so a version is named where a hash is shown. Shards (format 4) store the
32 raw bytes (:func:`row_digests`); every answer govray gives shows the hex.

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
from govray.data import rowhash_v1
from govray.data.rowcode import encode_row, encode_values, header, hex_digests, raw_digests, sha256_each

ROW_HASH_VERSION = 2  # what new ingests use
READABLE_ROW_HASH_VERSIONS = (1, 2)


def check_version(version: object) -> int:
    """``version`` if this govray can compute it, else an ``IngestError`` naming those it can."""
    if version not in READABLE_ROW_HASH_VERSIONS or not isinstance(version, int):
        known = ", ".join(map(str, READABLE_ROW_HASH_VERSIONS))
        raise IngestError(f"row hash version {version!r} is not one this govray can compute ({known})")
    return version


def row_hash(row: dict[str, Any], version: int = ROW_HASH_VERSION) -> str:
    """The hash of one row (source columns only): the definition, value by value."""
    if check_version(version) == 1:
        return rowhash_v1.row_hash_v1(row)
    return hashlib.sha256(encode_row(row)).hexdigest()


def row_hashes(table: pa.Table, version: int = ROW_HASH_VERSION) -> tuple[pa.Array, np.ndarray]:
    """:func:`row_hash` of every row of ``table``: the hex digests (a string array) and their first
    64 bits (uint64, for :func:`holdout_mask`)."""
    return hex_digests(_digests(table, version))


def row_digests(
    table: pa.Table, version: int = ROW_HASH_VERSION
) -> tuple[pa.FixedSizeBinaryArray, np.ndarray]:
    """:func:`row_hashes` as raw digests: a ``binary(32)`` array (the shards' ``_row_hash`` since
    shard format 4: half the bytes of the hex, and no hex to build) and their first 64 bits."""
    return raw_digests(_digests(table, version))


def _digests(table: pa.Table, version: int) -> bytes:
    if check_version(version) == 1:
        return rowhash_v1.digests_v1(table)
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
