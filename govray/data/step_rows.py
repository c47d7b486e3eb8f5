"""One step of the schedule summed by route: every worker's rows at once, as arrays.

What the masked average's divisors and the ledger need at every step, computed without a Python
object per row or per rank (``govray.data.slots.step_slots`` builds one ``Slot`` per rank and
gives the same counts)::

    rows = step_rows(spec, global_step)
    rows.route_counts()      # examples per route
    rows.corpus_examples()   # examples per (corpus, route)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from govray.data.schedule import RouteLayout, ScheduleSpec
from govray.data.slots import epoch_of


@dataclass(frozen=True)
class StepRows:
    """Every slot of one step, summed by route without a Python object per row or per rank.

    ``rows[route]``: the route-local rows of every non-empty slot of that route (rank order);
    ``corpus[route]``: the index into ``spec.route(route).corpus_counts`` of each. What the
    masked average's divisors and the ledger need, in O(routes) Python work plus vectorized
    O(world size * batch size) array work (``step_slots`` builds one ``Slot`` per rank).
    """

    routes: tuple[RouteLayout, ...]
    rows: dict[str, np.ndarray]
    corpus: dict[str, np.ndarray]

    def route_counts(self) -> dict[str, int]:
        """Examples per route (the same as ``route_counts(step_slots(...))``)."""
        return {route: len(rows) for route, rows in self.rows.items() if len(rows)}

    def corpus_examples(self) -> dict[tuple[str, str], int]:
        """Examples per (corpus, route)."""
        counts: dict[tuple[str, str], int] = {}
        for layout in self.routes:
            if layout.route not in self.rows:
                continue
            tally = np.bincount(self.corpus[layout.route], minlength=len(layout.corpus_counts))
            for position, count in enumerate(tally.tolist()):
                if count:
                    counts[layout.corpus_counts[position][0], layout.route] = count
        return counts


def step_rows(spec: ScheduleSpec, global_step: int) -> StepRows:
    """Every worker's slot at ``global_step``, summed by route (see :class:`StepRows`)."""
    epoch, step = spec.locate(global_step)
    order = epoch_of(spec, epoch)
    first = step * spec.world_size
    batch_routes, batch_starts = order.batches(first, min(first + spec.world_size, spec.batches_per_epoch))
    withheld = spec.withheld_corpora(global_step)
    offsets = np.arange(spec.batch_size, dtype=np.int64)
    rows: dict[str, np.ndarray] = {}
    corpus: dict[str, np.ndarray] = {}
    for index in np.unique(batch_routes).tolist():
        layout = spec.routes[index]
        positions = (batch_starts[batch_routes == index][:, None] + offsets[None, :]).ravel()
        taken = order.rows(index, positions[positions < layout.rows])
        corpora = layout.corpus_positions(taken)
        dropped = [position for position, (name, _) in enumerate(layout.corpus_counts) if name in withheld]
        if dropped:
            kept = ~np.isin(corpora, dropped)
            taken, corpora = taken[kept], corpora[kept]
        if len(taken):
            rows[layout.route], corpus[layout.route] = taken, corpora
    return StepRows(spec.routes, rows, corpus)
