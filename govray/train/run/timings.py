"""Where a worker's wall time went, as one line of its log when the run ends.

The loop times its parts (opening the session, building the ``GovernedStep``, the first step, the
other steps, each validation, each checkpoint, each report) with two clock reads per part, and
writes them once::

    2026-11-25T21:50:01.000000Z rank0 | timings {"build": [0.41], "checkpoint": [0.05, ...], ...}

``jobs/benchmarks/trial_cost.py`` reads that line (``read_timings``) to say what a trial costs
besides its training. Nothing depends on it: a run without it is a run.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

TIMINGS_PREFIX = "timings "


class WorkerTimings:
    """Seconds per named part, in the order they happened; ``process_age`` is how long this
    process had lived when the worker began (a fresh Tune actor: its start and imports)."""

    def __init__(self) -> None:
        self.began = time.time()
        self.process_age = self.began - psutil.Process().create_time()
        self.parts: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.parts.setdefault(name, []).append(seconds)

    def line(self) -> str:
        """The log line: the parts, this process's age when the worker began, and its start time."""
        shown = {name: [round(s, 6) for s in seconds] for name, seconds in self.parts.items()}
        return TIMINGS_PREFIX + json.dumps(
            {"began": self.began, "process_age": round(self.process_age, 6), "parts": shown}, sort_keys=True
        )


def read_timings(log: Path) -> dict[str, object] | None:
    """The timings line of a rank's log (the last one: a resumed run writes one per attempt)."""
    found = None
    for line in log.read_text(encoding="utf-8").splitlines():
        _, _, message = line.partition(" | ")
        if message.startswith(TIMINGS_PREFIX):
            found = json.loads(message.removeprefix(TIMINGS_PREFIX))
    return found
