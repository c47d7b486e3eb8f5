"""Answers kept until what they read changes.

A lineage or influence answer aggregates thousands of ledger rows, yet changes only when someone
writes what it read. The query layer's ``StoreGeneration`` is a value that changes with every
commit anyone makes, read in microseconds; each cached answer also keeps the ``Topic``s it read
(``govray.queries.changes``: a trial, a checkpoint, a corpus...) with their stamps. When the
generation moves, the stamps of every cached topic are read once (a few grouped queries) and only
the answers whose stamps changed are dropped: a running trial committing metrics and checkpoints
every second leaves every other trial's lineage cached. An answer that names no topic
(``UNTRACKED``) is dropped at any commit.

Entries are keyed by the exact request (its raw path and query bytes: two requests share an
answer only if they are the same bytes). A store whose changes cannot be seen is not cached.

An answer of at least ``GZIP_MIN_BYTES`` is kept gzipped too, compressed once when it is computed:
a client that accepts gzip (every HTTP library does by default) gets an influence page of 140 KB
as about a tenth of that, and the app spends nothing per request on compressing it.
"""

from __future__ import annotations

import gzip
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from govray.queries import StoreGeneration
from govray.queries.changes import ANYTHING, UNTRACKED, Topic

MAX_CACHED_BYTES = 64 * 1024 * 1024
MAX_ENTRY_BYTES = 4 * 1024 * 1024
GZIP_MIN_BYTES = 1024  # smaller answers go as they are (gzip's header and CPU would not pay)

Reads = Callable[[Any], frozenset[Topic]]  # an answer → the topics it read
Stamps = Callable[[Iterable[Topic]], dict[Topic, Any]]  # StoreReader.stamps


def untracked(_: Any) -> frozenset[Topic]:
    return UNTRACKED


@dataclass(frozen=True)
class Body:
    """An answer's JSON, and the same gzipped (None: under ``GZIP_MIN_BYTES``)."""

    json: bytes
    gzipped: bytes | None

    @classmethod
    def of(cls, json: bytes) -> Body:
        small = len(json) < GZIP_MIN_BYTES
        return cls(json, None if small else gzip.compress(json, compresslevel=6, mtime=0))

    @property
    def size(self) -> int:
        return len(self.json) + len(self.gzipped or b"")


@dataclass(frozen=True)
class _Entry:
    body: Body
    stamps: dict[Topic, Any]  # the topics the answer read, as they were when it was computed


class ResponseCache:
    """JSON bodies by request key, each valid while what it read is unchanged, least recently used
    dropped first beyond ``max_bytes``. ``hits``, ``misses`` and ``dropped`` count what it did."""

    def __init__(
        self, generation: StoreGeneration, stamps: Stamps, max_bytes: int = MAX_CACHED_BYTES
    ) -> None:
        self.generation = generation
        self.stamps = stamps
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._catching_up = threading.Lock()  # one thread re-reads the stamps after a commit
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0
        self._seen: object | None = None  # the generation every entry is known valid at
        self.hits = 0
        self.misses = 0
        self.dropped = 0

    def peek(self, key: bytes) -> Body | None:
        """The cached answer for ``key`` if the store has not changed since the entries were last
        checked, else None (without reading the database: cheap enough for the event loop)."""
        seen = self.generation.current()
        with self._lock:
            if seen is None or seen != self._seen:
                return None
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry.body

    def body(
        self, key: bytes, answer: Callable[[], BaseModel], reads: Reads = untracked
    ) -> tuple[Body, bool]:
        """The JSON of ``answer()`` and whether it came from the cache; computed again only when
        something ``reads(answer)`` names has changed."""
        seen = self.generation.current()
        if seen is not None:
            self._catch_up(seen)
            with self._lock:
                entry = self._entries.get(key) if self._seen == seen else None
                if entry is not None:
                    self._entries.move_to_end(key)
                    self.hits += 1
                    return entry.body, True
        with self._lock:
            self.misses += 1
        model = answer()
        body = Body.of(model.model_dump_json().encode())
        if seen is None or len(body.json) > MAX_ENTRY_BYTES:
            return body, False
        topics = reads(model)
        stamped = {} if ANYTHING in topics else self.stamps(topics)
        if ANYTHING in topics:
            stamped[ANYTHING] = None
        if self.generation.current() != seen:
            return body, False  # a commit landed meanwhile: answer and stamps may disagree
        with self._lock:
            if self._seen == seen and key not in self._entries:
                self._entries[key] = _Entry(body, stamped)
                self._bytes += body.size
                while self._bytes > self.max_bytes:
                    _, dropped = self._entries.popitem(last=False)
                    self._bytes -= dropped.body.size
        return body, False

    def _catch_up(self, seen: object) -> None:
        """After commits (``seen`` is newer than the entries' generation): drop the entries whose
        stamps changed, keep the rest, valid at ``seen``."""
        with self._catching_up:
            with self._lock:
                if self._seen == seen:
                    return
                checked = dict(self._entries)
            topics = {topic for entry in checked.values() for topic in entry.stamps if topic != ANYTHING}
            now = self.stamps(topics) if topics else {}
            with self._lock:
                for key, entry in list(self._entries.items()):
                    # An entry stored while this ran was not checked: it goes too.
                    stale = checked.get(key) is not entry or any(
                        topic == ANYTHING or now.get(topic) != stamp for topic, stamp in entry.stamps.items()
                    )
                    if stale:
                        del self._entries[key]
                        self._bytes -= entry.body.size
                        self.dropped += 1
                self._seen = seen
