"""The default tier's time budget, enforced: a marker-less test slower than its budget fails.

The default tier (``python -m pytest``) must stay a few minutes on a 2-core machine. A test that
grows past ``TEST_BUDGET_S`` of its own time (its call plus the setup of its function-scoped
fixtures) fails with what to do about it; a fixture shared by several tests (module or session
scope: the golden runs, Ray itself) has ``SHARED_BUDGET_S``, charged to the marker-less test that
first set it up. Tests marked ``slow``, ``cluster`` or ``gpu`` belong to the other tiers and have
no budget here. pytest's ``--durations`` report (in ``addopts``) shows where the time goes.

The hooks are imported into ``tests/conftest.py``, which is how pytest finds them.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import pytest

TEST_BUDGET_S = 40.0
SHARED_BUDGET_S = 100.0
TIER_MARKERS = frozenset({"slow", "cluster", "gpu"})

_OWN_SETUP = pytest.StashKey[float]()  # seconds spent setting up an item's function-scoped fixtures
_SHARED_SETUP = pytest.StashKey[list[tuple[str, float]]]()  # (fixture, seconds) it set up for others


def budgeted(item: pytest.Item) -> bool:
    """Whether ``item`` is in the default tier (no tier marker), so its time is budgeted."""
    return all(item.get_closest_marker(name) is None for name in TIER_MARKERS)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, Any, Any]:
    started = time.perf_counter()
    try:
        return (yield)
    finally:
        spent = time.perf_counter() - started
        item = getattr(request, "_pyfuncitem", None)  # the test whose setup needed this fixture
        if item is not None:
            if fixturedef.scope == "function":
                item.stash[_OWN_SETUP] = item.stash.get(_OWN_SETUP, 0.0) + spent
            else:
                item.stash.setdefault(_SHARED_SETUP, []).append((fixturedef.argname, spent))


def over_budget(item: pytest.Item, call_seconds: float) -> list[str]:
    """Why ``item``'s time breaks the default tier's budget (empty: it does not)."""
    if not budgeted(item):
        return []
    reasons = []
    own = call_seconds + item.stash.get(_OWN_SETUP, 0.0)
    if own > TEST_BUDGET_S:
        reasons.append(
            f"{item.nodeid} took {own:.1f} s (call and function-scoped fixtures), over the default "
            f"tier's {TEST_BUDGET_S:.0f} s per test"
        )
    for fixture, seconds in item.stash.get(_SHARED_SETUP, []):
        if seconds > SHARED_BUDGET_S:
            reasons.append(
                f"shared fixture '{fixture}' took {seconds:.1f} s to set up, over the default tier's "
                f"{SHARED_BUDGET_S:.0f} s per shared fixture"
            )
    return reasons


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report: pytest.TestReport = yield
    if call.when == "call" and report.passed:
        reasons = over_budget(item, call.duration)
        if reasons:
            report.outcome = "failed"
            report.longrepr = (
                "\n".join(reasons) + "\nMake it faster (share a golden run, run in-process instead of "
                "on Ray), or move it to a tier: @pytest.mark.slow (or cluster). See README, 'Tests'."
            )
    return report
