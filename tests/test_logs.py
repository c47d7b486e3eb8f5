"""Promises of worker logs: one fixed-format line per message line, stdout and stderr teed without
being taken from the worker, ranks merged by time, and following them misses nothing."""

from __future__ import annotations

import sys
import threading
import time
from datetime import UTC, datetime, tzinfo
from pathlib import Path

import pytest

from govray.core import logs
from govray.core.logs import WorkerLog, follow_logs, log_dir, log_path, read_logs

MOMENT = datetime(2026, 11, 22, 0, 1, 2, 123456, tzinfo=UTC)


class FrozenClock(datetime):
    @classmethod
    def now(cls, tz: tzinfo | None = None) -> FrozenClock:
        return cls.fromtimestamp(MOMENT.timestamp(), tz)


def message(line: str) -> str:
    """The message part of a log line."""
    return line.split(" | ", 1)[1]


def stamped(second: int, rank: int, text: str) -> str:
    return f"2026-01-01T00:00:{second:02d}.000000Z rank{rank} | {text}"


def stamped_now(rank: int, text: str) -> str:
    return f"{datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%S.%fZ')} rank{rank} | {text}"


def test_log_files_live_under_storage_logs_run_name_one_per_rank() -> None:
    assert log_dir("/runs/storage", "digits-7") == Path("/runs/storage/logs/digits-7")
    assert log_path(Path("/runs/storage"), "digits-7", 3) == Path("/runs/storage/logs/digits-7/rank-3.log")


def test_each_message_line_becomes_one_timestamped_line_readable_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "datetime", FrozenClock)
    path = tmp_path / "deep" / "rank-3.log"
    log = WorkerLog(path, 3)
    log.write("epoch 1 done")
    log.write("two\nlines\n")
    log.write("")
    log.write("a\n\nb")

    assert path.read_text().splitlines() == [  # before close: every write is flushed
        "2026-11-22T00:01:02.123456Z rank3 | epoch 1 done",
        "2026-11-22T00:01:02.123456Z rank3 | two",
        "2026-11-22T00:01:02.123456Z rank3 | lines",
        "2026-11-22T00:01:02.123456Z rank3 | ",
        "2026-11-22T00:01:02.123456Z rank3 | a",
        "2026-11-22T00:01:02.123456Z rank3 | ",
        "2026-11-22T00:01:02.123456Z rank3 | b",
    ]
    log.close()
    with WorkerLog(path, 3) as again:
        again.write("resumed")
    assert path.read_text().splitlines()[-1] == "2026-11-22T00:01:02.123456Z rank3 | resumed"
    assert len(path.read_text().splitlines()) == 8


def test_the_timestamp_is_the_current_utc_time(tmp_path: Path) -> None:
    before = datetime.now(UTC)
    with WorkerLog(tmp_path / "rank-0.log", 0) as log:
        log.write("now")
    after = datetime.now(UTC)

    stamp = datetime.strptime((tmp_path / "rank-0.log").read_text()[:27], "%Y-%m-%dT%H:%M:%S.%fZ")
    assert before <= stamp.replace(tzinfo=UTC) <= after


def test_capture_tees_stdout_and_stderr_into_the_log_and_puts_them_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = sys.stdout, sys.stderr
    path = tmp_path / "rank-1.log"
    with WorkerLog(path, 1) as log:
        with log.capture():
            kept = sys.stdout  # as a logging handler set up inside the block would
            print("to stdout")
            print("to", "stderr", file=sys.stderr)
            sys.stdout.write("half a ")
            assert [message(line) for line in read_logs(tmp_path)] == ["to stdout", "to stderr"]
            sys.stdout.write("line\nno newline")
        assert (sys.stdout, sys.stderr) == original

        with pytest.raises(RuntimeError), log.capture():
            print("before the crash")
            raise RuntimeError("boom")
        assert (sys.stdout, sys.stderr) == original
        print("not captured")
    kept.write("kept stream, log closed\n")

    out, err = capsys.readouterr()
    assert (
        out == "to stdout\nhalf a line\nno newlinebefore the crash\nnot captured\nkept stream, log closed\n"
    )
    assert err == "to stderr\n"
    assert [message(line) for line in path.read_text().splitlines()] == [
        "to stdout",
        "to stderr",
        "half a line",
        "no newline",
        "before the crash",
    ]


def test_ranks_merge_by_timestamp_with_ties_in_rank_order(tmp_path: Path) -> None:
    (tmp_path / "rank-0.log").write_text(
        f"{stamped(1, 0, 'a')}\n{stamped(3, 0, 'c')}\nTraceback: a line without a timestamp\n"
    )
    (tmp_path / "rank-1.log").write_text(
        f"{stamped(2, 1, 'b')}\n{stamped(3, 1, 'c')}\n{stamped(4, 1, 'no newline yet')}"
    )
    (tmp_path / "rank-10.log").write_text(f"{stamped(3, 10, 'c')}\n")
    (tmp_path / "rank-2.log").write_text(f"{stamped(3, 2, 'c')}\n{stamped(3, 2, 'c again')}\n")
    (tmp_path / "notes.txt").write_text("not a rank's log\n")
    (tmp_path / "rank-x.log").write_text("not a rank's log either\n")

    assert read_logs(tmp_path) == [
        stamped(1, 0, "a"),
        stamped(2, 1, "b"),
        stamped(3, 0, "c"),
        "Traceback: a line without a timestamp",
        stamped(3, 1, "c"),
        stamped(3, 2, "c"),
        stamped(3, 2, "c again"),
        stamped(3, 10, "c"),
        stamped(4, 1, "no newline yet"),
    ]
    assert read_logs(tmp_path / "missing") == []


def test_follow_yields_what_is_there_then_every_appended_line_until_done_and_quiet(tmp_path: Path) -> None:
    directory = tmp_path / "logs" / "run"
    rank0 = WorkerLog(directory / "rank-0.log", 0)
    rank0.write("before following")
    finished = threading.Event()
    finished_at: list[float] = []

    def workers() -> None:
        time.sleep(0.2)
        rank0.write("rank 0 step 1")
        time.sleep(0.5)  # longer than `quiet`: not done yet, so following goes on
        with WorkerLog(directory / "rank-1.log", 1) as rank1:  # a file that appears later
            rank1.write("rank 1 step 1")
        with (directory / "rank-0.log").open("a") as raw:
            raw.write(stamped_now(0, "half"))
            raw.flush()
            time.sleep(0.3)  # several polls see the half line
            raw.write(" and the rest\n")
        rank0.write("last words")
        rank0.close()
        with (directory / "rank-1.log").open("a") as raw:
            raw.write(stamped_now(1, "cut off, no newline ever"))
        finished_at.append(time.monotonic())
        finished.set()

    writer = threading.Thread(target=workers)
    writer.start()
    received = list(follow_logs(directory, done=finished.is_set, poll=0.05, quiet=0.3))
    ended_at = time.monotonic()
    writer.join()

    assert [message(line) for line in received] == [
        "before following",
        "rank 0 step 1",
        "rank 1 step 1",
        "half and the rest",
        "last words",
        "cut off, no newline ever",
    ]
    assert 0.3 <= ended_at - finished_at[0] < 2.0


def test_follow_ends_after_quiet_when_already_done(tmp_path: Path) -> None:
    (tmp_path / "rank-0.log").write_text(f"{stamped(1, 0, 'only line')}\n")
    started = time.monotonic()

    assert list(follow_logs(tmp_path, done=lambda: True, poll=0.05, quiet=0.2)) == [
        stamped(1, 0, "only line")
    ]
    assert 0.2 <= time.monotonic() - started < 1.5
