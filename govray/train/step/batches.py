"""Batches off the step's critical path: a slot's rows collated one step ahead in a background
thread, into pinned memory on a GPU, split into the slot's micro-batches, and moved to the
worker's device with ``non_blocking``.

The step asks for its own slots (one per round: ``data.slots.rank_slots``) and names the next
step's; while it computes, those rows are read and collated. A prefetched batch is used only for
exactly the slots it was made for (a gate or a rollback that changes the schedule makes it a
miss, collated on the spot). ``collate``
therefore runs in another thread: it must not draw from torch's global random generator (the
step seeds it per step; augmentation belongs in ``loss``).

A trial never sees an empty batch: where a slot has no rows (an excluded corpus's slot in a
replay, past the epoch's end) or, under FSDP, a micro-batch has none, the piece is a stand-in —
one real row (``stand_in``), marked not ``counted``: the step runs it (the rank still joins every
collective its forward and backward hold) and selects its losses away (see ``GovernedStep.step``).

Example::

    batches = Prefetcher(rows.take, trial.collate, first_row, torch.device("cuda", 0), micro_batches=4)
    for step in steps:
        rounds = batches.take(slots_of(step), upcoming=slots_of(step + 1))  # per slot, 4 batches on the GPU
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa
import torch

from govray.data.slots import Slot
from govray.train.trial import Batch


def on_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` on ``device`` (asynchronous from pinned memory; the same tensors on their device)."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


@dataclass(frozen=True)
class MicroBatch:
    """A collated piece of a slot; ``counted`` false for a stand-in (its slot or piece had no rows)."""

    batch: Batch
    counted: bool = True


def micro_batches(rows: pa.Table, parts: int, exactly: bool = False) -> list[pa.Table]:
    """``rows`` split into at most ``parts`` consecutive non-empty pieces, sizes differing by at
    most one (larger first); one empty piece for no rows (the slot still joins the allreduce:
    ``Prefetcher`` puts a stand-in there).
    ``exactly``: always ``parts`` pieces, empty ones last (under FSDP every forward is a
    collective, so every rank runs as many)."""
    count = min(parts, rows.num_rows)
    pieces, offset = [], 0
    if count:
        size, extra = divmod(rows.num_rows, count)
        for index in range(count):
            length = size + (1 if index < extra else 0)
            pieces.append(rows.slice(offset, length))
            offset += length
    wanted = parts if exactly else 1
    return pieces + [rows.slice(0, 0)] * (wanted - len(pieces))


Rows = TypeVar("Rows", pa.Table, np.ndarray)


def row_batches(rows: Rows, size: int, count: int | None = None) -> list[Rows]:
    """``rows`` (a table, or an array of row positions) in consecutive batches of ``size`` (the
    last may be short; one empty batch for no rows); ``count``: exactly that many, empty ones last
    (FSDP: every rank runs as many forwards)."""
    pieces = [rows[start : start + size] for start in range(0, len(rows), size)] or [rows[:0]]
    if count is not None:
        pieces += [rows[:0]] * (count - len(pieces))
    return pieces


class Prefetcher:
    """Collates slots in one background thread, one step ahead of the step that trains them."""

    def __init__(
        self,
        take: Callable[[Slot], pa.Table],
        collate: Callable[[pa.Table], Batch],
        stand_in: Callable[[], pa.Table],
        device: torch.device,
        micro_batches: int = 1,
        split: Callable[[pa.Table, int], list[pa.Table]] = micro_batches,
    ) -> None:
        self._take, self._collate, self._stand_in = take, collate, stand_in
        self.device = device
        self.parts = micro_batches
        self._split = split  # a slot's rows into micro-batches (the parallelism twin's way)
        self._pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="govray-collate")
        self._ahead: tuple[tuple[Slot, ...], Future[list[list[MicroBatch]]]] | None = None

    def _prepare(self, slots: tuple[Slot, ...]) -> list[list[MicroBatch]]:
        return [self._prepare_one(slot) for slot in slots]

    def _prepare_one(self, slot: Slot) -> list[MicroBatch]:
        prepared = []
        for part in self._split(self._take(slot), self.parts):
            if part.num_rows:
                prepared.append(MicroBatch(self._collate(part)))
            else:
                prepared.append(MicroBatch(self._collate(self._stand_in()), counted=False))
        if self._pin:
            prepared = [
                MicroBatch({name: tensor.pin_memory() for name, tensor in part.batch.items()}, part.counted)
                for part in prepared
            ]
        return prepared

    def take(self, slots: Sequence[Slot], upcoming: Sequence[Slot] | None = None) -> list[list[MicroBatch]]:
        """The micro-batches of each of ``slots`` on the device; starts collating ``upcoming``."""
        wanted = tuple(slots)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == wanted:
            prepared = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()
            prepared = self._prepare(wanted)
        if upcoming is not None:
            following = tuple(upcoming)
            self._ahead = (following, self._pool.submit(self._prepare, following))
        return [
            [MicroBatch(on_device(part.batch, self.device), part.counted) for part in parts]
            for parts in prepared
        ]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
