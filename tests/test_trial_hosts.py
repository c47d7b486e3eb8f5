"""Warm trial hosts: a 1-worker CPU search trial trains in a host the job keeps from search to
search, with the same weights as in a fresh host and as in its own Tune actor; the pool lends a
host to one trial at a time, for one code snapshot, and kills hosts it can no longer trust."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from govray.config.experiment import load_experiment
from govray.platform.search.hosts import TrialHosts, retire_trial_hosts, trial_hosts
from govray.tracking.store import TrackingStore
from tests.helpers.search import final_model, grid_of_lrs, searched_from


def _hosts(pool: Any) -> list[dict[str, Any]]:
    import ray

    return sorted(ray.get(pool.hosts.remote()), key=lambda host: host["number"])


def _gone(pool: Any, numbers: set[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while {h["number"] for h in _hosts(pool)} & numbers:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def test_the_pool_lends_a_host_once_per_code_and_kills_those_it_cannot_trust(ray_session: None) -> None:
    """Lease, reuse, a stale release, code change, failure, a dead Tune trial (before its trial
    ever ran, and after it failed) and idleness, on a pool of its own (idle hosts exit after 1 s)."""
    import ray

    pool = ray.remote(TrialHosts).options(num_cpus=0, max_concurrency=8).remote(1.0)
    node = ray.get_runtime_context().get_node_id()
    alive = pool._actor_id.hex()  # a lessee that stays alive while the test runs: the pool itself
    dead = "ff" * 16  # a Tune trial the actor table never knew

    def lease(code: str, lessee: str, name: str) -> tuple[int, Any]:
        return ray.get(pool.lease.remote(node, code, lessee, name))  # type: ignore[no-any-return]

    def freed(number: int, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(h["number"] == number and not h["leased"] for h in _hosts(pool)):
                return True
            time.sleep(0.5)
        return False

    try:
        first, host = lease("a", alive, "l1")
        second, _ = lease("a", alive, "l2")
        assert first != second  # a leased host is nobody else's
        assert [h["leased"] for h in _hosts(pool)] == [True, True]
        ray.get(pool.release.remote("l1", True))
        again, same = lease("a", alive, "l3")
        assert again == first and ray.get(same.state.remote())["pid"] == ray.get(host.state.remote())["pid"]
        ray.get(pool.release.remote("l1", True))  # stale: l3 holds the host now
        assert [h["leased"] for h in _hosts(pool)] == [True, True]
        ray.get([pool.release.remote("l3", True), pool.release.remote("l2", True)])
        # Changed code: a fresh host, and the free hosts of the old code go.
        changed, _ = lease("b", alive, "l4")
        assert changed not in (first, second)
        assert [(h["number"], h["code"]) for h in _hosts(pool)] == [(changed, "b")]
        ray.get(pool.release.remote("l4", False))  # its trial failed: never reused
        assert _hosts(pool) == []
        # A Tune trial that died before its host began: the host is freed, and the lease's run,
        # however late it arrives, never starts.
        orphan, orphan_host = lease("b", dead, "l5")
        assert freed(orphan)
        ray.get(orphan_host.run.remote("l5", {}, None, "t", None, None))
        assert ray.get(orphan_host.next.remote("l5")) is None
        assert ray.get(orphan_host.state.remote())["trained"] == 0
        # A trial that failed on a host whose Tune trial died: the host is killed, not freed.
        failing, failing_host = lease("b", dead, "l6")
        assert failing == orphan
        with pytest.raises(ray.exceptions.RayTaskError):
            ray.get(failing_host.run.remote("l6", {}, None, "t", None, None))  # no setup: it raises
        assert _gone(pool, {failing})
        idle, _ = lease("b", alive, "l7")
        ray.get(pool.release.remote("l7", True))
        assert _gone(pool, {idle})
    finally:
        ray.kill(pool)


@pytest.mark.slow  # three whole Ray Tune searches: the slow tier
def test_a_later_search_trains_in_the_warm_hosts_with_the_same_weights(
    ray_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grid search of two points trains both in trial hosts; a later search of the second point
    alone trains it in one of those same processes (no host started), and its final weights are
    the first search's for that point, and those of the point trained in its Tune actor
    (``GOVRAY_TRIAL_HOSTS=0``), which leaves the hosts untouched."""
    retire_trial_hosts()
    both, store, _ = searched_from(grid_of_lrs(tmp_path / "both", [0.1, 0.01]))
    pool = trial_hosts()
    warmed = _hosts(pool)
    assert len(both.trial_ids) == 2 and sum(h["trained"] for h in warmed) == 2, warmed
    second = max(both.trial_ids)

    alone, alone_store, _ = searched_from(grid_of_lrs(tmp_path / "alone", [0.01]))
    after = _hosts(pool)
    assert [(h["number"], h["pid"]) for h in after] == [(h["number"], h["pid"]) for h in warmed]
    assert sum(h["trained"] for h in after) == 3, after

    monkeypatch.setenv("GOVRAY_TRIAL_HOSTS", "0")
    in_place, in_place_store, _ = searched_from(grid_of_lrs(tmp_path / "in-place", [0.01]))
    assert _hosts(pool) == after
    monkeypatch.delenv("GOVRAY_TRIAL_HOSTS")

    # The CPUs the Tune trial holds decide the host's torch threads, as in the Tune trial itself.
    two_cpus = grid_of_lrs(tmp_path / "two-cpus", [0.01])
    raw = yaml.safe_load(two_cpus.read_text())
    raw["resources"]["cpus_per_worker"] = 2
    two_cpus.write_text(yaml.safe_dump(raw, sort_keys=False))
    searched_from(two_cpus)
    threads = {h["torch_threads"] for h in _hosts(pool) if h["trained"] > max(w["trained"] for w in after)}
    assert threads == {2}, _hosts(pool)

    weights = final_model(store, second)
    assert final_model(alone_store, alone.trial_ids[0]) == weights
    assert final_model(in_place_store, in_place.trial_ids[0]) == weights


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
def test_a_trial_that_fails_in_its_host_errors_with_its_cause_and_the_host_goes(
    ray_session: None, tmp_path: Path
) -> None:
    """A hosted trial whose learning rate makes its gradients non-finite: Tune's error for the
    trial is govray's ``NonFiniteGradientError`` with the host's traceback, the trial is recorded
    errored, the search ends without a usable trial, and the host that failed is killed."""
    from govray.platform.search.tune_trial import SearchError
    from govray.tracking.tables import TrialState

    retire_trial_hosts()
    path = grid_of_lrs(tmp_path, [1e30])
    with pytest.raises(SearchError, match="without any trial reporting an objective"):
        searched_from(path)
    store = TrackingStore.open(load_experiment(path).database_url)
    (trial,) = store.list_trials(1)
    assert trial.state == TrialState.ERRORED
    (error,) = (tmp_path / "storage").rglob("error.txt")
    text = error.read_text()
    assert "NonFiniteGradientError: step 1: non-finite gradient" in text and "TrialHost.run" in text, text
    assert _hosts(trial_hosts()) == []
