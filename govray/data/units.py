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

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray

from govray.config.experiment import CorpusRole, CorpusSpec
from govray.core.canonical import canonical_json, file_sha256, sha256_hex
from govray.core.errors import CredentialError, PolicyError
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


def group_rows(rows: pa.Table) -> int:
    """Rows per row group for ``rows``: as many as fit ``ROW_GROUP_BYTES`` decoded (a function of
    the data alone, so a re-ingest writes the same bytes), within [16, ``ROW_GROUP_ROWS``]."""
    width = max(1, rows.nbytes // max(1, rows.num_rows))
    return max(16, min(ROW_GROUP_ROWS, ROW_GROUP_BYTES // width))


def _json_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)  # dates, decimals: their canonical string form


_SCALARS = frozenset({str, int, float, bool, type(None)})  # JSON values as they are


def row_hash(row: dict[str, Any]) -> str:
    """sha256 of the row's canonical JSON (source columns only)."""
    # _json_value(row), without a call per scalar (most values are): ingest hashes every row.
    values = {str(k): v if type(v) in _SCALARS else _json_value(v) for k, v in row.items()}
    return sha256_hex(canonical_json(values))


def in_holdout(digest: str, fraction: float) -> bool:
    """Deterministic split: the first 64 bits of the row hash as a fraction of 2**64."""
    return int(digest[:16], 16) < fraction * 2**64


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
    table = pa.concat_tables(pieces, promote_options="permissive").combine_chunks()
    spec = CorpusSpec.model_validate_json(job.spec_json)
    policy = DepthPolicy.model_validate_json(job.policy_json)
    annotated = annotate(table, job.first_row, spec, policy, job.holdout_fraction)
    if isinstance(annotated, RowRefusal):
        return UnitReport(received_rows=table.num_rows, refusal=annotated)
    counts: dict[str, int] = {}
    files: dict[str, list[ShardFile]] = {}
    for route in pc.unique(annotated["_route"]).to_pylist():
        # One chunk: its byte size (hence its row groups) does not depend on how blocks were cut.
        rows = annotated.filter(pc.equal(annotated["_route"], route)).combine_chunks()
        counts[route] = rows.num_rows
        group = group_rows(rows)
        per_file = group * GROUPS_PER_FILE  # a footer a reader keeps open stays small
        parts = range(0, rows.num_rows, per_file)
        files[route] = [
            _write(
                rows.slice(start, per_file), group, job, unit_file(route, spec.id, job.unit, part, len(parts))
            )
            for part, start in enumerate(parts)
        ]
    return UnitReport(received_rows=table.num_rows, counts=counts, files=files)


def _write(rows: pa.Table, group: int, job: UnitJob, relative: str) -> ShardFile:
    path = Path(job.directory) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    # Statistics of _row only: a reader finds a row's row group from the footer.
    pq.write_table(rows, path, compression="zstd", row_group_size=group, write_statistics=["_row"])
    numbers = rows["_row"]
    return ShardFile(
        path=relative,
        rows=rows.num_rows,
        sha256=file_sha256(path),
        corpus=str(rows["_corpus"][0].as_py()),
        first_row=numbers[0].as_py(),
        last_row=numbers[-1].as_py(),
    )


def annotate(
    table: pa.Table, first_row: int, spec: CorpusSpec, policy: DepthPolicy, holdout_fraction: float
) -> pa.Table | RowRefusal:
    """Number, validate, route, hash and split the rows of ``table`` (corpus rows from
    ``first_row``): the table with the shard columns added, or the refusal of its first bad row."""
    base = spec.base_credential()
    missing = [column for column in spec.credential_columns.values() if column not in table.column_names]
    if missing:
        return RowRefusal(
            f"corpus '{spec.id}': credential column(s) {', '.join(missing)} not in the data "
            f"(its columns: {', '.join(table.column_names)})",
            "credential",
            None,
        )
    cache: dict[tuple[Any, ...], tuple[str, str]] = {}
    routes, hashes, credentials = [], [], []
    for index, row in enumerate(table.to_pylist()):
        number = first_row + index
        overrides = tuple(row[column] for column in spec.credential_columns.values())
        if overrides not in cache:
            for name, column in spec.credential_columns.items():
                if row[column] is None:
                    return RowRefusal(
                        f"corpus '{spec.id}' row {number}: credential field '{name}' (column '{column}') "
                        "is empty",
                        "credential",
                        number,
                    )
            values = {**base, **{f: row[c] for f, c in spec.credential_columns.items()}}
            try:
                credential = build_credential(values, where=f"corpus '{spec.id}' row {number}")
                route = (
                    policy.route_key_for(credential, where=f" (row {number})")
                    if spec.role == CorpusRole.TRAIN
                    else HOLDOUT
                )
            except (CredentialError, PolicyError) as error:
                kind: Literal["credential", "policy"] = (
                    "credential" if isinstance(error, CredentialError) else "policy"
                )
                return RowRefusal(str(error), kind, number)
            cache[overrides] = (route, canonical_json(credential.model_dump(mode="json")).decode())
        route, credential_text = cache[overrides]
        digest = row_hash(row)
        if spec.role != CorpusRole.TRAIN or in_holdout(digest, holdout_fraction):
            route = HOLDOUT
        routes.append(route)
        hashes.append(digest)
        credentials.append(credential_text)
    return (
        table.append_column("_corpus", pa.array([spec.id] * table.num_rows, type=pa.string()))
        .append_column("_row", pa.array(range(first_row, first_row + table.num_rows), type=pa.int64()))
        .append_column("_row_hash", pa.array(hashes, type=pa.string()))
        .append_column("_route", pa.array(routes, type=pa.string()))
        .append_column("_credential", pa.array(credentials, type=pa.string()))
    )
