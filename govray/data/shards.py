"""Route-partitioned shards on storage, and the manifest that indexes them.

Layout under ``STORAGE/shards/KEY/`` (KEY digests every input of the ingest, so a changed corpus,
policy or holdout fraction gets new shards and an unchanged one reuses them)::

    manifest.json                      counts, fingerprints, files (no timestamps: re-ingest is identical)
    train/ROUTE/CORPUS-000000.parquet  training rows of one route from one unit of a corpus
    holdout/CORPUS/000000.parquet      held-out rows of one unit (every row of an eval corpus)

A unit is a fixed range of ``ROWS_PER_UNIT`` consecutive corpus rows (``govray.data.units``); each
file holds its rows in row order, in snappy row groups of at most ``ROW_GROUP_ROWS`` rows. The manifest
lists each route's files in shard order (corpus order, then row), each with its rows, sha256,
corpus and first and last corpus row, so a row is found without reading files
(:meth:`ShardSet.locate`) and a reader fetches and verifies only the files it touches
(:meth:`ShardSet.fetch_file`).

Each shard row keeps its source columns plus ``_corpus``, ``_row`` (0-based row number within
the corpus, files in sorted order), ``_row_hash`` (the row's hash of the manifest's
``row_hash_version``: ``govray.data.rowhash``; raw bytes, see format 4), ``_route`` and
``_credential`` (the row's full credential, canonical JSON).

``_corpus``, ``_route`` and ``_credential`` are Arrow dictionary columns (a file's dictionary
holds the values its rows use; the Parquet writer stores them as they are instead of looking up
every row's ~300-byte credential), so a reader gets them back as dictionary arrays, which Arrow's
kernels compare, filter, group and convert (``as_py``) as the strings they encode; ``_row_hash`` is
the digest's 32 raw bytes (``binary(32)``), which sort as their hex digits do (every answer govray
gives shows the hex).

The manifest records the shard format (``format_version``: ``SHARD_FORMAT_VERSION``, 4, the
numbering going on from the pre-release ones) and the row hash's version; the format is part of the
shards' key. A manifest of any other format or row hash is refused: ingest again.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from govray.core.canonical import file_sha256
from govray.core.errors import IngestError, describe_validation_error
from govray.core.storage import Storage
from govray.data.rowhash import ROW_HASH_VERSION

MANIFEST = "manifest.json"
SHARD_FORMAT_VERSION = 4


class ShardFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str  # relative to the shard directory
    rows: int
    sha256: str
    # Format 2: the corpus of every row of the file, and the corpus row numbers it spans
    # (inclusive; the file holds some of the rows between them, in order). None in format 1.
    corpus: str | None = None
    first_row: int | None = None
    last_row: int | None = None


class CorpusSummary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus_id: str
    role: str
    format: str
    fingerprint: str
    files: list[str]
    rows: int
    train_rows: int
    holdout_rows: int
    route_counts: dict[str, int]  # training rows per route
    credential: dict[str, object]  # the corpus-level credential
    credential_columns: dict[str, str]


class RouteSummary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    route: str
    rows: int
    corpus_counts: dict[str, int]
    files: list[ShardFile]


class ShardManifest(BaseModel):
    """Everything the schedule and the ledger need to know about the ingested data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = SHARD_FORMAT_VERSION
    key: str
    policy_name: str
    policy_version: int
    policy_digest: str
    holdout_fraction: float
    row_hash_version: int  # how ``_row_hash`` and the holdout split were computed (govray.data.rowhash)
    corpora: list[CorpusSummary]
    routes: list[RouteSummary]  # in policy order; routes with no rows are listed with rows=0
    holdout: dict[str, list[ShardFile]] = Field(default_factory=dict)  # corpus → files

    def route(self, key: str) -> RouteSummary:
        for route in self.routes:
            if route.route == key:
                return route
        raise IngestError(f"shards {self.key} have no route '{key}'")

    def corpus(self, corpus_id: str) -> CorpusSummary:
        for corpus in self.corpora:
            if corpus.corpus_id == corpus_id:
                return corpus
        raise IngestError(f"shards {self.key} have no corpus '{corpus_id}'")

    @model_validator(mode="before")
    @classmethod
    def _one_format(cls, data: Any) -> Any:
        """The versions first, so that a manifest of another format is refused as such, not for
        the fields it lacks."""
        if not isinstance(data, dict):
            return data
        found = data.get("format_version", SHARD_FORMAT_VERSION)
        if found != SHARD_FORMAT_VERSION:
            raise ValueError(
                f"shard format {found!r} is not the one this govray reads ({SHARD_FORMAT_VERSION}): "
                "ingest the corpora again"
            )
        hashed = data.get("row_hash_version")
        if hashed != ROW_HASH_VERSION:
            said = (
                "no row hash version (shards from before govray 1.0)"
                if hashed is None
                else (f"row hash version {hashed!r}")
            )
            raise ValueError(
                f"{said}: this govray computes row hash version {ROW_HASH_VERSION}; ingest the corpora again"
            )
        return data

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


_Split = Literal["train", "holdout"]


@dataclass(frozen=True)
class RowLocation:
    """Where an ingest put one corpus row.

    ``position`` is route-local in the training split (the index into the route's rows in shard
    order: what the schedule's slots list) and an index into the corpus's held-out rows in the
    holdout; ``file`` and ``index`` are the shard file that holds the row and its place there."""

    split: _Split
    route: str | None  # None in the holdout
    position: int
    file: ShardFile
    index: int


@dataclass(frozen=True)
class _FileSpans:
    """One route's (or one corpus's held-out) files, searchable by (corpus order, first row)."""

    files: tuple[ShardFile, ...]
    starts: tuple[tuple[int, int], ...]  # (corpus order, first row) of each file
    offsets: tuple[int, ...]  # rows of the earlier files

    @classmethod
    def of(cls, files: Sequence[ShardFile], order: dict[str, int]) -> _FileSpans:
        starts = []
        for file in files:
            if file.corpus is None or file.first_row is None:
                raise IngestError(f"shard file {file.path} names no corpus or first row")
            starts.append((order[file.corpus], file.first_row))
        offsets = tuple(accumulate((file.rows for file in files), initial=0))[:-1]
        return cls(tuple(files), tuple(starts), offsets)

    def covering(self, corpus_order: int, row: int) -> tuple[ShardFile, int] | None:
        """The one file whose row span holds ``row`` of the corpus, and its rows' offset."""
        index = bisect_right(self.starts, (corpus_order, row)) - 1
        if index < 0 or self.starts[index][0] != corpus_order:
            return None
        file = self.files[index]
        assert file.last_row is not None
        return (file, self.offsets[index]) if row <= file.last_row else None


class ShardSet:
    """Read access to one ingest's shards.

    Example::

        shards = ShardSet.open(root)
        where = shards.locate("news-2024", 17)   # RowLocation(split="train", route="public", ...)
    """

    def __init__(self, root: Path, manifest: ShardManifest) -> None:
        self.root = root
        self.manifest = manifest
        self._spans: dict[tuple[_Split, str], _FileSpans] | None = None

    @classmethod
    def open(cls, root: Path, *, verify: bool = False) -> ShardSet:
        path = root / MANIFEST
        try:
            manifest = ShardManifest.model_validate_json(path.read_text())
        except OSError as error:
            raise IngestError(f"no shard manifest at {path}: {error.strerror}") from None
        except ValidationError as error:
            raise IngestError(f"shard manifest {path}: {describe_validation_error(error)}") from None
        shards = cls(root, manifest)
        if verify:
            shards.verify()
        return shards

    @classmethod
    def fetch_manifest(cls, root: Path, storage: Storage, sha256: str) -> ShardSet:
        """The shard set at ``root``, its manifest fetched from ``storage`` when this node lacks it
        and checked against ``sha256``, the digest the run recorded in its signed run.json. Its
        files are fetched and checked one at a time, when read (``ShardReader``)."""
        path = root / MANIFEST

        def check(candidate: Path) -> None:
            if file_sha256(candidate) != sha256:
                raise IngestError(f"shard manifest {path} does not match the digest the run recorded")

        storage.fetch(path, verify=check)
        shards = cls.open(root)
        check(path)
        return shards

    def files(self) -> list[ShardFile]:
        """Every shard file: each route's in shard order, then each corpus's held-out files."""
        files = [file for route in self.manifest.routes for file in route.files]
        return files + [file for group in self.manifest.holdout.values() for file in group]

    def verify(self) -> None:
        """Check every shard file's digest against the manifest."""
        for file in self.files():
            self.verify_file(file)

    def verify_file(self, file: ShardFile, path: Path | None = None) -> None:
        """Check one shard file (at ``path``, by default where it lies) against its manifest digest."""
        path = path or self.root / file.path
        if not path.exists():
            raise IngestError(f"shard file {path} listed in the manifest is missing")
        if file_sha256(path) != file.sha256:
            raise IngestError(f"shard file {path} does not match its digest in the manifest")

    def fetch_file(self, file: ShardFile, storage: Storage) -> Path:
        """The local path of one shard file, downloaded from ``storage`` when this node lacks it;
        checked against its digest."""
        path = self.root / file.path
        storage.fetch(path, verify=lambda staged: self.verify_file(file, staged))
        self.verify_file(file, path)
        return path

    def locate(self, corpus_id: str, row: int) -> RowLocation:
        """Where row ``row`` (0-based, as ingested) of ``corpus_id`` lies: its split, route and
        route-local position, and the file that holds it.

        Bisects the manifest's files to the one file per route (and holdout) whose row span holds
        the row, and reads one row group of ``_row`` from each until it is found."""
        rows = self.manifest.corpus(corpus_id).rows
        if not 0 <= row < rows:
            raise IngestError(
                f"corpus '{corpus_id}' has {rows} rows (0..{rows - 1}) in shards {self.manifest.key}; "
                f"there is no row {row}"
            )
        order = [corpus.corpus_id for corpus in self.manifest.corpora].index(corpus_id)
        for (split, name), spans in self._file_spans().items():
            covering = spans.covering(order, row)
            index = self._index_in_file(covering[0], row) if covering else None
            if covering and index is not None:
                route = name if split == "train" else None
                return RowLocation(split, route, covering[1] + index, covering[0], index)
        raise IngestError(
            f"shards {self.manifest.key}: row {row} of corpus '{corpus_id}' is in none of their files"
        )

    def _file_spans(self) -> dict[tuple[_Split, str], _FileSpans]:
        """Per route (``("train", ROUTE)``) and held-out corpus (``("holdout", CORPUS)``): computed
        once per shard set."""
        if self._spans is None:
            order = {corpus.corpus_id: index for index, corpus in enumerate(self.manifest.corpora)}
            spans: dict[tuple[_Split, str], _FileSpans] = {
                ("train", route.route): _FileSpans.of(route.files, order) for route in self.manifest.routes
            }
            for corpus, files in self.manifest.holdout.items():
                spans["holdout", corpus] = _FileSpans.of(files, order)
            self._spans = spans
        return self._spans

    def _index_in_file(self, file: ShardFile, row: int) -> int | None:
        """The index of corpus row ``row`` in ``file`` (rows ascend), reading one row group."""
        parquet = pq.ParquetFile(self.root / file.path)
        metadata = parquet.metadata
        leaves = [parquet.schema.column(i).path for i in range(metadata.num_columns)]
        column = leaves.index("_row")  # a leaf index: source columns may nest
        start = 0
        for group in range(metadata.num_row_groups):
            size = metadata.row_group(group).num_rows
            statistics = metadata.row_group(group).column(column).statistics
            if statistics is None or not statistics.has_min_max or statistics.min <= row <= statistics.max:
                numbers = parquet.read_row_group(group, columns=["_row"]).column("_row").to_numpy()
                found = int(np.searchsorted(numbers, row))
                if found < len(numbers) and numbers[found] == row:
                    return start + found
            start += size
        return None

    def route_table(self, route: str, columns: Sequence[str] | None = None) -> pa.Table:
        """All training rows of ``route``, in shard order."""
        return self._read(self.manifest.route(route).files, columns)

    def holdout_table(self, corpus_id: str, columns: Sequence[str] | None = None) -> pa.Table:
        if corpus_id not in self.manifest.holdout:
            raise IngestError(f"shards {self.manifest.key} hold no holdout rows of corpus '{corpus_id}'")
        return self._read(self.manifest.holdout[corpus_id], columns)

    def _read(self, files: Sequence[ShardFile], columns: Sequence[str] | None) -> pa.Table:
        tables = [
            pq.read_table(self.root / file.path, columns=list(columns) if columns else None) for file in files
        ]
        if not tables:
            raise IngestError(f"shards {self.manifest.key}: nothing to read")
        # Files of different corpora (or units) may differ in columns or inferred types, and each
        # file has its own dictionaries (format 4): one per column here, as Arrow's grouping needs.
        return pa.concat_tables(tables, promote_options="permissive").unify_dictionaries()
