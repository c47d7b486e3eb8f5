"""One worker's view of the run: its rank, the training rows it reads, and the sums it shares."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist

from govray.core.errors import GovrayError
from govray.data.schedule import Slot
from govray.data.shards import ShardSet
from govray.train.trial import Trial

T = TypeVar("T")


@dataclass
class Worker:
    """One worker's view: rank, world size, its device, and whether a process group exists."""

    rank: int
    world_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

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
            return cls(dist.get_rank(), dist.get_world_size(), device)
        return cls(0, 1, device)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def mine(self, table: pa.Table) -> pa.Table:
        """This rank's share of ``table``: rows rank, rank + world size, …"""
        return table.take(pa.array(range(self.rank, table.num_rows, self.world_size), type=pa.int64()))


class RouteRows:
    """Training rows of each route, loaded once per worker; a slot reads its rows by index."""

    def __init__(self, shards: ShardSet) -> None:
        self.tables = {
            route.route: shards.route_table(route.route) for route in shards.manifest.routes if route.rows
        }
        self._empty = next(iter(self.tables.values())).slice(0, 0)

    def take(self, slot: Slot) -> pa.Table:
        if slot.empty or slot.route is None:
            return self._empty
        return self.tables[slot.route].take(pa.array(slot.rows, type=pa.int64()))

    def corpus_rows(self, corpus_id: str) -> pa.Table:
        """Every training row of a corpus (over all its routes), in ``by_row_hash`` order."""
        parts = [table.filter(pc.equal(table.column("_corpus"), corpus_id)) for table in self.tables.values()]
        return by_row_hash(pa.concat_tables([part for part in parts if part.num_rows] or [self._empty]))

    def corpus_sample(self, corpus_id: str, count: int, exclude: Collection[int] = ()) -> pa.Table:
        """``count`` training rows of a corpus: those with the lowest row hashes, leaving out the
        rows numbered in ``exclude`` (a corpus's canaries)."""
        return without_rows(self.corpus_rows(corpus_id), exclude).slice(0, count)

    def tokens(self, trial: Trial) -> dict[str, list[int]] | None:
        """Tokens per route-local row, for the ledger; None unless the trial counts tokens."""
        counts = {route: trial.tokens(table) for route, table in self.tables.items()}
        if any(value is None for value in counts.values()):
            return None
        return {route: list(value) for route, value in counts.items() if value is not None}


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
    """Sum named floats over all workers (in a fixed key order). A name only one rank computed
    comes back exactly (0.0 + x)."""
    keys = sorted(values)
    if not worker.distributed:
        return {key: values[key] for key in keys}
    gathered: list[Any] = [None] * worker.world_size
    dist.all_gather_object(gathered, {key: values[key] for key in keys})
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
    dist.all_gather_object(said, None if refusal is None else str(refusal))
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
