"""Packing: a shard set's training rows, tokenized, packed into windows of at most ``seq_len`` tokens.

Per route, rows are taken in shard order and packed greedily: a row joins the open window while
the window's tokens plus the row's stay within ``seq_len``, else it opens a new window. A window
never mixes routes nor corpora (a new corpus opens a new window), so each corpus's windows form
a contiguous range of the route, as its rows did, and the schedule's exclusions and gates drop
windows by corpus exactly as they dropped rows. A row is never split across windows unless it is
longer than ``seq_len``: then it is cut into chunks of ``seq_len`` tokens from its start, each
full chunk a window of its own, and the last (shorter) chunk starts a new window that the rows
after it may join; the row counts as one example, in its first window. A row of no tokens joins
the open window (or opens one), so a window may, rarely, hold only such rows and no token.
Windows are stored unpadded (the reader pads them to ``seq_len``).

One Ray task packs one shard file into one part of the store, holding one file's rows at most
(read in batches); windows never cross files. Over all windows of a (corpus, route) the examples
sum to its rows and the tokens to the sum of ``tokenize``'s lengths of its rows, exactly.
Rebuilding from the same shards, ``seq_len`` and tokenizer gives byte-identical files.

Example::

    trial = make_trial(config.trial, hparams)
    store = pack_shards(shards, seq_len=512, tokenize=trial.tokenize,
                        tokenizer=f"{code_digest}:{hparams_digest}")
    store.layout("public")        # windows per corpus, for the schedule
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from govray.core.canonical import file_sha256
from govray.core.errors import GovrayError, IngestError
from govray.core.runtime import stop_tasks
from govray.core.storage import IN_PLACE, Storage, shared_staging
from govray.data.packed import (
    PACKED_DIRECTORY,
    TOKEN_DTYPE,
    WINDOW_DTYPE,
    PackedManifest,
    PackedPart,
    PackedRoute,
    PackedStore,
    packed_key,
)
from govray.data.shards import MANIFEST, ShardFile, ShardSet

Tokenize = Callable[[pa.Table], Sequence[Sequence[int]]]
READ_BATCH_ROWS = 1024  # rows tokenized at a time: a task holds one batch's tokens, plus its windows
MAX_TOKEN_ID = 2**32 - 1


def pack_shards(
    shards: ShardSet,
    *,
    seq_len: int,
    tokenize: Tokenize,
    tokenizer: str,
    storage: Storage = IN_PLACE,
    force: bool = False,
) -> PackedStore:
    """The packed store of ``shards`` for ``seq_len`` and ``tokenize`` (whose identity, e.g. the
    trial's code and hyperparameter digests, is ``tokenizer``), under
    ``SHARDS/packed/packed_key(...)``: reused (verified) when present, else built and written
    atomically (readers see a complete store or none), then uploaded to ``storage`` (default: none,
    the store stays where it is written).

    Raises ``IngestError`` naming the shard file and rows whose tokenization failed.
    """
    if seq_len < 2:
        raise IngestError(f"packing needs seq_len >= 2, not {seq_len}")
    key = packed_key(shards.manifest.key, seq_len, tokenizer)
    root = shards.root / PACKED_DIRECTORY / key
    storage.fetch(root, verify=lambda staged: PackedStore.open(staged, verify=True))
    if (root / MANIFEST).exists() and not force:
        return PackedStore.open(root, verify=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = shared_staging(root.parent, f".{key[:12]}-") / key
    try:
        staging.mkdir()
        manifest = _build(shards, staging, key, seq_len, tokenize, tokenizer)
        (staging / MANIFEST).write_text(manifest.to_json())
        if force or not (root / MANIFEST).exists():  # else another process built it meanwhile
            if root.exists():
                shutil.rmtree(root)
            staging.rename(root)  # atomic: readers see a complete store or none
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)
    storage.upload(root)  # the manifest last
    return PackedStore.open(root)


def _build(
    shards: ShardSet, staging: Path, key: str, seq_len: int, tokenize: Tokenize, tokenizer: str
) -> PackedManifest:
    corpora = [corpus.corpus_id for corpus in shards.manifest.corpora]
    tokenize_ref = ray.put(tokenize)
    jobs: list[tuple[str, list[ray.ObjectRef]]] = []
    for route in shards.manifest.routes:
        refs, first_row = [], 0
        for number, file in enumerate(route.files):
            part = PartJob(
                shards.root, file, route.route, first_row, staging, f"train/{route.route}/part-{number:05d}"
            )
            refs.append(_pack_part_task.remote(part, seq_len, corpora, tokenize_ref))
            first_row += file.rows
        jobs.append((route.route, refs))
    try:
        parts = [(route, ray.get(refs)) for route, refs in jobs]
    except BaseException as error:
        # The other parts may still be writing under staging, which the caller removes next.
        stop_tasks([ref for _, refs in jobs for ref in refs])
        if not isinstance(error, ray.exceptions.RayTaskError):
            raise
        cause = error.cause
        if isinstance(cause, GovrayError):
            raise cause from None
        what = f"{type(cause).__name__}: {cause}"
        raise IngestError(f"packing shards {shards.manifest.key} failed: {what}") from None
    routes = [PackedRoute(route=route, parts=_numbered(route, found, corpora)) for route, found in parts]
    return PackedManifest(
        key=key,
        shard_key=shards.manifest.key,
        seq_len=seq_len,
        tokenizer=tokenizer,
        corpora=corpora,
        routes=routes,
    )


def _numbered(route: str, parts: list[dict[str, Any]], corpora: list[str]) -> list[PackedPart]:
    """The parts of ``route`` with their first window positions, checked to be in shard order
    across files (a corpus's rows contiguous and ascending), which the window layout relies on."""
    numbered, first_window, last = [], 0, (-1, -1)
    for part in parts:
        for share in part["corpora"]:
            here = (corpora.index(share["corpus_id"]), share["first_row"])
            if here <= last:
                raise IngestError(
                    f"route '{route}': shard file {part['source']} is not in shard order (corpus "
                    f"'{share['corpus_id']}' row {share['first_row']} after corpus "
                    f"'{corpora[last[0]]}' row {last[1]})"
                )
            last = (here[0], share["last_row"])
        numbered.append(PackedPart.model_validate({**part, "first_window": first_window}))
        first_window += part["windows"]
    return numbered


class WindowPacker:
    """Greedy packing of one file's rows (lengths only: the tokens are written in row order, so a
    window is a contiguous range of them). See the module docstring for the rules."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.windows: list[tuple[int, int, int, int, int]] = []
        self._open: list[int] | None = None  # offset, first, tokens, rows, corpus
        self._position = 0  # tokens so far

    def add(self, index: int, corpus: int, length: int) -> None:
        """Add the row at route-local ``index`` of ``corpus`` with ``length`` tokens."""
        window = self._open
        if window is not None and (window[4] != corpus or window[2] + length > self.seq_len):
            self._close()
        if length <= self.seq_len:
            if self._open is None:
                self._open = [self._position, index, 0, 0, corpus]
            self._open[2] += length
            self._open[3] += 1
        else:
            for start in range(0, length, self.seq_len):
                chunk = min(self.seq_len, length - start)
                self._open = [self._position + start, index, chunk, int(start == 0), corpus]
                if chunk == self.seq_len:
                    self._close()
        self._position += length

    def finish(self) -> np.ndarray:
        """Every window, as WINDOW_DTYPE records."""
        if self._open is not None:
            self._close()
        return np.array(self.windows, dtype=WINDOW_DTYPE)

    def _close(self) -> None:
        assert self._open is not None
        offset, first, tokens, rows, corpus = self._open
        self.windows.append((offset, first, tokens, rows, corpus))
        self._open = None


@dataclass(frozen=True)
class PartJob:
    """One shard file to pack, and where its part goes."""

    shard_root: Path
    file: ShardFile
    route: str
    first_row: int  # route-local index of the file's first row
    staging: Path
    relative: str  # the part's path in the store, without suffix

    def path(self, suffix: str) -> Path:
        return self.staging / f"{self.relative}{suffix}"


PART_SUFFIXES = {"token_file": ".tokens", "window_file": ".windows.npy", "row_file": ".rows.npy"}


def pack_part(job: PartJob, seq_len: int, corpora: list[str], tokenize: Tokenize) -> dict[str, Any]:
    """Pack ``job``'s shard file into its part files (one per ``PART_SUFFIXES``); the part's
    manifest entry, without its first window position."""
    file, first_row = job.file, job.first_row
    source = job.shard_root / file.path
    if file_sha256(source) != file.sha256:
        raise IngestError(f"shard file {source} does not match its digest in the shard manifest")
    corpus_index = {corpus: index for index, corpus in enumerate(corpora)}
    packer = WindowPacker(seq_len)
    row_numbers, corpus_numbers = [], []
    job.path("").parent.mkdir(parents=True, exist_ok=True)
    index = first_row
    with open(job.path(PART_SUFFIXES["token_file"]), "wb") as tokens_out:
        for batch in pq.ParquetFile(source).iter_batches(batch_size=READ_BATCH_ROWS):
            rows = pa.Table.from_batches([batch])
            where = f"shard file {source} rows {index - first_row}..{index - first_row + rows.num_rows - 1}"
            corpus, lengths, tokens = _tokenized(rows, tokenize, corpus_index, job.route, where)
            tokens_out.write(tokens.tobytes())
            for number, length in zip(corpus.tolist(), lengths.tolist(), strict=True):
                packer.add(index, number, length)
                index += 1
            row_numbers.append(rows["_row"].to_numpy().astype(np.int64))
            corpus_numbers.append(corpus)
    if index - first_row != file.rows:
        raise IngestError(f"shard file {source} holds {index - first_row} rows; the manifest: {file.rows}")
    windows = packer.finish()
    row_of = np.concatenate(row_numbers) if row_numbers else np.zeros(0, np.int64)
    corpus_of = np.concatenate(corpus_numbers) if corpus_numbers else np.zeros(0, np.int64)
    np.save(job.path(PART_SUFFIXES["window_file"]), windows, allow_pickle=False)
    np.save(job.path(PART_SUFFIXES["row_file"]), row_of, allow_pickle=False)
    return {
        "source": file.path,
        "source_sha256": file.sha256,
        "first_row": first_row,
        "rows": file.rows,
        "windows": len(windows),
        "tokens": int(windows["tokens"].sum()),
        "corpora": _shares(source, windows, row_of, corpus_of, corpora),
        **{
            name: {"path": f"{job.relative}{suffix}", "sha256": file_sha256(job.path(suffix))}
            for name, suffix in PART_SUFFIXES.items()
        },
    }


_pack_part_task = ray.remote(pack_part)


def _tokenized(
    rows: pa.Table, tokenize: Tokenize, corpus_index: dict[str, int], route: str, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's corpus number and token count, and their tokens back to back (TOKEN_DTYPE)."""
    strangers = sorted(set(rows["_route"].to_pylist()) - {route})
    if strangers:
        raise IngestError(f"{where}: rows of route(s) {', '.join(strangers)} among those of route '{route}'")
    names = rows["_corpus"].to_pylist()
    unknown = sorted(set(names) - set(corpus_index))
    if unknown:
        raise IngestError(f"{where}: corpus '{unknown[0]}' is not in the shard manifest")
    try:
        ids = tokenize(rows)
    except Exception as error:  # the trial's code: say which rows it failed on
        raise IngestError(f"tokenizing {where} failed: {type(error).__name__}: {error}") from None
    if len(ids) != rows.num_rows:
        raise IngestError(f"tokenize returned {len(ids)} token lists for the {rows.num_rows} {where}")
    lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((token for row in ids for token in row), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() > MAX_TOKEN_ID):
        raise IngestError(f"tokenize returned a token id outside [0, 2**32) for {where}")
    corpus = np.fromiter((corpus_index[name] for name in names), dtype=np.int64, count=len(names))
    return corpus, lengths, flat.astype(TOKEN_DTYPE)


def _shares(
    source: Path, windows: np.ndarray, row_of: np.ndarray, corpus_of: np.ndarray, corpora: list[str]
) -> list[dict[str, Any]]:
    """Each corpus's rows, windows, tokens and ``_row`` range in the part, checking that its rows
    are contiguous and ascending (shard order)."""
    if np.any(np.diff(corpus_of) < 0) or np.any((np.diff(corpus_of) == 0) & (np.diff(row_of) <= 0)):
        raise IngestError(f"shard file {source} is not in shard order (corpus order, then row)")
    shares = []
    for number in np.unique(corpus_of).tolist():
        mine = corpus_of == number
        windowed = windows["corpus"] == number
        shares.append(
            {
                "corpus_id": corpora[number],
                "rows": int(mine.sum()),
                "windows": int(windowed.sum()),
                "tokens": int(windows["tokens"][windowed].sum()),
                "first_row": int(row_of[mine][0]),
                "last_row": int(row_of[mine][-1]),
            }
        )
    return shares
