"""Random access to shard rows by position: a worker reads only the row groups its slots touch.

A route's rows (``shards/train/ROUTE``), or a corpus's held-out rows, are the concatenation of
its files in manifest order. Position ``p`` lies in the file whose cumulative row range holds it,
in one of that file's row groups (small: ingest writes them for random access). A request reads
each row group it touches once, keeps it in a cache bounded in bytes, and gathers its rows in the
requested order. Each file is fetched from object storage when this node lacks it and checked
against its digest in the shard manifest before its first read; a file no request touches is
never fetched nor read. Memory is the cache, the open files' footers and one array of cumulative
row counts per route — it does not grow with the corpus's rows.

The schedule decides the positions (``govray.data.schedule``); the worker's prefetcher calls
``take`` one step ahead in a background thread, so reads overlap the step (a lock keeps the cache
and the open files consistent between that thread and the one evaluating).

Example::

    reader = ShardReader(ShardSet.open(root))
    batch = reader.take("public", np.array([17, 3, 912]))      # three rows, in that order
    for start, part in reader.scan(reader.holdout_files("writers"), columns=["_row_hash"]):
        ...                                                     # one row group at a time
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from govray.core.errors import IngestError
from govray.core.storage import IN_PLACE, Storage
from govray.data.shards import ShardFile, ShardSet

CACHE_BYTES = 64 << 20  # decoded row groups kept per reader
OPEN_FILES = 8  # parquet footers kept open per reader (each: its row groups' metadata)


@dataclass(frozen=True)
class FileRun:
    """The files of one route or holdout, and where each starts in their concatenation."""

    files: tuple[ShardFile, ...]
    starts: np.ndarray  # starts[i]: position of file i's first row; starts[-1]: the row count

    @classmethod
    def of(cls, files: Sequence[ShardFile]) -> FileRun:
        counts = np.array([0] + [file.rows for file in files], dtype=np.int64)
        return cls(tuple(files), np.cumsum(counts))

    @property
    def rows(self) -> int:
        return int(self.starts[-1])


class ShardReader:
    """Reads rows of one shard set by route-local position (see the module docstring)."""

    def __init__(self, shards: ShardSet, storage: Storage = IN_PLACE, cache_bytes: int = CACHE_BYTES) -> None:
        self.shards = shards
        self._storage = storage
        self._cache_bytes = cache_bytes
        self._runs: dict[str, FileRun] = {
            route.route: FileRun.of(route.files) for route in shards.manifest.routes
        }
        self._held: dict[str, FileRun] = {
            corpus: FileRun.of(files) for corpus, files in shards.manifest.holdout.items()
        }
        self._groups: OrderedDict[tuple[str, int], pa.Table] = OrderedDict()
        self._cached = 0
        self._open: OrderedDict[str, tuple[pq.ParquetFile, np.ndarray]] = OrderedDict()
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        self.schema = self._first_schema()

    # -- what there is ------------------------------------------------------------------------------

    def route_files(self, route: str) -> FileRun:
        if route not in self._runs:
            raise IngestError(f"shards {self.shards.manifest.key} have no route '{route}'")
        return self._runs[route]

    def holdout_files(self, corpus_id: str) -> FileRun:
        if corpus_id not in self._held:
            raise IngestError(
                f"shards {self.shards.manifest.key} hold no holdout rows of corpus '{corpus_id}'"
            )
        return self._held[corpus_id]

    def empty(self) -> pa.Table:
        """No rows, with the shards' columns."""
        return self.schema.empty_table()

    # -- reading ------------------------------------------------------------------------------------

    def take(self, route: str, positions: Sequence[int] | np.ndarray) -> pa.Table:
        """The training rows of ``route`` at ``positions`` (route-local), in that order."""
        return self.take_from(self.route_files(route), positions)

    def take_from(
        self, run: FileRun, positions: Sequence[int] | np.ndarray, columns: Sequence[str] | None = None
    ) -> pa.Table:
        """Rows of ``run`` at ``positions``, in that order (repeats allowed)."""
        wanted = np.asarray(positions, dtype=np.int64)
        if not len(wanted):
            return self.empty() if columns is None else self.empty().select(list(columns))
        if wanted.min() < 0 or wanted.max() >= run.rows:
            raise IngestError(f"row position {int(wanted.max())} outside the {run.rows} rows read")
        file_of = np.searchsorted(run.starts, wanted, side="right") - 1
        pieces: list[pa.Table] = []
        order: list[np.ndarray] = []  # the requested indexes each piece holds, in piece order
        with self._lock:
            for index in np.unique(file_of).tolist():
                chosen = np.flatnonzero(file_of == index)
                local = wanted[chosen] - run.starts[index]
                parquet, ends = self._file(run.files[index])
                group_of = np.searchsorted(ends, local, side="right") - 1
                for group in np.unique(group_of).tolist():
                    inside = group_of == group
                    table = self._group(run.files[index], parquet, group, columns)
                    start = ends[group]
                    pieces.append(table.take(pa.array(local[inside] - start, type=pa.int64())))
                    order.append(chosen[inside])
        # Files of different corpora may hold different source columns: missing ones come back null.
        gathered = pa.concat_tables(pieces, promote_options="permissive") if len(pieces) > 1 else pieces[0]
        back = np.empty(len(wanted), dtype=np.int64)
        back[np.concatenate(order)] = np.arange(len(wanted), dtype=np.int64)
        return gathered.take(pa.array(back, type=pa.int64()))

    def scan(
        self, run: FileRun, columns: Sequence[str] | None = None, corpus: str | None = None
    ) -> Iterator[tuple[int, pa.Table]]:
        """Every row of ``run`` in order, one row group at a time (bounded memory; not cached), with
        the position of its first row; ``corpus``: only files that may hold its rows (a format-2
        file names its one corpus)."""
        for index, file in enumerate(run.files):
            if corpus is not None and file.corpus is not None and file.corpus != corpus:
                continue
            with self._lock:
                parquet, ends = self._file(file)
            for group in range(len(ends) - 1):
                with self._lock:
                    table = parquet.read_row_group(group, columns=list(columns) if columns else None)
                yield int(run.starts[index] + ends[group]), table

    # -- files --------------------------------------------------------------------------------------

    def _file(self, file: ShardFile) -> tuple[pq.ParquetFile, np.ndarray]:
        """An open file and its row groups' starts (the last entry: its row count)."""
        if file.path in self._open:
            self._open.move_to_end(file.path)
            return self._open[file.path]
        path = self._local(file)
        parquet = pq.ParquetFile(path)
        sizes = [parquet.metadata.row_group(i).num_rows for i in range(parquet.metadata.num_row_groups)]
        ends = np.cumsum(np.array([0, *sizes], dtype=np.int64))
        if int(ends[-1]) != file.rows:
            raise IngestError(f"shard file {path} holds {int(ends[-1])} rows; the manifest says {file.rows}")
        self._open[file.path] = (parquet, ends)
        while len(self._open) > OPEN_FILES:
            _, (closing, _) = self._open.popitem(last=False)
            closing.close()
        return parquet, ends

    def _local(self, file: ShardFile) -> Path:
        """``file`` on this node, fetched when missing, checked against its digest once."""
        if file.path not in self._verified:
            self.shards.fetch_file(file, self._storage)
            self._verified.add(file.path)
        return self.shards.root / file.path

    def _group(
        self, file: ShardFile, parquet: pq.ParquetFile, group: int, columns: Sequence[str] | None
    ) -> pa.Table:
        if columns is not None:  # partial reads are not cached (they serve scans of a column or two)
            return parquet.read_row_group(group, columns=list(columns))
        key = (file.path, group)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        table = parquet.read_row_group(group)
        self._groups[key] = table
        self._cached += table.nbytes
        while self._cached > self._cache_bytes and len(self._groups) > 1:
            _, evicted = self._groups.popitem(last=False)
            self._cached -= evicted.nbytes
        return table

    def _first_schema(self) -> pa.Schema:
        runs = [run for run in (*self._runs.values(), *self._held.values()) if run.files]
        if not runs:
            raise IngestError(f"shards {self.shards.manifest.key}: nothing to read")
        with self._lock:
            parquet, _ = self._file(runs[0].files[0])
        return parquet.schema_arrow


def evaluation_rows(total: int, limit: int | None) -> np.ndarray:
    """The positions a validation evaluates among ``total`` held-out rows: all of them, or
    ``limit`` evenly spaced ones (``None``: no limit).

    >>> evaluation_rows(10, 4).tolist()
    [0, 2, 5, 7]
    """
    if limit is None or total <= limit:
        return np.arange(total, dtype=np.int64)
    return (np.arange(limit, dtype=np.int64) * total) // limit
