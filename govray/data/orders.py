"""One epoch's order of rows and batches (steps 1-3 of ``govray.data.schedule``), per version.

A route is given by its name and row count (``sizes``, in policy order); batch ``b`` of the
policy order is the ``b - first``-th batch of the route it falls in. ``epoch_order`` returns the
order the slots read:

- ``KeyedEpoch`` (version 2): keyed bijections, evaluated only at the indexes asked for;
- ``EpochPlan`` (version 1): PCG64 rankings of every row and every batch, materialised.

Example::

    order = epoch_order(2, seed=7, batch_size=32, sizes=(("public", 10**9),), epoch=3)
    routes, starts = order.batches(0, 4)                 # the epoch's first 4 batches
    rows = order.rows(int(routes[0]), starts[0] + np.arange(32))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.random import PCG64

from govray.data.permutation import KeyedPermutation, derive_seed

Sizes = tuple[tuple[str, int], ...]  # (route, rows) in policy order


class EpochOrder(Protocol):
    def batches(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Route index and start position of batches ``first..last-1`` of the epoch's order."""
        ...

    def rows(self, route: int, positions: np.ndarray) -> np.ndarray:
        """The route-local rows at ``positions`` of route ``route``'s permuted order."""
        ...

    def batch_of(self, route: int, row: int) -> int:
        """The index in the epoch's order of the batch holding row ``row`` of route ``route``."""
        ...


def epoch_order(version: int, seed: int, batch_size: int, sizes: Sizes, epoch: int) -> EpochOrder:
    """Epoch ``epoch``'s order under schedule ``version`` (1 or 2)."""
    if version == 1:
        return epoch_plan(seed, batch_size, sizes, epoch)
    return keyed_epoch(seed, batch_size, sizes, epoch)


def batch_counts(batch_size: int, sizes: Sizes) -> np.ndarray:
    """Batches per route: a short last batch keeps every row."""
    return np.array([-(-rows // batch_size) for _, rows in sizes], dtype=np.int64)


@dataclass(frozen=True)
class KeyedEpoch:
    """Version 2: route ``i``'s position ``p`` holds row ``KeyedPermutation(derive_seed(seed,
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


def _ranking(seed: int, count: int) -> np.ndarray:
    """A permutation of ``range(count)``: indices sorted by PCG64's raw 64-bit outputs."""
    return np.argsort(PCG64(seed).random_raw(count), kind="stable")


@dataclass(frozen=True)
class EpochPlan:
    """Version 1: every route's rows ranked by PCG64 outputs seeded by ``derive_seed(seed, epoch,
    route)``, the B batches by those seeded by ``derive_seed(seed, epoch)``, all held in memory."""

    batch_size: int
    orders: tuple[np.ndarray, ...]  # per route: its route-local rows in this epoch's order
    batch_routes: np.ndarray  # route index of the epoch's k-th batch
    batch_starts: np.ndarray  # that batch's offset into its route's order

    def batches(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        return self.batch_routes[first:last], self.batch_starts[first:last]

    def rows(self, route: int, positions: np.ndarray) -> np.ndarray:
        return self.orders[route][positions]

    def batch_of(self, route: int, row: int) -> int:
        permuted = int(np.flatnonzero(self.orders[route] == row)[0])
        start = permuted - permuted % self.batch_size
        mine = (self.batch_routes == route) & (self.batch_starts == start)
        return int(np.flatnonzero(mine)[0])


# Keyed by the inputs the plan depends on only: a spec differing in world size, exclusions or
# events (a counterfactual replay) shares its permutations.
@functools.lru_cache(maxsize=4)
def epoch_plan(seed: int, batch_size: int, sizes: Sizes, epoch: int) -> EpochPlan:
    orders = tuple(_ranking(derive_seed(seed, epoch, route), rows) for route, rows in sizes)
    counts = batch_counts(batch_size, sizes)
    batch_routes = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    batch_starts = np.concatenate([np.arange(0, rows, batch_size, dtype=np.int64) for _, rows in sizes])
    shuffle = _ranking(derive_seed(seed, epoch), len(batch_routes))
    return EpochPlan(batch_size, orders, batch_routes[shuffle], batch_starts[shuffle])
