"""The schedule evaluated: what each slot holds at each step (its ``Slot``), every slot of a
step, the slots a worker runs, and the steps a row reached — each recomputed from a
``ScheduleSpec`` alone (:mod:`govray.data.schedule` says what the spec's inputs mean).

A step has ``spec.world_size`` slots (S, fixed when the run started). A world of W workers splits
them: rank r runs slots r, r + W, r + 2W, ... in ``ceil(S / W)`` rounds (``rank_slots``); with
W = S slot r is rank r's, one round. Counts, divisors and the ledger use every slot of the step,
so they do not depend on W.

Example::

    spec = ScheduleSpec.from_manifest(manifest, seed=7, world_size=2, batch_size=32)
    for step in range(spec.steps_per_epoch):
        mine = slot(spec, step, index)         # slot index < S: mine.route, mine.rows, mine.corpora
        counts = route_counts(step_slots(spec, step))    # examples per route, no communication
        rounds = rank_slots(spec, step, rank, world=1)   # [(0, slot 0), (1, slot 1)]: one worker
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from govray.data.orders import KeyedEpoch, keyed_epoch
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


def epoch_of(spec: ScheduleSpec, epoch: int) -> KeyedEpoch:
    """Epoch ``epoch``'s order of rows and batches: steps 1-3 of the module docstring."""
    return keyed_epoch(spec.seed, spec.batch_size, spec.sizes, epoch)


EMPTY = Slot(route=None, rows=(), corpora=())


def slot(spec: ScheduleSpec, global_step: int, index: int) -> Slot:
    """What slot ``index`` of ``global_step`` holds (rank ``index``'s when the world is S workers)."""
    if not 0 <= index < spec.world_size:
        raise ScheduleError(f"slot {index} is outside the {spec.world_size} slots of a step")
    epoch, step = spec.locate(global_step)
    batch = step * spec.world_size + index
    if batch >= spec.batches_per_epoch:
        return EMPTY
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
    """Every ``(global_step, slot index)`` of epochs ``0..epochs-1`` whose slot holds route-local row
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


def rank_slots(spec: ScheduleSpec, global_step: int, rank: int, world: int) -> list[tuple[int, Slot]]:
    """The ``(slot index, slot)`` rank ``rank`` of a world of ``world`` workers runs at
    ``global_step``, one per round: slots rank, rank + world, ... — ``ceil(S / world)`` rounds on
    every rank (each round's forward and backward hold collectives every rank joins), a rank
    with no slot left in the last round getting an empty one (its index past S: a stand-in)."""
    if not 0 <= rank < world:
        raise ScheduleError(f"rank {rank} is outside the world of {world} workers")
    rounds = -(-spec.world_size // world)
    indices = [rank + round_ * world for round_ in range(rounds)]
    return [
        (index, slot(spec, global_step, index) if index < spec.world_size else EMPTY) for index in indices
    ]


def step_slots(spec: ScheduleSpec, global_step: int) -> tuple[Slot, ...]:
    """Every slot of ``global_step``, in slot order."""
    return tuple(slot(spec, global_step, index) for index in range(spec.world_size))


def route_counts(slots: Sequence[Slot]) -> dict[str, int]:
    """Examples per route over the non-empty ``slots`` of one step: the masked average's divisors."""
    counts: dict[str, int] = {}
    for item in slots:
        if not item.empty:
            assert item.route is not None
            counts[item.route] = counts.get(item.route, 0) + len(item.rows)
    return counts
