"""The canonical binary encoding of a row, which row hash version 2 digests.

A row is encoded as a *header*, the same for every row of a table, followed by its *values*::

    header = b"govray-row-v2\\n" + u32(number of columns)
             + for each column name, in sorted order: u32(length) + the name's UTF-8 bytes
             + zero bytes up to a multiple of 64 bytes
    values = for each column, in the same order: a one-byte type tag and its payload

    tag  payload                                   values
    n    (none)                                    null, of any column type
    b    one byte, 0 or 1                          booleans
    i    8 bytes, little-endian two's complement   integers of any width in [-2**63, 2**63)
    u    8 bytes, little-endian unsigned           integers in [2**63, 2**64)
    f    8 bytes, little-endian IEEE 754 binary64  floats of any width (widened exactly); every
                                                   NaN as 0x7ff8000000000000
    s    u64(length) + UTF-8 bytes                 strings
    y    u64(length) + bytes                       binary
    j    u64(length) + canonical JSON (UTF-8)      everything else: lists, structs, dates,
                                                   decimals, timestamps (their string form)

All integers of the layout (``u32``, ``u64``) are little-endian. Lengths and tags make the
encoding unambiguous; the tag follows the value, not the column's type, so a null is the same in
a typed column and an all-null one, and an int32 column hashes as an int64 one: the same logical
rows read from CSV, JSONL or Parquet encode the same. The header is a multiple of SHA-256's
64-byte block, so a digest's state after the header is computed once per table.

:func:`encode_row` is the definition, value by value in Python; :func:`encode_values` encodes a
whole table with Arrow and numpy, equal to it on every row (``tests/test_rowhash_v2.py``).
"""

from __future__ import annotations

import binascii
import hashlib
import itertools
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from govray.core.canonical import canonical_json

try:  # the compiled kernel (pyproject.toml's ext-modules); optional
    from govray.data import _rowdigest
except ImportError:  # pragma: no cover - where no C compiler built it
    _rowdigest = None  # type: ignore[assignment]

MAGIC = b"govray-row-v2\n"
BLOCK = 64  # SHA-256's block size: the header is padded to a multiple of it
_NAN = struct.pack("<d", math.nan)  # 0x7ff8000000000000: the one NaN
_SIGNED = (-(2**63), 2**63)


def header(names: list[str]) -> bytes:
    """The header of rows with these columns (in any order: they are sorted here)."""
    encoded = [name.encode() for name in sorted(names)]
    text = MAGIC + struct.pack("<I", len(encoded)) + b"".join(struct.pack("<I", len(n)) + n for n in encoded)
    return text + b"\0" * (-len(text) % BLOCK)


def encode_value(value: Any) -> bytes:
    """One value's tag and payload (the table above)."""
    if value is None:
        return b"n"
    if isinstance(value, bool):
        return b"b" + (b"\1" if value else b"\0")
    if isinstance(value, int) and _SIGNED[0] <= value < _SIGNED[1]:
        return b"i" + struct.pack("<q", value)
    if isinstance(value, int) and 0 <= value < 2**64:
        return b"u" + struct.pack("<Q", value)
    if isinstance(value, float):
        return b"f" + (_NAN if math.isnan(value) else struct.pack("<d", value))
    if isinstance(value, str):
        return _sized(b"s", value.encode())
    if isinstance(value, bytes):
        return _sized(b"y", value)
    return _sized(b"j", canonical_json(json_value(value)))


def encode_row(row: dict[str, Any]) -> bytes:
    """The row's encoding: the header of its column names, then its values in that order."""
    return header(list(row)) + b"".join(encode_value(row[name]) for name in sorted(row))


def encode_values(table: pa.Table) -> tuple[np.ndarray, memoryview]:
    """The values part of every row's encoding: row ``r``'s bytes are ``data[offsets[r]:
    offsets[r + 1]]`` (offsets: int64, one more than rows). Runs of fixed-width columns without
    nulls are laid out by numpy, a packed record per row; strings and nulls by Arrow's kernels;
    other types value by value."""
    count = table.num_rows
    parts: list[_Fixed | pa.Array] = []
    for name in sorted(table.column_names):
        part = _encoded(table[name].combine_chunks())
        if isinstance(part, _Fixed) and parts and isinstance(parts[-1], _Fixed):
            parts[-1] = parts[-1].then(part)
        else:
            parts.append(part)
    if not parts:
        return np.zeros(count + 1, dtype=np.int64), memoryview(b"")
    if len(parts) == 1 and isinstance(parts[0], _Fixed):
        records = parts[0].records(count)
        return _offsets(count, records.itemsize), records.view(np.uint8).data
    pieces = [part.binary(count) if isinstance(part, _Fixed) else part for part in parts]
    joined = pc.binary_join_element_wise(*pieces, pa.scalar(b"", type=pa.large_binary()))
    _, offsets_buffer, data_buffer = joined.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[joined.offset : joined.offset + count + 1]
    return offsets, memoryview(data_buffer) if data_buffer is not None else memoryview(b"")


@dataclass(frozen=True)
class _Fixed:
    """Columns whose every value has the same width: per column, its tags (one per row, or one
    for all) and its payloads (a numpy array of the payload's type)."""

    columns: tuple[tuple[np.ndarray | int, np.ndarray], ...]

    def then(self, other: _Fixed) -> _Fixed:
        return _Fixed(self.columns + other.columns)

    def records(self, count: int) -> np.ndarray:
        """One packed record per row: each column's tag byte, then its payload."""
        names: list[str] = []
        formats: list[Any] = []
        offsets: list[int] = []
        width = 0
        for index, (_, payload) in enumerate(self.columns):
            names += [f"t{index}", f"v{index}"]
            formats += ["u1", payload.dtype]
            offsets += [width, width + 1]
            width += 1 + payload.dtype.itemsize
        layout = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": width})
        records = np.empty(count, dtype=layout)
        rows = records.view(np.uint8).reshape(count, width)  # tags through bytes: faster than fields
        for index, (tags, payload) in enumerate(self.columns):
            rows[:, offsets[2 * index]] = tags
            records[f"v{index}"] = payload
        return records

    def binary(self, count: int) -> pa.Array:
        records = self.records(count)
        data = pa.py_buffer(records.view(np.uint8).tobytes())
        offsets = pa.py_buffer(_offsets(count, records.itemsize))
        return pa.LargeBinaryArray.from_buffers(pa.large_binary(), count, [None, offsets, data])


def sha256_each(offsets: np.ndarray, data: memoryview, start: bytes = b"") -> bytes:
    """The raw sha256 digests (32 bytes each, concatenated) of ``start`` followed by each row's
    bytes ``data[offsets[r]:offsets[r + 1]]``. ``start`` (a header) is hashed once. The whole
    table is hashed in one call of the compiled kernel (``govray/data/_rowdigest.c``) where it was
    built; else by :func:`sha256_each_hashlib`, the same digests row by row."""
    if _rowdigest is not None and len(start) % BLOCK == 0:
        return _rowdigest.sha256_rows(start, np.ascontiguousarray(offsets, dtype=np.int64), data)
    return sha256_each_hashlib(offsets, data, start)


def sha256_each_hashlib(offsets: np.ndarray, data: memoryview, start: bytes = b"") -> bytes:
    """:func:`sha256_each` with hashlib: ``start``'s state copied per row (cheaper than a hash
    constructed per row), one Python call per row."""
    initial = hashlib.sha256(start)
    count = len(offsets) - 1
    digests = []
    if count and np.all(offsets[1:] - offsets[:-1] == offsets[1] - offsets[0]):  # one width: no pairs
        first, width = int(offsets[0]), int(offsets[1] - offsets[0])
        for begin in range(first, first + count * width, width):
            digest = initial.copy()
            digest.update(data[begin : begin + width])
            digests.append(digest.digest())
        return b"".join(digests)
    for begin, end in itertools.pairwise(offsets.tolist()):
        digest = initial.copy()
        digest.update(data[begin:end])
        digests.append(digest.digest())
    return b"".join(digests)


def raw_digests(digests: bytes) -> tuple[pa.FixedSizeBinaryArray, np.ndarray]:
    """Concatenated 32-byte digests as a ``binary(32)`` array (no copy) and their first 64 bits
    (uint64, big-endian). Raw digests sort as their hex digits do."""
    count = len(digests) // 32
    array = pa.FixedSizeBinaryArray.from_buffers(pa.binary(32), count, [None, pa.py_buffer(digests)])
    return array, np.frombuffer(digests, dtype=">u8")[::4].astype(np.uint64)


def hex_digests(digests: bytes) -> tuple[pa.Array, np.ndarray]:
    """Concatenated 32-byte digests as hex strings (a string array) and their first 64 bits
    (uint64, big-endian: the first 16 hex digits)."""
    count = len(digests) // 32
    hexes = binascii.hexlify(digests)
    offsets = np.arange(0, 64 * (count + 1), 64, dtype=np.int32)
    strings = pa.StringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(hexes))
    return strings, np.frombuffer(digests, dtype=">u8")[::4].astype(np.uint64)


def _sized(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def json_value(value: Any) -> Any:
    """A value as JSON can hold it: bytes as hex, mappings and sequences element-wise, anything
    else not a JSON scalar as its string form (both row hash versions encode values so)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)  # dates, decimals, timestamps: their canonical string form


def _encoded(values: pa.Array) -> _Fixed | pa.Array:
    """One column's values encoded: ``_Fixed`` when every value has the same width (fixed-width
    types without nulls), else a large_binary array."""
    kind = values.type
    if pa.types.is_dictionary(kind):
        return _encoded(values.cast(kind.value_type))
    if pa.types.is_null(kind) or values.null_count == len(values):
        return pa.array([b"n"] * len(values), type=pa.large_binary())
    if pa.types.is_boolean(kind):
        return _fixed(ord("b"), _numbers(values, np.uint8), values)
    if pa.types.is_unsigned_integer(kind):
        numbers = _numbers(values.cast(pa.uint64()), np.dtype("<u8"))
        tags = np.where(numbers >= np.uint64(2**63), ord("u"), ord("i")).astype(np.uint8)
        return _fixed(tags, numbers, values)
    if pa.types.is_integer(kind):
        return _fixed(ord("i"), _numbers(values.cast(pa.int64()), np.dtype("<i8")), values)
    if pa.types.is_floating(kind):
        numbers = _numbers(values.cast(pa.float64()), np.dtype("<f8"))
        numbers[np.isnan(numbers)] = math.nan  # one NaN: numpy's is 0x7ff8000000000000
        return _fixed(ord("f"), numbers, values)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return _sized_column(b"s", values.cast(pa.large_string()).cast(pa.large_binary()))
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        return _sized_column(b"y", values.cast(pa.large_binary()))
    return pa.array([encode_value(value) for value in values.to_pylist()], type=pa.large_binary())


def _numbers(values: pa.Array, dtype: np.dtype[Any] | type) -> np.ndarray:
    """The values as a writable numpy array (nulls as zero: their payload is dropped)."""
    return np.array(pc.fill_null(values, False if pa.types.is_boolean(values.type) else 0), dtype=dtype)


def _fixed(tags: np.ndarray | int, payload: np.ndarray, values: pa.Array) -> _Fixed | pa.Array:
    """Tag and payload per row; a null row is the tag ``n`` alone (then a large_binary array)."""
    fixed = _Fixed(((tags, payload),))
    if values.null_count == 0:
        return fixed
    records = fixed.records(len(values)).view(np.uint8).reshape(len(values), -1).copy()
    null = values.is_null().to_numpy(zero_copy_only=False)
    records[null, 0] = ord("n")
    keep = np.ones(records.shape, dtype=bool)
    keep[null, 1:] = False
    offsets = np.concatenate([[0], np.cumsum(np.where(null, 1, records.shape[1]))]).astype(np.int64)
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(records[keep].tobytes())]
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(values), buffers)


def _sized_column(tag: bytes, values: pa.Array) -> pa.Array:
    """``tag + u64(length) + bytes`` per value, ``n`` for a null (values: large_binary)."""
    lengths = _numbers(pc.binary_length(values), np.dtype("<u8"))
    prefix = _fixed(tag[0], lengths, values)
    if isinstance(prefix, _Fixed):
        prefix = prefix.binary(len(values))
    body = pc.fill_null(values, pa.scalar(b"", type=pa.large_binary()))
    return pc.binary_join_element_wise(prefix, body, pa.scalar(b"", type=pa.large_binary()))


def _offsets(count: int, width: int) -> np.ndarray:
    return np.arange(count + 1, dtype=np.int64) * width
