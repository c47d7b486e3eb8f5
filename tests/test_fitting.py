"""``fit_polled``: the one way the driver fits a Ray Train run it watches (a run's driver, a search
trial's Tune actor). What each relies on: a last look after the fit ended, the fit's own error, and
an abandoned fit ended by the caller."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from govray.platform.run.fitting import fit_polled, pass_request


def test_the_last_look_comes_after_the_fit_ended_and_its_result_is_returned() -> None:
    """The driver records every report: a look runs once the fit has returned."""
    returned = threading.Event()
    looked_after: list[bool] = []

    def fit() -> str:
        return "result"

    def look() -> None:
        looked_after.append(returned.is_set())

    def marked_fit() -> str:
        try:
            return fit()
        finally:
            returned.set()

    assert fit_polled(marked_fit, look, period=0.01, name="test-fit") == "result"
    assert looked_after[-1] is True


def test_a_look_sees_what_the_fit_did_last() -> None:
    done: list[str] = []
    seen: list[list[str]] = []

    def fit() -> int:
        done.append("last report")
        return 7

    assert fit_polled(fit, lambda: seen.append(list(done)), period=0.01, name="test-fit") == 7
    assert seen[-1] == ["last report"]


def test_the_fits_error_is_raised_in_the_callers_thread() -> None:
    def fit() -> None:
        raise ValueError("worker failed")

    with pytest.raises(ValueError, match="worker failed"):
        fit_polled(fit, lambda: None, period=0.01, name="test-fit")


def test_a_look_that_raises_abandons_the_fit_that_still_runs() -> None:
    """Tune stopped the trial (``ray.tune.report`` raised ``SystemExit`` in a look): the caller's
    ``abandon`` runs while the fit is still running, and the exception goes on."""
    release = threading.Event()
    abandoned: list[bool] = []

    def fit() -> None:
        release.wait(timeout=5)

    def look() -> None:
        raise SystemExit(0)

    def abandon() -> None:
        abandoned.append(not release.is_set())
        release.set()

    with pytest.raises(SystemExit):
        fit_polled(fit, look, period=0.01, name="test-fit", abandon=abandon)
    assert abandoned == [True]


def test_a_request_is_written_whole_where_rank_0_reads_it(tmp_path: Path) -> None:
    control = tmp_path / "control" / "run-a"
    pass_request(control, "pause")
    assert control.read_text() == "pause"
    pass_request(control, "kill")
    assert control.read_text() == "kill" and sorted(p.name for p in control.parent.iterdir()) == ["run-a"]


def test_a_last_look_that_fails_after_the_fit_failed_does_not_hide_the_fits_error() -> None:
    """The worker's failure is what the run reports, not a recording hiccup after it."""

    def fit() -> None:
        raise ValueError("worker failed")

    def look() -> None:
        raise ConnectionError("the sink is gone")

    with pytest.raises(ValueError, match="worker failed"):
        fit_polled(fit, look, period=0.01, name="test-fit")


def test_a_last_look_that_fails_after_the_fit_succeeded_is_raised() -> None:
    """A run whose last reports could not be recorded is not reported as done."""
    calls: list[int] = []

    def look() -> None:
        calls.append(1)
        raise ConnectionError("the store is gone")

    with pytest.raises(ConnectionError, match="the store is gone"):
        fit_polled(lambda: 1, look, period=0.01, name="test-fit")
    assert calls == [1]
