"""Keys and keyed permutations: the randomness of the schedule, the same in every process.

``derive_seed`` turns any parts (a seed, an epoch, a route's name) into a 64-bit key by sha256, so
it never depends on ``hash()``, the platform or the numpy version. ``KeyedPermutation`` is a
bijection on ``[0, n)`` chosen by a key, evaluated index by index in O(1) memory and O(1) expected
time, with an exact inverse: a balanced Feistel network on the smallest even bit width covering
``n`` whose outputs outside ``[0, n)`` walk the cycle on until they land inside (cycle-walking).
Its round function is a splitmix64 finalizer of the right half xored with a round key; all of it
is numpy ``uint64`` arithmetic (wrap-around multiplication), vectorized over the indexes. That numpy
code is the definition; the compiled kernel ``govray/data/_feistel.c`` computes the same values,
each index walking its cycle to the end in one loop, wherever the install built it.

Example::

    order = KeyedPermutation(derive_seed(7, 0, "public"), 10**9)
    rows = order.forward(np.arange(32))        # the first 32 rows of the permuted route
    assert (order.inverse(rows) == np.arange(32)).all()
"""

from __future__ import annotations

import hashlib

import numpy as np

from govray.core.canonical import canonical_json
from govray.core.errors import GovrayError

try:  # the compiled kernel (pyproject.toml's ext-modules); optional
    from govray.data import _feistel
except ImportError:  # pragma: no cover - where no C compiler built it
    _feistel = None  # type: ignore[assignment]

ROUNDS = 6  # Luby-Rackoff: 4 rounds make a strong pseudorandom permutation; 2 more for margin
MAX_DOMAIN = 2**62

_U64 = np.uint64
_MIX_1 = _U64(0xBF58476D1CE4E5B9)
_MIX_2 = _U64(0x94D049BB133111EB)


def derive_seed(*parts: int | str) -> int:
    """A 64-bit seed from ``parts`` (sha256 of their canonical JSON): the same in every process, and
    accepted by both ``numpy`` and ``torch.manual_seed``.

    >>> derive_seed(7, 0, "public") == derive_seed(7, 0, "public") != derive_seed(7, 1, "public")
    True
    """
    return int.from_bytes(hashlib.sha256(canonical_json(["govray", *parts])).digest()[:8], "big")


class KeyedPermutation:
    """A bijection on ``[0, n)`` chosen by ``key``; ``forward`` and ``inverse`` map index arrays.

    >>> order = KeyedPermutation(key=5, n=10)
    >>> sorted(order.forward(np.arange(10)).tolist()) == list(range(10))
    True
    """

    def __init__(self, key: int, n: int) -> None:
        if not 1 <= n <= MAX_DOMAIN:
            raise GovrayError(f"a keyed permutation needs 1 <= n <= 2**62, not {n}")
        self.key, self.n = key, n
        half = max(1, ((n - 1).bit_length() + 1) // 2)  # 2 * half bits cover n; at least 2 bits
        self._half = _U64(half)
        self._mask = _U64((1 << half) - 1)
        self._drop = _U64(64 - half)  # the round function keeps its output's top ``half`` bits
        self._keys = tuple(_U64(derive_seed(key, "feistel", round)) for round in range(ROUNDS))
        self._kernel_args = (tuple(int(round_key) for round_key in self._keys), half, n)  # the kernel's

    def __repr__(self) -> str:
        return f"KeyedPermutation(key={self.key}, n={self.n})"

    def forward(self, indexes: np.ndarray) -> np.ndarray:
        """The image of each index in ``[0, n)`` (an int64 array of ``indexes``' shape)."""
        return self._walk(indexes, inverse=False)

    def inverse(self, images: np.ndarray) -> np.ndarray:
        """The index whose image is each of ``images``: ``inverse(forward(x)) == x``."""
        return self._walk(images, inverse=True)

    def _walk(self, values: np.ndarray, *, inverse: bool, compiled: bool = True) -> np.ndarray:
        """Apply the Feistel permutation (or its inverse) until every value lies in ``[0, n)``:
        since it starts there, each walk stays on its own cycle, so this is a bijection of
        ``[0, n)``. ``compiled=False``: numpy's definition even where the kernel was built."""
        start = np.ascontiguousarray(values, dtype=np.int64)
        if start.size and (start.min() < 0 or start.max() >= self.n):
            raise GovrayError(f"index outside [0, {self.n}) given to {self!r}")
        if compiled and _feistel is not None:
            images = np.empty_like(start)
            _feistel.walk(start, images, *self._kernel_args, inverse)
            return images
        step = self._decrypt if inverse else self._encrypt
        result = step(start.ravel().astype(_U64))  # flat: the walk indexes what is still outside
        outside = np.flatnonzero(result >= _U64(self.n))
        while outside.size:  # expected < 4 walks: the domain is less than 4n
            result[outside] = step(result[outside])
            outside = outside[result[outside] >= _U64(self.n)]
        return result.astype(np.int64).reshape(start.shape)

    def _round(self, index: int, right: np.ndarray) -> np.ndarray:
        mixed = right ^ self._keys[index]
        mixed = (mixed ^ (mixed >> _U64(30))) * _MIX_1
        mixed = (mixed ^ (mixed >> _U64(27))) * _MIX_2
        return (mixed ^ (mixed >> _U64(31))) >> self._drop

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self._half, values & self._mask
        for index in range(ROUNDS):
            left, right = right, left ^ self._round(index, right)
        return (left << self._half) | right

    def _decrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self._half, values & self._mask
        for index in reversed(range(ROUNDS)):
            left, right = right ^ self._round(index, left), left
        return (left << self._half) | right
