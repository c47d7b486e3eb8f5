"""One worker's view of the run: its rank, the training rows it reads, and the sums it shares.

Collectives take one of two groups. Tensors of the step (gradient buckets, flags of route groups)
live on the worker's device and go through the run's process group (NCCL under ``use_gpu``,
which takes CUDA tensors only). Objects that live on the host — the pause/kill flag, sums of
Python floats, error messages, lists of files — go through ``Worker.host_group``, a gloo group
made once per process group: NCCL would carry them through the GPU (a host-to-device copy, then
a read that waits for every kernel queued before it), gloo carries them between hosts and never
waits for the device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist

from govray.core.errors import GovrayError
from govray.data.packed import PackedStore
from govray.data.shard_reader import FileRun, ShardReader
from govray.data.slots import Slot
from govray.train.step.ledger import RowCounts, TokensPerRow
from govray.train.trial import Trial

T = TypeVar("T")

_host_groups: list[tuple[Any, Any]] = []  # (the default process group, its gloo side group)


def host_group() -> Any:
    """The gloo group over every rank of the default process group that host objects go
    through, made the first time it is asked for (a collective: every rank asks at the same
    point, as it does for the collectives that use it) and kept while that group lives."""
    world = dist.group.WORLD
    if not _host_groups or _host_groups[0][0] is not world:
        _host_groups[:] = [(world, dist.new_group(backend="gloo"))]
    return _host_groups[0][1]


@dataclass
class Worker:
    """One worker's view: rank, world size, its device, and whether a process group exists.

    Collectives on device tensors use the default group; host objects use ``host_group``."""

    rank: int
    world_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def host_group(self) -> Any:
        """The gloo group for host objects (``host_group()``); None without a process group."""
        return host_group() if self.distributed else None

    @classmethod
    def detect(cls, use_gpu: bool = False) -> Worker:
        """This process's rank and world (1 without a process group) and its device: the GPU
        Ray Train assigned it (``ray.train.torch.get_device()``) when ``use_gpu`` and CUDA is
        there, else the CPU."""
        device = torch.device("cpu")
        if use_gpu and torch.cuda.is_available():
            try:
                import ray.train.torch

                device = ray.train.torch.get_device()
            except (RuntimeError, ValueError, AttributeError):  # not a Ray Train worker: in-process
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        if dist.is_available() and dist.is_initialized():
            worker = cls(dist.get_rank(), dist.get_world_size(), device)
            _ = worker.host_group  # made when the run starts, on every rank
            return worker
        return cls(0, 1, device)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def mine(self, table: pa.Table) -> pa.Table:
        """This rank's share of ``table``: rows rank, rank + world size, …"""
        return table.take(pa.array(range(self.rank, table.num_rows, self.world_size), type=pa.int64()))


class RouteRows:
    """What a worker's slots read, by route-local position: rows (``ShardReader``: only the row
    groups its slots touch), or under ``data.packing`` windows of tokens (``PackedStore``,
    padded with ``pad_id``); and the fixed row samples the memorization probe measures on."""

    def __init__(self, reader: ShardReader, packed: PackedStore | None = None, pad_id: int = 0) -> None:
        self.reader = reader
        self.packed = packed
        self.pad_id = pad_id

    def take(self, slot: Slot) -> pa.Table:
        if self.packed is not None:
            route = slot.route or self.packed.manifest.routes[0].route
            return self.packed.take(route, np.asarray(slot.rows, dtype=np.int64), pad_id=self.pad_id)
        if slot.empty or slot.route is None:
            return self.reader.empty()
        return self.reader.take(slot.route, slot.rows)

    def counts(self, trial: Trial) -> RowCounts | None:
        """What each scheduled position holds, for the ledger: a packed window's examples and
        tokens; one row and its tokens when the trial counts them; else None (one example)."""
        if self.packed is not None:
            return self.packed
        tokens = self.tokens(trial)
        return None if tokens is None else TokensPerRow(tokens)

    def corpus_sample(self, corpus_id: str, count: int, exclude: Collection[int] = ()) -> pa.Table:
        """``count`` training rows of a corpus: those with the lowest row hashes, leaving out the
        rows numbered in ``exclude`` (a corpus's canaries), in ``by_row_hash`` order."""
        runs = [self.reader.route_files(route.route) for route in self.reader.shards.manifest.routes]
        return lowest_hashes(self.reader, runs, corpus_id, count, exclude)

    def holdout_sample(self, corpus_id: str, count: int, exclude: Collection[int] = ()) -> pa.Table:
        """Like ``corpus_sample``, over the corpus's held-out rows."""
        return lowest_hashes(self.reader, [self.reader.holdout_files(corpus_id)], corpus_id, count, exclude)

    def routes_of(self, corpus_id: str, rows: Collection[int]) -> dict[int, str]:
        """The route of each of ``rows`` (row numbers of a corpus) that is a training row, found
        through the shards' row index (``ShardSet.locate``)."""
        found: dict[int, str] = {}
        for row in sorted(rows):
            place = self.reader.shards.locate(corpus_id, row)
            if place.route is not None:
                found[row] = place.route
        return found

    def tokens(self, trial: Trial) -> dict[str, np.ndarray] | None:
        """Tokens per route-local row, for the ledger (one int32 per row, read a row group at a
        time); None unless the trial counts tokens."""
        counted: dict[str, np.ndarray] = {}
        for route in self.reader.shards.manifest.routes:
            parts = []
            for _, part in self.reader.scan(self.reader.route_files(route.route)):
                values = trial.tokens(part)
                if values is None:
                    return None
                parts.append(np.asarray(values, dtype=np.int32))
            counted[route.route] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return counted


def lowest_hashes(
    reader: ShardReader, runs: Sequence[FileRun], corpus_id: str, count: int, exclude: Collection[int]
) -> pa.Table:
    """The ``count`` rows of ``corpus_id`` in ``runs`` with the lowest (row hash, row), in that
    order, minus the rows numbered in ``exclude``: one pass over three columns, keeping at most
    ``count`` candidates, then only those rows read whole."""
    best: pa.Table | None = None  # ``_row_hash`` as the shards hold it: raw bytes (format 4) or hex
    for index, run in enumerate(runs):
        for at, part in reader.scan(run, ["_corpus", "_row_hash", "_row"], corpus=corpus_id):
            positions = pa.array(np.arange(at, at + part.num_rows, dtype=np.int64))
            mine = pc.equal(part.column("_corpus"), corpus_id)
            candidates = pa.table(
                {
                    "_row_hash": part.column("_row_hash"),
                    "_row": part.column("_row"),
                    "_run": pa.array(np.full(part.num_rows, index, dtype=np.int64)),
                    "_at": positions,
                }
            ).filter(mine)
            pool = candidates if best is None else pa.concat_tables([best, candidates])
            best = by_row_hash(without_rows(pool, exclude)).slice(0, count)
    if best is None or not best.num_rows:
        return reader.empty()
    parts = [
        reader.take_from(
            runs[index], best.filter(pc.equal(best.column("_run"), index)).column("_at").to_numpy()
        )
        for index in sorted(set(best.column("_run").to_pylist()))
    ]
    return by_row_hash(pa.concat_tables(parts, promote_options="permissive"))


def by_row_hash(rows: pa.Table) -> pa.Table:
    """Rows ordered by row hash, then row number: the same order in every run and on every rank."""
    return rows.take(pc.sort_indices(rows, sort_keys=[("_row_hash", "ascending"), ("_row", "ascending")]))


def without_rows(rows: pa.Table, numbers: Collection[int]) -> pa.Table:
    """``rows`` minus those whose ``_row`` is in ``numbers``."""
    if not numbers:
        return rows
    excluded = pa.array(sorted(numbers), pa.int64())
    return rows.filter(pc.invert(pc.is_in(rows.column("_row"), excluded)))


def all_reduce_sums(values: Mapping[str, float], worker: Worker) -> dict[str, float]:
    """Sum named floats over all workers (in a fixed key order), on the host group. A name only
    one rank computed comes back exactly (0.0 + x)."""
    keys = sorted(values)
    if not worker.distributed:
        return {key: values[key] for key in keys}
    gathered: list[Any] = [None] * worker.world_size
    dist.all_gather_object(gathered, {key: values[key] for key in keys}, group=worker.host_group)
    names = sorted({key for part in gathered for key in part})
    return {name: sum(part.get(name, 0.0) for part in gathered) for name in names}


def agreed(action: Callable[[], T], worker: Worker | None, error: type[GovrayError] = GovrayError) -> T:
    """``action()`` on every rank of ``worker``'s group, which either all go on or all raise: a
    failure on any rank is raised there, and as ``error`` with what each failing rank said on the
    others (a rank that went on alone would wait for them in its next collective). Without a
    group (``worker`` None or alone): ``action()``."""
    if worker is None or not worker.distributed:
        return action()
    try:
        result, refusal = action(), None
    except Exception as raised:
        result, refusal = None, raised
    said: list[Any] = [None] * worker.world_size
    dist.all_gather_object(said, None if refusal is None else str(refusal), group=worker.host_group)
    if refusal is not None:
        raise refusal
    others = [f"rank {rank}: {message}" for rank, message in enumerate(said) if message is not None]
    if others:
        raise error("; ".join(others))
    return cast(T, result)


def default_threads(cpus_per_worker: float) -> int:
    """Torch threads per worker: its CPUs, unless ``OMP_NUM_THREADS`` says otherwise."""
    return (
        max(1, int(cpus_per_worker))
        if "OMP_NUM_THREADS" not in os.environ
        else int(os.environ["OMP_NUM_THREADS"])
    )
