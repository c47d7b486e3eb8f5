"""The packed token store: text of a shard set packed into fixed-length windows, read by position.

A window is the unit a packed run schedules instead of a row: at most ``seq_len`` tokens of rows
of **one route and one corpus**, in shard order. So a route's windows are laid out like its rows
(each corpus a contiguous range, in the shard manifest's corpus order) and the schedule's
permutation, exclusions and gates work unchanged with windows for rows (:meth:`PackedStore.layout`).
How rows become windows: :mod:`govray.data.packing`.

Layout under ``STORAGE/shards/KEY/packed/DIGEST/`` (DIGEST: :func:`packed_key` of the shard key,
``seq_len`` and the tokenizer's identity; one part per shard file, windows never cross files)::

    manifest.json                     inputs, counts per part and corpus, sha256 of every file
    train/ROUTE/part-00000.tokens     uint32 little-endian: the part's tokens, row after row, unpadded
    train/ROUTE/part-00000.windows.npy  one WINDOW_DTYPE record per window, in order
    train/ROUTE/part-00000.rows.npy   int64: ``_row`` of each of the shard file's rows, in order

A window's tokens are ``tokens[offset : offset + count]`` of its part; it is padded to ``seq_len``
only when read. Memory of a reader does not grow with the corpus: files are memory-mapped, and
only the manifest (a few numbers per part) is held.

Example::

    store = PackedStore.open(root, verify=True)
    spec = ScheduleSpec(seed=7, world_size=2, batch_size=8, routes=store.layouts())
    mine = slot(spec, step, rank)                           # positions are windows now
    batch = store.take(mine.route, np.asarray(mine.rows))   # input_ids [8 x seq_len], tokens, ...
    windows = step_rows(spec, step).rows                    # every slot's windows, per route
    divisors = {route: int(store.tokens(route, w).sum()) for route, w in windows.items()}  # per token
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from govray.core.canonical import canonical_json, file_sha256, sha256_hex
from govray.core.errors import IngestError, describe_validation_error
from govray.core.storage import Storage
from govray.data.schedule import RouteLayout
from govray.data.shards import MANIFEST

PACKED_FORMAT_VERSION = 1
PACKED_DIRECTORY = "packed"  # below the shard directory
TOKEN_DTYPE = np.dtype("<u4")
WINDOW_DTYPE = np.dtype(
    [
        ("offset", "<u8"),  # first token, as an index into the part's token file
        ("first", "<u8"),  # route-local index (position in shards/train/ROUTE) of the first token's row
        ("tokens", "<u4"),  # real tokens; the rest of seq_len is padding, added when read
        ("rows", "<u4"),  # rows that start here (a row cut into chunks counts in its first window)
        ("corpus", "<u4"),  # index into the manifest's corpora
    ]
)
OPEN_PARTS = 32  # memory-mapped parts kept open per store (least recently used closed first)

_STRICT = ConfigDict(extra="forbid", frozen=True)


def packed_key(shard_key: str, seq_len: int, tokenizer: str) -> str:
    """The store's directory name: sha256 of everything its bytes depend on."""
    inputs = {"format_version": PACKED_FORMAT_VERSION, "shards": shard_key, "seq_len": seq_len}
    return sha256_hex(canonical_json({**inputs, "tokenizer": tokenizer}))


class PackedFile(BaseModel):
    model_config = _STRICT

    path: str  # relative to the store's directory
    sha256: str


class PartCorpus(BaseModel):
    """One corpus's share of a part: its rows are contiguous there, and so are its windows."""

    model_config = _STRICT

    corpus_id: str
    rows: int
    windows: int
    tokens: int
    first_row: int  # its smallest and largest ``_row`` in the part
    last_row: int


class PackedPart(BaseModel):
    """The windows of one shard file."""

    model_config = _STRICT

    source: str  # the shard file, relative to the shard directory
    source_sha256: str
    first_row: int  # route-local index of the shard file's first row
    first_window: int  # route-local position of the part's first window
    rows: int
    windows: int
    tokens: int
    corpora: list[PartCorpus]  # in shard order
    token_file: PackedFile
    window_file: PackedFile
    row_file: PackedFile

    @property
    def files(self) -> tuple[PackedFile, PackedFile, PackedFile]:
        return self.token_file, self.window_file, self.row_file


class PackedRoute(BaseModel):
    model_config = _STRICT

    route: str
    parts: list[PackedPart]  # in shard order

    @property
    def windows(self) -> int:
        return sum(part.windows for part in self.parts)


class PackedManifest(BaseModel):
    """What a packed store holds and was built from."""

    model_config = _STRICT

    format_version: int = PACKED_FORMAT_VERSION
    key: str  # packed_key(shard_key, seq_len, tokenizer): the directory's name
    shard_key: str
    seq_len: int
    tokenizer: str  # the caller's identity of the tokenize function (code and hyperparameter digests)
    corpora: list[str]  # the shard manifest's corpus order
    routes: list[PackedRoute]  # the shard manifest's route order, routes without rows included

    def route(self, name: str) -> PackedRoute:
        for route in self.routes:
            if route.route == name:
                return route
        raise IngestError(f"packed store {self.key} has no route '{name}'")

    @model_validator(mode="before")
    @classmethod
    def _one_format(cls, data: Any) -> Any:
        """The version first: a store of another format is refused as such, not for its fields."""
        found = data.get("format_version", PACKED_FORMAT_VERSION) if isinstance(data, dict) else None
        if isinstance(data, dict) and found != PACKED_FORMAT_VERSION:
            raise ValueError(
                f"packed store format {found!r} is not the one this govray reads "
                f"({PACKED_FORMAT_VERSION}): pack the shards again"
            )
        return data

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


@dataclass
class _MappedPart:
    tokens: np.ndarray  # TOKEN_DTYPE, memory-mapped
    windows: np.ndarray  # WINDOW_DTYPE, memory-mapped
    rows: np.ndarray  # int64, memory-mapped


class PackedStore:
    """Random access to a packed store's windows by route-local position (see the module doc)."""

    def __init__(self, root: Path, manifest: PackedManifest, *, verify_touched: bool = False) -> None:
        self.root = root
        self.manifest = manifest
        self._verify_touched = verify_touched
        self._starts = {
            route.route: np.asarray([part.first_window for part in route.parts], dtype=np.int64)
            for route in manifest.routes
        }
        self._open: OrderedDict[tuple[str, int], _MappedPart] = OrderedDict()

    @classmethod
    def open(cls, root: Path, *, verify: bool | Literal["touched"] = False) -> PackedStore:
        """The store at ``root``. ``verify``: True checks every file's digest now; "touched" each
        part's files when it is first read (a worker hashes only what its slots read)."""
        path = root / MANIFEST
        try:
            manifest = PackedManifest.model_validate_json(path.read_text())
        except OSError as error:
            raise IngestError(f"no packed store manifest at {path}: {error.strerror}") from None
        except ValidationError as error:
            raise IngestError(f"packed store manifest {path}: {describe_validation_error(error)}") from None
        expected = packed_key(manifest.shard_key, manifest.seq_len, manifest.tokenizer)
        if manifest.key != expected or root.name != expected:
            raise IngestError(
                f"packed store {root}: its manifest describes store {manifest.key} "
                f"(its inputs give {expected}): the manifest was edited or moved"
            )
        store = cls(root, manifest, verify_touched=verify == "touched")
        if verify is True:
            store.verify()
        return store

    @classmethod
    def fetch(
        cls, root: Path, storage: Storage, *, verify: bool | Literal["touched"] = "touched", sha256: str
    ) -> PackedStore:
        """The store at ``root``, downloaded from ``storage`` and verified first when this node
        lacks it; its manifest checked against ``sha256`` (the digest the run recorded)."""
        storage.fetch(root, verify=lambda staged: cls._staged(staged, root.name))
        if file_sha256(root / MANIFEST) != sha256:
            raise IngestError(
                f"packed store manifest {root / MANIFEST} does not match the digest the run recorded"
            )
        return cls.open(root, verify=verify)

    @classmethod
    def _staged(cls, staged: Path, key: str) -> None:
        if staged.name != key:
            raise IngestError(f"downloaded packed store {staged} is not store {key}")
        cls.open(staged, verify=True)

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    def verify(self) -> None:
        """Check every file's digest against the manifest, naming the first that differs."""
        for route in self.manifest.routes:
            for part in route.parts:
                self._verify_part(part)

    def _verify_part(self, part: PackedPart) -> None:
        for file in part.files:
            path = self.root / file.path
            if not path.is_file():
                raise IngestError(f"packed store file {path} listed in the manifest is missing")
            if file_sha256(path) != file.sha256:
                raise IngestError(f"packed store file {path} does not match its digest in the manifest")

    # --- what the schedule sees ----------------------------------------------------------------

    def layout(self, route: str) -> RouteLayout:
        """``route``'s windows per corpus in the shard manifest's corpus order: the schedule's
        ``RouteLayout`` with windows for rows."""
        counts = dict.fromkeys(self.manifest.corpora, 0)
        for part in self.manifest.route(route).parts:
            for share in part.corpora:
                counts[share.corpus_id] += share.windows
        return RouteLayout(route, tuple((corpus, count) for corpus, count in counts.items() if count))

    def layouts(self) -> tuple[RouteLayout, ...]:
        """Every route's layout, in the shard manifest's route order (a ``ScheduleSpec``'s routes)."""
        return tuple(self.layout(route.route) for route in self.manifest.routes)

    # --- reading windows -----------------------------------------------------------------------

    def take(self, route: str, positions: np.ndarray, *, pad_id: int = 0) -> pa.Table:
        """The windows at ``positions`` (route-local, in the given order) as a table: ``input_ids``
        (list<int32>, each ``seq_len`` long, padded with ``pad_id``), ``tokens`` (real tokens),
        ``_corpus``, ``_row`` (``_row`` of the row holding the first token), ``_rows`` (rows that
        start in the window) and ``_route``."""
        records, numbers = self._records(route, positions)
        parts = self.manifest.route(route).parts
        seq_len = self.seq_len
        ids = np.full((len(records), seq_len), pad_id, dtype=np.int32)
        rows = np.empty(len(records), dtype=np.int64)
        for index, (record, number) in enumerate(zip(records, numbers.tolist(), strict=True)):
            mapped = self._mapped(route, number)
            start, count = int(record["offset"]), int(record["tokens"])
            ids[index, :count] = mapped.tokens[start : start + count]
            rows[index] = mapped.rows[int(record["first"]) - parts[number].first_row]
        offsets = np.arange(0, (len(records) + 1) * seq_len, seq_len, dtype=np.int32)
        corpora = self.manifest.corpora
        return pa.table(
            {
                "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.ravel())),
                "tokens": pa.array(records["tokens"].astype(np.int64)),
                "_corpus": pa.array([corpora[corpus] for corpus in records["corpus"].tolist()], pa.string()),
                "_row": pa.array(rows),
                "_rows": pa.array(records["rows"].astype(np.int64)),
                "_route": pa.array([route] * len(records), pa.string()),
            }
        )

    def tokens(self, route: str, positions: np.ndarray) -> np.ndarray:
        """Real tokens of each window at ``positions`` (int64): the ledger's token counts and,
        summed over a route group's slots, the per-token loss divisor."""
        return self._records(route, positions)[0]["tokens"].astype(np.int64)

    def examples(self, route: str, positions: np.ndarray) -> np.ndarray:
        """Rows that start in each window at ``positions`` (int64): the ledger's example counts
        (over all of a corpus's windows they sum to its rows exactly)."""
        return self._records(route, positions)[0]["rows"].astype(np.int64)

    def locate(self, corpus_id: str, row: int) -> list[tuple[str, int]]:
        """``(route, window position)`` of every window holding tokens of row ``row`` of
        ``corpus_id`` (several for a row cut into chunks; none for a holdout row), by binary
        search: the schedule then says at which steps those windows were read."""
        if corpus_id not in self.manifest.corpora:
            raise IngestError(f"packed store {self.manifest.key} has no corpus '{corpus_id}'")
        for route in self.manifest.routes:
            for number, part in enumerate(route.parts):
                offset = 0  # of the corpus's rows within the part
                for share in part.corpora:
                    if share.corpus_id == corpus_id and share.first_row <= row <= share.last_row:
                        mapped = self._mapped(route.route, number)
                        index = _find(mapped.rows[offset : offset + share.rows], row)
                        if index is not None:
                            windows = _windows_of(mapped.windows, part.first_row + offset + index)
                            return [(route.route, part.first_window + window) for window in windows]
                    offset += share.rows
        return []  # a holdout row

    def _records(self, route: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The window records at ``positions`` and the part number of each."""
        summary = self.manifest.route(route)
        positions = np.asarray(positions, dtype=np.int64)
        total = summary.windows
        if positions.ndim != 1 or (positions.size and (positions.min() < 0 or positions.max() >= total)):
            raise IngestError(
                f"route '{route}' of packed store {self.manifest.key} has {total} windows: "
                f"positions must be a 1-d array of integers in [0, {total})"
            )
        numbers = np.searchsorted(self._starts[route], positions, side="right") - 1
        records = np.empty(len(positions), dtype=WINDOW_DTYPE)
        for number in np.unique(numbers).tolist():
            chosen = numbers == number
            local = positions[chosen] - summary.parts[number].first_window
            records[chosen] = self._mapped(route, number).windows[local]
        return records, numbers

    def _mapped(self, route: str, number: int) -> _MappedPart:
        key = (route, number)
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        part = self.manifest.route(route).parts[number]
        if self._verify_touched:
            self._verify_part(part)
        mapped = _MappedPart(
            tokens=_map_tokens(self.root / part.token_file.path, part.tokens),
            windows=_load_mapped(self.root / part.window_file.path, WINDOW_DTYPE, part.windows),
            rows=_load_mapped(self.root / part.row_file.path, np.dtype("<i8"), part.rows),
        )
        self._open[key] = mapped
        if len(self._open) > OPEN_PARTS:
            self._open.popitem(last=False)
        return mapped


def _find(rows: np.ndarray, row: int) -> int | None:
    """The index of ``row`` in sorted ``rows`` (searched in place: a contiguous memory map)."""
    index = int(np.searchsorted(rows, row))
    return index if index < len(rows) and int(rows[index]) == row else None


def _windows_of(windows: np.ndarray, index: int) -> range:
    """The windows (of one part) holding tokens of the row at route-local ``index``: those it
    opens (a row cut into chunks opens several), else the one it was packed into."""
    low = bisect_left(windows, index, key=_first_row_of)
    high = bisect_right(windows, index, key=_first_row_of)
    return range(low, high) if high > low else range(low - 1, low)


def _first_row_of(record: np.void) -> int:
    return int(record["first"])


def _map_tokens(path: Path, length: int) -> np.ndarray:
    size = path.stat().st_size
    if size != length * TOKEN_DTYPE.itemsize:
        raise IngestError(f"packed store file {path} holds {size} bytes, not {length} uint32 tokens")
    if length == 0:  # a part of empty rows only: mmap refuses an empty file
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def _load_mapped(path: Path, dtype: np.dtype, length: int) -> np.ndarray:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if array.dtype != dtype or array.shape != (length,):
        raise IngestError(
            f"packed store file {path} holds {array.dtype}{list(array.shape)}, not {dtype}[{length}]"
        )
    return array
