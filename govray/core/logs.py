"""A trial's worker logs: one append-only file per rank under ``STORAGE/logs/RUN_NAME/``.

Every line reads ``2026-11-22T00:01:02.123456Z rank0 | message``. The timestamp is UTC and fixed
width, so text order is time order and the ranks' files merge into one stream::

    with WorkerLog(log_path(storage, run_name, rank), rank) as log, log.capture():
        print("epoch 1 done")       # on the worker's stdout as before, and in rank-0.log

    read_logs(log_dir(storage, run_name))            # every rank, merged by timestamp
    for line in follow_logs(directory, done=lambda: trial_finished()):
        print(line)                                   # what is there, then what arrives

Workers write the files; the driver and the CLI only read them, so the logs need no tracking
store and survive a driver that died.
"""

from __future__ import annotations

import contextlib
import heapq
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO, cast

TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
TIMESTAMP_WIDTH = len("2026-11-22T00:01:02.123456Z")
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z")
_RANK_FILE = re.compile(r"rank-(\d+)\.log")


def log_dir(storage_path: str | Path, run_name: str) -> Path:
    """Where the workers of Ray run ``run_name`` write their logs: ``STORAGE/logs/RUN_NAME``."""
    return Path(storage_path) / "logs" / run_name


def log_path(storage_path: str | Path, run_name: str, rank: int) -> Path:
    """The log file of one rank: ``STORAGE/logs/RUN_NAME/rank-RANK.log``."""
    return log_dir(storage_path, run_name) / f"rank-{rank}.log"


class WorkerLog:
    """One rank's log file, opened for append (its directory is created).

    ``write`` is thread-safe and flushes, so a reader never waits on a buffer; each line of a
    message gets the same timestamp and lands in one write call.
    """

    def __init__(self, path: str | Path, rank: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, message: str) -> None:
        """Append one line per line of ``message`` (a trailing newline adds no empty line)."""
        stamp = datetime.now(UTC).strftime(TIMESTAMP_FORMAT)
        lines = message.removesuffix("\n").split("\n")
        text = "".join(f"{stamp} rank{self.rank} | {line}\n" for line in lines)
        with self._lock:
            self._file.write(text)
            self._file.flush()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Tee ``sys.stdout`` and ``sys.stderr`` into this log for the block.

        Writes still reach the original streams at once; the log gets whole lines, and a last
        line without its newline when the block ends. The original streams are back afterwards,
        also when the block raises. (Only writes through ``sys.stdout``/``sys.stderr`` are seen:
        a handler that kept a reference to the original stream bypasses the tee.)
        """
        tees = _LineTee(sys.stdout, self), _LineTee(sys.stderr, self)
        sys.stdout, sys.stderr = cast(TextIO, tees[0]), cast(TextIO, tees[1])
        try:
            yield
        finally:
            sys.stdout, sys.stderr = tees[0].stream, tees[1].stream
            for tee in tees:
                tee.close()

    def close(self) -> None:
        """Close the file; later writes raise ValueError."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> WorkerLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class _LineTee:
    """Stands in for a text stream: writes go through to it, whole lines also to a WorkerLog.

    Once closed it only passes writes through, so whatever kept it (a logging handler set up
    inside ``capture``, say) keeps working after the log file is closed.
    """

    def __init__(self, stream: TextIO, log: WorkerLog) -> None:
        self.stream = stream
        self._log: WorkerLog | None = log
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        with self._lock:  # held while logging too, so lines from several threads keep their order
            if self._log is not None:
                complete, newline, self._partial = (self._partial + text).rpartition("\n")
                if newline:
                    self._log.write(complete)
        return written

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        """Log a last line that never got its newline and stop logging; the stream stays open."""
        with self._lock:
            if self._log is not None and self._partial:
                self._log.write(self._partial)
            self._log, self._partial = None, ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)  # encoding, isatty, fileno, ... are the stream's


@dataclass
class _RankFile:
    """How far one rank's file has been read, and a last line still waiting for its newline."""

    path: Path
    rank: int
    offset: int = 0
    partial: bytes = field(default=b"", repr=False)

    def read_lines(self) -> list[str]:
        """The complete lines appended since the last call."""
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            chunk = handle.read()
        self.offset += len(chunk)
        *complete, self.partial = (self.partial + chunk).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in complete]

    def rest(self) -> list[str]:
        """The last line without its newline, if any (taken as final)."""
        rest, self.partial = self.partial, b""
        return [rest.decode("utf-8", errors="replace")] if rest else []


def _rank_files(directory: Path, known: dict[Path, _RankFile]) -> list[_RankFile]:
    """The directory's ``rank-N.log`` files by rank, reusing the read state of known ones."""
    if directory.is_dir():
        for path in directory.iterdir():
            match = _RANK_FILE.fullmatch(path.name)
            if match is not None and path not in known:
                known[path] = _RankFile(path, int(match.group(1)))
    return sorted(known.values(), key=lambda file: file.rank)


def _merged(per_rank: Iterable[list[str]]) -> list[str]:
    """Lines of several ranks (each in its file's order) merged by timestamp, ties by rank.

    A line without a timestamp of its own (written around the WorkerLog) takes its predecessor's,
    so it stays where it was in its file.
    """
    keyed = [list(_keyed(lines)) for lines in per_rank]
    return [line for _, line in heapq.merge(*keyed, key=lambda item: item[0])]


def _keyed(lines: list[str]) -> Iterator[tuple[str, str]]:
    stamp = ""
    for line in lines:
        if _TIMESTAMP.match(line):
            stamp = line[:TIMESTAMP_WIDTH]
        yield stamp, line


def read_logs(directory: str | Path) -> list[str]:
    """Every rank's lines (without newlines) merged in timestamp order, ties by rank.

    A last line still without its newline is included as it stands. No directory, no lines.
    """
    files = _rank_files(Path(directory), {})
    return _merged(file.read_lines() + file.rest() for file in files)


def follow_logs(
    directory: str | Path, done: Callable[[], bool], poll: float = 0.3, quiet: float = 1.0
) -> Iterator[str]:
    """Yield the lines there are, then lines as any rank appends them, until the writers are done.

    Every ``poll`` seconds new complete lines are read from each ``rank-N.log`` (also files that
    appear later) and yielded, those of one poll merged by timestamp. It ends once ``done()`` is
    true and nothing new has arrived for ``quiet`` seconds since (``done()`` is asked before each
    read, so a line written before it turned true is always yielded); last lines still without
    their newline are yielded then.
    """
    known: dict[Path, _RankFile] = {}
    last_news = time.monotonic()
    finished_since: float | None = None
    while True:
        finished = done()
        files = _rank_files(Path(directory), known)
        lines = _merged(file.read_lines() for file in files)
        yield from lines
        now = time.monotonic()
        if lines:
            last_news = now
        if not finished:
            finished_since = None  # a paused trial that resumed writes again
        elif finished_since is None:
            finished_since = now
        elif now - max(last_news, finished_since) >= quiet:
            yield from _merged(file.rest() for file in files)
            return
        time.sleep(poll)
