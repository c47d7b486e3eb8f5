"""Answers kept until the tracking store changes.

A lineage or influence answer aggregates thousands of ledger rows, yet changes only when someone
writes to the store. The query layer's ``StoreGeneration`` is a value that changes with every
commit anyone makes, read in microseconds; ``ResponseCache`` keeps JSON bodies keyed by the exact
request (its raw path and query bytes: two requests share an answer only if they are the same
bytes) and drops them all when the generation moves. A store whose changes cannot be seen this way
is not cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from pydantic import BaseModel

from govray.queries import StoreGeneration

MAX_CACHED_BYTES = 64 * 1024 * 1024
MAX_ENTRY_BYTES = 4 * 1024 * 1024


class ResponseCache:
    """JSON bodies by request key, valid for one store generation, least recently used dropped
    first beyond ``max_bytes``."""

    def __init__(self, generation: StoreGeneration, max_bytes: int = MAX_CACHED_BYTES) -> None:
        self.generation = generation
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._seen: object | None = None
        self.hits = 0
        self.misses = 0

    def peek(self, key: bytes) -> bytes | None:
        """The cached answer for ``key`` if the store has not changed since it was computed, else
        None (without computing anything: cheap enough for the event loop)."""
        seen = self.generation.current()
        with self._lock:
            if seen is None or seen != self._seen:
                return None
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return cached

    def body(self, key: bytes, answer: Callable[[], BaseModel]) -> bytes:
        """The JSON of ``answer()``, computed at most once per store generation."""
        seen = self.generation.current()
        with self._lock:
            if seen is None or seen != self._seen:
                self._entries.clear()
                self._bytes, self._seen = 0, seen
            elif (cached := self._entries.get(key)) is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return cached
            self.misses += 1
        body = answer().model_dump_json().encode()
        if seen is None or len(body) > MAX_ENTRY_BYTES:
            return body
        with self._lock:
            if self._seen == seen and key not in self._entries:  # the store did not move meanwhile
                self._entries[key] = body
                self._bytes += len(body)
                while self._bytes > self.max_bytes:
                    _, dropped = self._entries.popitem(last=False)
                    self._bytes -= len(dropped)
        return body
