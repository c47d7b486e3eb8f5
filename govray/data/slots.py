"""The schedule evaluated: what each worker reads at each step (its ``Slot``), every worker's slots
at a step, and the steps a row reached — each recomputed from a ``ScheduleSpec`` alone
(:mod:`govray.data.schedule` says what the spec's inputs mean).

Example::

    spec = ScheduleSpec.from_manifest(manifest, seed=7, world_size=2, batch_size=32)
    for step in range(spec.steps_per_epoch):
        mine = slot(spec, step, rank)          # mine.route, mine.rows, mine.corpora
        counts = route_counts(step_slots(spec, step))    # examples per route, no communication
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from govray.data.orders import EpochOrder, epoch_order
from govray.data.schedule import ScheduleError, ScheduleSpec


@dataclass(frozen=True)
class Slot:
    """What one worker reads at one step: rows of a single route (``None``: no batch left)."""

    route: str | None
    rows: tuple[int, ...]  # route-local row indices, positions in shards/train/ROUTE
    corpora: tuple[str, ...]  # the corpus of each row, parallel to ``rows``

    @property
    def empty(self) -> bool:
        """No rows: past the epoch's last batch, or every row excluded or gated."""
        return not self.rows


def epoch_of(spec: ScheduleSpec, epoch: int) -> EpochOrder:
    """Epoch ``epoch``'s order of rows and batches: steps 1-3 of the module docstring."""
    return epoch_order(spec.version, spec.seed, spec.batch_size, spec.sizes, epoch)


def slot(spec: ScheduleSpec, global_step: int, rank: int) -> Slot:
    """What worker ``rank`` reads at ``global_step``."""
    if not 0 <= rank < spec.world_size:
        raise ScheduleError(f"rank {rank} is outside the world of {spec.world_size} workers")
    epoch, step = spec.locate(global_step)
    batch = step * spec.world_size + rank
    if batch >= spec.batches_per_epoch:
        return Slot(route=None, rows=(), corpora=())
    order = epoch_of(spec, epoch)
    routes, starts = order.batches(batch, batch + 1)
    index, start = int(routes[0]), int(starts[0])
    route = spec.routes[index]
    rows = order.rows(index, np.arange(start, min(start + spec.batch_size, route.rows)))
    corpora = route.corpora_of(rows)
    withheld = spec.withheld_corpora(global_step)
    kept = [
        (row, corpus) for row, corpus in zip(rows.tolist(), corpora, strict=True) if corpus not in withheld
    ]
    return Slot(
        route=route.route,
        rows=tuple(row for row, _ in kept),
        corpora=tuple(corpus for _, corpus in kept),
    )


def row_slots(spec: ScheduleSpec, route: str, position: int, epochs: int) -> list[tuple[int, int]]:
    """Every ``(global_step, rank)`` of epochs ``0..epochs-1`` whose slot holds route-local row
    ``position`` of ``route``, in step order: one per epoch, unless its corpus was excluded or
    gated by then (as ``slot`` drops it). Version 2 finds each through the inverses in O(1)."""
    index = [layout.route for layout in spec.routes].index(spec.route(route).route)
    corpus = spec.routes[index].corpus_of(position)
    found = []
    for epoch in range(epochs):
        batch = epoch_of(spec, epoch).batch_of(index, position)
        global_step = epoch * spec.steps_per_epoch + batch // spec.world_size
        if corpus not in spec.withheld_corpora(global_step):
            found.append((global_step, batch % spec.world_size))
    return found


def step_slots(spec: ScheduleSpec, global_step: int) -> tuple[Slot, ...]:
    """Every worker's slot at ``global_step``, indexed by rank."""
    return tuple(slot(spec, global_step, rank) for rank in range(spec.world_size))


def route_counts(slots: Sequence[Slot]) -> dict[str, int]:
    """Examples per route over the non-empty ``slots`` of one step: the masked average's divisors."""
    counts: dict[str, int] = {}
    for item in slots:
        if not item.empty:
            assert item.route is not None
            counts[item.route] = counts.get(item.route, 0) + len(item.rows)
    return counts
