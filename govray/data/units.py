"""Ingest units: fixed ranges of consecutive corpus rows, each annotated and written by one Ray task.

Unit ``u`` of a corpus holds its rows ``u * ROWS_PER_UNIT`` up to the next unit's first row, however
Ray Data happened to split the corpus into blocks (that depends on the cluster's CPUs), so the
shards are the same bytes on any cluster. A block inside one unit goes to that unit's task as it
is; a block that straddles units is cut by one task (:func:`split_block`) into the pieces each
unit needs. No task holds more than one block or one unit of rows.

The unit task (:func:`write_unit`) numbers, validates, routes, hashes and splits its rows, and
writes one file per route with rows in the unit (``train/ROUTE/CORPUS-UUUUUU.parquet``) and one
for its held-out rows (``holdout/CORPUS/UUUUUU.parquet``), in row order; on the first bad row it
writes nothing and returns the refusal (ingest then deletes what the other units wrote).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from govray.config.data import CorpusRole, CorpusSpec
from govray.core.canonical import canonical_json
from govray.core.errors import CredentialError, PolicyError
from govray.data.rowhash import holdout_mask, row_digests
from govray.data.shards import ShardFile
from govray.governance.credentials import build_credential
from govray.governance.policy import DepthPolicy

ROWS_PER_UNIT = 65_536  # rows per unit: each route file holds at most this many
# Small row groups: a reader fetches a row by position, decoding its row group, not the file. At
# most ROW_GROUP_ROWS rows and about ROW_GROUP_BYTES (wide rows: fewer; never below 16 rows).
ROW_GROUP_ROWS = 1024
ROW_GROUP_BYTES = 1 << 20
GROUPS_PER_FILE = 64  # a unit's rows of one route fill files of at most this many row groups
HOLDOUT = "__holdout__"  # the _route value of rows not used for training
# Columns of few distinct values, dictionary-encoded in the files (with the credential columns).
# Format 4: these three are Arrow dictionary columns already (``repeated``, ``coded``), which the
# Parquet writer stores as they are instead of hashing every row's value (a credential's JSON,
# ~300 bytes) to find its entry; a reader gets them back as dictionary columns.
DICTIONARY_COLUMNS = ("_corpus", "_route", "_credential")


def group_rows(rows: pa.Table) -> int:
    """Rows per row group for ``rows``: as many as fit ``ROW_GROUP_BYTES`` decoded (a function of
    the data alone, so a re-ingest writes the same bytes), within [16, ``ROW_GROUP_ROWS``]."""
    width = max(1, rows.nbytes // max(1, rows.num_rows))
    return max(16, min(ROW_GROUP_ROWS, ROW_GROUP_BYTES // width))


def unit_pieces(sizes: Sequence[int], unit_rows: int = ROWS_PER_UNIT) -> list[list[tuple[int, int, int]]]:
    """For each unit of a corpus whose blocks hold ``sizes`` rows, the ``(block, start, stop)``
    slices of the blocks that hold its rows, in row order.

    >>> unit_pieces([3, 5], unit_rows=4)
    [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)]]
    """
    units: list[list[tuple[int, int, int]]] = []
    offset = 0
    for block, size in enumerate(sizes):
        start = 0
        while start < size:
            unit = (offset + start) // unit_rows
            stop = min(size, (unit + 1) * unit_rows - offset)
            if unit == len(units):
                units.append([])
            units[unit].append((block, start, stop))
            start = stop
        offset += size
    return units


@ray.remote
def split_block(block: pa.Table, bounds: list[tuple[int, int]]) -> pa.Table | tuple[pa.Table, ...]:
    """The ``[start, stop)`` slices of one block (Ray ships a slice's rows only, not the block)."""
    pieces = tuple(block.slice(start, stop - start) for start, stop in bounds)
    return pieces[0] if len(pieces) == 1 else pieces


@dataclass(frozen=True)
class UnitJob:
    """What one unit task needs besides its rows."""

    spec_json: str  # the CorpusSpec
    policy_json: str  # the DepthPolicy
    holdout_fraction: float
    unit: int
    first_row: int  # the corpus row number of the unit's first row
    directory: str  # the staging directory of the shards


@dataclass(frozen=True)
class RowRefusal:
    """A unit's first bad row: the message, the error class it maps to, and the 0-based corpus row
    (None when the corpus lacks a credential column altogether)."""

    message: str
    kind: Literal["credential", "policy"]
    row: int | None


@dataclass(frozen=True)
class UnitReport:
    """What a unit task did: the rows it received, its rows per route (``HOLDOUT`` for held-out
    rows) and the file it wrote for each, or the refusal of its first bad row (then no files)."""

    received_rows: int
    counts: dict[str, int] = field(default_factory=dict)
    files: dict[str, list[ShardFile]] = field(default_factory=dict)  # per route, in row order
    refusal: RowRefusal | None = None


def unit_file(route: str, corpus_id: str, unit: int, part: int = 0, parts: int = 1) -> str:
    """The path of a unit's file of ``route`` (``HOLDOUT``: its held-out rows), relative to the
    shards; a unit of wide rows fills several (``part`` of ``parts``)."""
    suffix = f"-{part:02d}" if parts > 1 else ""
    if route == HOLDOUT:
        return f"holdout/{corpus_id}/{unit:06d}{suffix}.parquet"
    return f"train/{route}/{corpus_id}-{unit:06d}{suffix}.parquet"


@ray.remote
def write_unit(job: UnitJob, *pieces: pa.Table) -> UnitReport:
    """Annotate the unit's rows (``pieces``, in row order) and write its files under ``job.directory``."""
    # Without schema metadata (pandas' notes, from a Parquet file): shards hold rows.
    table = (
        pa.concat_tables(pieces, promote_options="permissive").combine_chunks().replace_schema_metadata(None)
    )
    spec = CorpusSpec.model_validate_json(job.spec_json)
    policy = DepthPolicy.model_validate_json(job.policy_json)
    annotated = annotate(table, job.first_row, spec, policy, job.holdout_fraction)
    if isinstance(annotated, RowRefusal):
        return UnitReport(received_rows=table.num_rows, refusal=annotated)
    counts: dict[str, int] = {}
    files: dict[str, list[ShardFile]] = {}
    for route in annotated.routes():
        rows = annotated.of_route(route)
        counts[route] = rows.num_rows
        group = group_rows(rows)
        per_file = group * GROUPS_PER_FILE  # a footer a reader keeps open stays small
        parts = range(0, rows.num_rows, per_file)
        files[route] = [
            _write(
                rows.slice(start, per_file),
                group,
                job,
                unit_file(route, spec.id, job.unit, part, len(parts)),
                [*DICTIONARY_COLUMNS, *spec.credential_columns.values()],
            )
            for part, start in enumerate(parts)
        ]
    return UnitReport(received_rows=table.num_rows, counts=counts, files=files)


def _write(rows: pa.Table, group: int, job: UnitJob, relative: str, dictionary: list[str]) -> ShardFile:
    path = Path(job.directory) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    # Statistics of _row only: a reader finds a row's row group from the footer. Snappy (but not
    # for the row hashes: _compression), and dictionaries only for the columns that repeat a few
    # values: ingest writes every row.
    # The file is laid out in memory and hashed there: not read back to be digested.
    sink = pa.BufferOutputStream()
    pq.write_table(
        rows,
        sink,
        compression=_compression(rows.schema),
        row_group_size=group,
        write_statistics=["_row"],
        use_dictionary=dictionary,
    )
    laid_out = sink.getvalue()
    path.write_bytes(laid_out)
    numbers = rows["_row"]
    return ShardFile(
        path=relative,
        rows=rows.num_rows,
        sha256=hashlib.sha256(laid_out).hexdigest(),
        corpus=str(rows["_corpus"][0].as_py()),
        first_row=numbers[0].as_py(),
        last_row=numbers[-1].as_py(),
    )


def _compression(schema: pa.Schema) -> str | dict[str, str]:
    """Snappy, but not for ``_row_hash`` (uniform bytes: snappy spends time and saves nothing on
    it). Per-column codecs are keyed by leaf column paths, which a nested column's
    name is not (``s.x``, ``l.list.element``), so a table with nested columns keeps snappy
    everywhere."""
    if any(pa.types.is_nested(field.type) for field in schema):
        return "snappy"
    return {name: "none" if name == "_row_hash" else "snappy" for name in schema.names}


@dataclass(frozen=True)
class Annotated:
    """A unit's rows annotated: the table with ``_corpus``, ``_row`` and ``_row_hash`` added, and
    per row its route and credential as indices (``route_of_row`` into ``route_names``,
    ``credential_of_row`` into ``credentials``). The ``_route`` and ``_credential`` dictionary
    columns are built per route after the rows are split (:meth:`of_route`), each with the values
    its rows use."""

    table: pa.Table
    route_names: list[str]
    route_of_row: np.ndarray
    credentials: pa.Array
    credential_of_row: np.ndarray

    def routes(self) -> list[str]:
        """The routes the rows take, in the order of their first row."""
        present, first = np.unique(self.route_of_row, return_index=True)
        return [self.route_names[code] for code in present[np.argsort(first, kind="stable")].tolist()]

    def of_route(self, route: str) -> pa.Table:
        """The rows of ``route`` in row order, with their ``_route`` and ``_credential`` columns:
        one chunk, so its byte size (hence its row groups) does not depend on how blocks were cut."""
        mask = self.route_of_row == self.route_names.index(route)
        # Filtered even when every row takes the route: fresh buffers, so the byte size that
        # decides the row groups does not depend on how the unit's blocks were cut.
        rows = self.table.filter(pa.array(mask))
        return (
            rows.append_column("_route", repeated(route, rows.num_rows))
            .append_column("_credential", coded(self.credentials, self.credential_of_row[mask]))
            .combine_chunks()
        )

    def whole(self) -> pa.Table:
        """Every row with its ``_route`` and ``_credential`` columns, in row order."""
        names = pa.array(self.route_names, type=pa.string())
        return self.table.append_column("_route", coded(names, self.route_of_row)).append_column(
            "_credential", coded(self.credentials, self.credential_of_row)
        )


def repeated(value: str, count: int) -> pa.DictionaryArray:
    """``value`` on ``count`` rows as a dictionary column: one entry, int32 indices."""
    return coded(pa.array([value], type=pa.string()), np.zeros(count, dtype=np.int64))


def coded(values: pa.Array, codes: np.ndarray) -> pa.DictionaryArray:
    """``values[codes]`` as a dictionary column whose dictionary holds only the values used, in
    the order of ``values`` (a function of the rows alone: the same rows, the same bytes)."""
    used = np.flatnonzero(np.bincount(codes, minlength=len(values)))
    index = np.zeros(len(values), dtype=np.int32)
    index[used] = np.arange(len(used), dtype=np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(index[codes]), values.take(pa.array(used)))


def annotate(
    table: pa.Table,
    first_row: int,
    spec: CorpusSpec,
    policy: DepthPolicy,
    holdout_fraction: float,
) -> Annotated | RowRefusal:
    """Number, validate, route, hash and split the rows of ``table``
    (corpus rows from ``first_row``): the rows with the shard columns, each row's route and
    credential kept as indices (``Annotated``; ``whole()`` builds every column), or the refusal of
    its first bad row.

    A credential is built and routed once per distinct combination of the corpus's credential
    columns, in the order the combinations first occur, so the first refusal is that of the
    first bad row; the rows are hashed a table at a time (``govray.data.rowhash``)."""
    missing = [column for column in spec.credential_columns.values() if column not in table.column_names]
    if missing:
        return RowRefusal(
            f"corpus '{spec.id}': credential column(s) {', '.join(missing)} not in the data "
            f"(its columns: {', '.join(table.column_names)})",
            "credential",
            None,
        )
    count = table.num_rows
    combinations, of_row, first_rows = _combinations(table, list(spec.credential_columns.values()))
    routes, credentials = [], []
    for values, first in zip(combinations, first_rows.tolist(), strict=True):
        resolved = _resolve(spec, policy, values, first_row + first)
        if isinstance(resolved, RowRefusal):
            return resolved
        routes.append(resolved[0])
        credentials.append(resolved[1])
    hashes, prefixes = row_digests(table)
    route_names = list(dict.fromkeys(routes))
    route_of_row = np.array([route_names.index(route) for route in routes], dtype=np.int64)[of_row]
    if spec.role == CorpusRole.TRAIN:
        if HOLDOUT not in route_names:
            route_names.append(HOLDOUT)
        held_out = holdout_mask(prefixes, holdout_fraction)
        route_of_row = np.where(held_out, route_names.index(HOLDOUT), route_of_row)
    rows = (
        table.append_column("_corpus", repeated(spec.id, count))
        .append_column("_row", pa.array(np.arange(first_row, first_row + count, dtype=np.int64)))
        .append_column("_row_hash", hashes)
    )
    return Annotated(rows, route_names, route_of_row, pa.array(credentials, type=pa.string()), of_row)


def _combinations(
    table: pa.Table, columns: list[str]
) -> tuple[list[tuple[Any, ...]], np.ndarray, np.ndarray]:
    """The distinct value combinations of ``columns`` in the order they first occur, each row's
    combination (an index into them) and each combination's first row."""
    count = table.num_rows
    if not columns:
        return [()], np.zeros(count, dtype=np.int64), np.zeros(1, dtype=np.int64)
    codes, dictionaries = [], []
    for column in columns:
        encoded = table[column].combine_chunks().dictionary_encode(null_encoding="encode")
        codes.append(encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64))
        dictionaries.append(encoded.dictionary.to_pylist())
    _, first_rows, of_row = np.unique(np.stack(codes, axis=1), axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first_rows, kind="stable")  # by first occurrence
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    combinations = [
        tuple(dictionary[code[row]] for dictionary, code in zip(dictionaries, codes, strict=True))
        for row in first_rows[order].tolist()
    ]
    return combinations, rank[of_row.reshape(-1)], first_rows[order]


def _resolve(
    spec: CorpusSpec, policy: DepthPolicy, values: tuple[Any, ...], number: int
) -> tuple[str, str] | RowRefusal:
    """The route and the canonical credential JSON of rows with these credential-column
    ``values``, or the refusal of row ``number``, the first such row."""
    overrides = dict(zip(spec.credential_columns, values, strict=True))
    for name, column in spec.credential_columns.items():
        if overrides[name] is None:
            return RowRefusal(
                f"corpus '{spec.id}' row {number}: credential field '{name}' (column '{column}') is empty",
                "credential",
                number,
            )
    try:
        credential = build_credential(
            {**spec.base_credential(), **overrides}, where=f"corpus '{spec.id}' row {number}"
        )
        train = spec.role == CorpusRole.TRAIN
        route = policy.route_key_for(credential, where=f" (row {number})") if train else HOLDOUT
    except CredentialError as error:
        return RowRefusal(str(error), "credential", number)
    except PolicyError as error:
        return RowRefusal(str(error), "policy", number)
    return route, canonical_json(credential.model_dump(mode="json")).decode()
