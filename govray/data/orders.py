"""One epoch's order of rows and batches (steps 1-3 of ``govray.data.schedule``).

A route is given by its name and row count (``sizes``, in policy order); batch ``b`` of the
policy order is the ``b - first``-th batch of the route it falls in. ``keyed_epoch`` returns the
order the slots read, a ``KeyedEpoch``: keyed bijections, evaluated only at the indexes asked for.

Example::

    order = keyed_epoch(seed=7, batch_size=32, sizes=(("public", 10**9),), epoch=3)
    routes, starts = order.batches(0, 4)                 # the epoch's first 4 batches
    rows = order.rows(int(routes[0]), starts[0] + np.arange(32))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from govray.data.permutation import KeyedPermutation, derive_seed

Sizes = tuple[tuple[str, int], ...]  # (route, rows) in policy order


def batch_counts(batch_size: int, sizes: Sizes) -> np.ndarray:
    """Batches per route: a short last batch keeps every row."""
    return np.array([-(-rows // batch_size) for _, rows in sizes], dtype=np.int64)


@dataclass(frozen=True)
class KeyedEpoch:
    """Route ``i``'s position ``p`` holds row ``KeyedPermutation(derive_seed(seed,
    epoch, route), rows).forward(p)``; the epoch's ``k``-th batch is batch
    ``KeyedPermutation(derive_seed(seed, epoch), B).forward(k)`` of the policy order."""

    seed: int
    epoch: int
    batch_size: int
    sizes: Sizes
    firsts: np.ndarray  # per route: the policy-order index of its first batch
    ends: np.ndarray  # per route: the index after its last batch (cumulative batch counts)
    order: KeyedPermutation  # of the B batches

    def batches(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        canonical = self.order.forward(np.arange(first, last, dtype=np.int64))
        routes = np.searchsorted(self.ends, canonical, side="right")  # skips routes without rows
        return routes, (canonical - self.firsts[routes]) * self.batch_size

    def rows(self, route: int, positions: np.ndarray) -> np.ndarray:
        return self._route_order(route).forward(positions)

    def batch_of(self, route: int, row: int) -> int:
        position = int(self._route_order(route).inverse(np.array([row]))[0])
        canonical = int(self.firsts[route]) + position // self.batch_size
        return int(self.order.inverse(np.array([canonical]))[0])

    def _route_order(self, route: int) -> KeyedPermutation:
        name, rows = self.sizes[route]
        return _permutation(derive_seed(self.seed, self.epoch, name), rows)


@functools.lru_cache(maxsize=256)
def _permutation(key: int, n: int) -> KeyedPermutation:
    return KeyedPermutation(key, n)


@functools.lru_cache(maxsize=16)
def keyed_epoch(seed: int, batch_size: int, sizes: Sizes, epoch: int) -> KeyedEpoch:
    counts = batch_counts(batch_size, sizes)
    ends = np.cumsum(counts)
    order = _permutation(derive_seed(seed, epoch), int(ends[-1]))
    return KeyedEpoch(seed, epoch, batch_size, sizes, ends - counts, ends, order)
