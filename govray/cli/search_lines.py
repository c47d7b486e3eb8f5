"""How ``govray search`` shows a running search where no terminal redraws its panel (ray job
logs, CI): the search's state (``govray.platform.search.progress.SearchState``) in one line, printed
when it changed, at most every few seconds::

    search 3/3 trials · 0 running · 1 completed · 2 stopped early · best validation_loss 2.3054 (trial 1)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from govray.platform.search.progress import ENDED, SearchState


def progress_counts(state: SearchState) -> str:
    """``search 3/4 trials · 1 running · 2 completed · 1 stopped early``: trials ended of planned."""
    parts = [f"search {state.count(*ENDED)}/{state.planned} trials", f"{state.count('running')} running"]
    parts += [f"{state.count(status)} {status}" for status in ENDED if state.count(status)]
    return " · ".join(parts)


def progress_best(state: SearchState) -> str:
    """``best validation_loss+0.1·mem 0.2143 (trial 2)``, or "" before any objective."""
    if state.best is None:
        return ""
    value, number = state.best
    return f"best {state.objective} {value:.4f} (trial {number})"


def progress_rungs(state: SearchState) -> str:
    """``rung 2: trial 7; rung 1: trials 9, 10``: where the running trials are, highest rung first."""
    by_rung: dict[int, list[int]] = {}
    for trial in state.running:
        by_rung.setdefault(trial.rung, []).append(trial.number)
    return "; ".join(
        f"rung {rung}: trial{'s' if len(numbers) > 1 else ''} {', '.join(map(str, sorted(numbers)))}"
        for rung, numbers in sorted(by_rung.items(), reverse=True)
    )


def progress_line(state: SearchState) -> str:
    """The state in one plain line: counts, the best so far, where the running trials are."""
    parts = (progress_counts(state), progress_best(state), progress_rungs(state))
    return " · ".join(part for part in parts if part)


class LinePrinter:
    """Where no terminal redraws a view: prints the state's line when it changed, at most every
    ``interval`` seconds, and a search's end at once; ``flush`` prints a line still held back."""

    def __init__(
        self,
        write: Callable[[str], None],
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.write = write
        self.interval = interval
        self.clock = clock
        self.printed = ""
        self.printed_at: float | None = None
        self.held = ""

    def show(self, state: SearchState) -> None:
        line = progress_line(state)
        over = state.planned > 0 and state.count(*ENDED) >= state.planned
        now = self.clock()
        if over or self.printed_at is None or now - self.printed_at >= self.interval:
            self._print(line, now)
        else:
            self.held = line

    def flush(self) -> None:
        if self.held:
            self._print(self.held, self.clock())

    def _print(self, line: str, now: float) -> None:
        self.held = ""
        if line != self.printed:
            self.write(line)
            self.printed, self.printed_at = line, now
