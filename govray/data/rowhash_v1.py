"""Row hash version 1: the sha256 of each row's canonical JSON, a unit of rows at a time.

Ingests recorded before version 2 (``govray.data.rowhash``) hold these hashes; this module stays
to read and verify them, and to reproduce such an ingest. A row's hash is
``sha256(canonical_json(row))`` over its source columns (:func:`row_hash_v1`, the definition anyone
can recompute from the row). Ingest hashes every row of a corpus, so
:func:`row_hashes_v1` builds the same canonical JSON for a whole table with Arrow kernels — keys in
sorted order, integers and booleans as Arrow prints them, floats in Python's ``repr`` form, strings
JSON-escaped — and leaves only the sha256 call per row to Python. Values whose text Arrow does not
print as Python does (floats outside [1e-4, 1e10), NaN and infinities, strings with rare control
characters, and every non-scalar type: lists, structs, binary, dates) are encoded by Python, value
by value, exactly as :func:`row_hash_v1` encodes them. ``tests/test_rowhash.py`` holds the two equal
over generated tables of every type.

Per row and core it costs ~2.2 µs, most of it formatting floats as text: version 2 hashes a
binary encoding instead (``govray.data.rowcode``).

Example::

    hashes, prefixes = row_hashes_v1(table)        # hex strings; first 64 bits as uint64
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from govray.core.canonical import canonical_json, canonical_text, sha256_hex
from govray.data.rowcode import hex_digests, json_value, sha256_each

# Floats Arrow prints in fixed notation with Python's digits (both print the shortest digits that
# round-trip; Python switches to exponents below 1e-4, Arrow at 1e10 and above).
_FIXED_LOW, _FIXED_HIGH = 1e-4, 1e10
# Control characters json.dumps writes as short escapes; the others become \u00XX (by Python).
_SHORT_ESCAPES = (("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"), ("\b", "\\b"), ("\f", "\\f"))
_OTHER_CONTROLS = "[\x00-\x07\x0b\x0e-\x1f]"


_SCALARS = frozenset({str, int, float, bool, type(None)})  # JSON values as they are


def row_hash_v1(row: dict[str, Any]) -> str:
    """sha256 of the row's canonical JSON (source columns only)."""
    values = {str(k): v if type(v) in _SCALARS else json_value(v) for k, v in row.items()}
    return sha256_hex(canonical_json(values))


def row_hashes_v1(table: pa.Table) -> tuple[pa.Array, np.ndarray]:
    """:func:`row_hash_v1` of every row of ``table``: the hex digests (a string array) and their first
    64 bits (uint64, for ``govray.data.rowhash.holdout_mask``)."""
    return hex_digests(digests_v1(table))


def digests_v1(table: pa.Table) -> bytes:
    """:func:`row_hash_v1` of every row of ``table`` as raw digests, 32 bytes a row, concatenated."""
    count = table.num_rows
    names = sorted(table.column_names)
    pieces: list[Any] = []
    for index, name in enumerate(names):
        pieces.append(_literal(("{" if index == 0 else ",") + canonical_text(name) + ":"))
        pieces.append(_json_texts(table[name]))
    pieces.append(_literal("}"))
    if count == 0:
        return b""
    if names:
        texts = pc.binary_join_element_wise(*pieces, _literal(""))
    else:
        texts = pa.array(["{}"] * count, type=pa.large_string())
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    texts = texts.cast(pa.large_string())
    _, offsets, data = texts.buffers()
    starts = np.frombuffer(offsets, dtype=np.int64)[texts.offset : texts.offset + count + 1]
    return sha256_each(starts, memoryview(data) if data is not None else memoryview(b""))


def _json_texts(column: pa.ChunkedArray) -> pa.Array:
    """Each value's canonical JSON text (a large_string array; nulls as ``null``)."""
    values = column.combine_chunks()
    kind = values.type
    if pa.types.is_integer(kind):
        texts = values.cast(pa.large_string())
    elif pa.types.is_boolean(kind):
        texts = pc.if_else(values, "true", "false").cast(pa.large_string())
    elif pa.types.is_float32(kind) or pa.types.is_float64(kind):
        texts = _float_texts(values.cast(pa.float64()))
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        texts = _string_texts(values.cast(pa.large_string()))
    elif pa.types.is_null(kind):
        texts = pa.nulls(len(values), type=pa.large_string())
    else:  # lists, structs, binary, dates, decimals, dictionaries, halves: as row_hash_v1 encodes them
        return _python_texts(values.to_pylist())
    return pc.fill_null(texts, "null")


def _literal(text: str) -> pa.Scalar:
    return pa.scalar(text, type=pa.large_string())


def _python_texts(values: list[Any]) -> pa.Array:
    return pa.array(
        [canonical_text(v if type(v) in _SCALARS else json_value(v)) for v in values], type=pa.large_string()
    )


def _float_texts(values: pa.Array) -> pa.Array:
    texts = values.cast(pa.large_string())
    magnitude = pc.abs(values)
    fixed = pc.or_(
        pc.and_(pc.greater_equal(magnitude, _FIXED_LOW), pc.less(magnitude, _FIXED_HIGH)),
        pc.equal(values, 0.0),
    )
    fixed = pc.fill_null(fixed, True)  # nulls: "null" later
    # Arrow prints integral floats without a fraction ("1", "-0"); Python adds ".0".
    integral = pc.fill_null(pc.invert(pc.match_substring(texts, ".")), False)
    texts = pc.if_else(integral, pc.binary_join_element_wise(texts, _literal(".0"), _literal("")), texts)
    return _patch(texts, fixed, values)


def _string_texts(values: pa.Array) -> pa.Array:
    texts = pc.replace_substring(values, "\\", "\\\\")
    texts = pc.replace_substring(texts, '"', '\\"')
    for character, escape in _SHORT_ESCAPES:
        texts = pc.replace_substring(texts, character, escape)
    texts = pc.binary_join_element_wise(_literal('"'), texts, _literal('"'), _literal(""))
    plain = pc.fill_null(pc.invert(pc.match_substring_regex(values, _OTHER_CONTROLS)), True)
    return _patch(texts, plain, values)


def _patch(texts: pa.Array, good: pa.Array, values: pa.Array) -> pa.Array:
    """``texts`` with the values where ``good`` is false encoded by Python instead."""
    bad = pc.invert(good)
    if not pc.any(bad).as_py():
        return texts
    return pc.replace_with_mask(texts, bad, _python_texts(values.filter(bad).to_pylist()))
