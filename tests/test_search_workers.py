"""An N-worker search trial keeps its Ray Train workers across rungs (one run per Tune trial), a
trial Tune stops leaves no placement group behind, and a 1-worker search reuses Tune's actors
without changing what any trial trains."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from govray.config.experiment import load_experiment
from govray.core.keys import platform_key, platform_trust
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.run.runner import run_trial
from govray.platform.search.placement_guard import (
    REMOVED,
    PlacementGuard,
    actor_dead,
    held_groups,
    live_controllers,
    orphaned_groups,
    result_places,
)
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import find_checkpoints, model_file
from tests.helpers.search import final_model, grid_of_lrs, search_example, searched_from
from tests.helpers.search_replays import assert_removal_equals_replay, replayed_without_writers
from tests.helpers.train_controller import train_controller


def _tune_results(search_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every Tune result of every trial, by Tune trial id (from Tune's own ``result.json``)."""
    results: dict[str, list[dict[str, Any]]] = {}
    for path in search_dir.glob("*/result.json"):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for result in lines:
            results.setdefault(result["trial_id"], []).append(result)
    return results


@pytest.mark.slow  # a whole Ray Tune search of 2-worker trials: the slow tier
def test_asha_trials_keep_their_workers_and_a_stopped_trial_frees_its_placement_group(
    ray_session: None, tmp_path: Path
) -> None:
    """Three 2-worker ASHA trials with rungs at steps 10 and 20: a trial that survives the first
    rung reports the same worker PIDs and placement group at both (one Ray Train run); every
    placement group a trial's workers ran in is REMOVED once the search is over (a stopped
    trial's too: Ray alone would keep it until the driver exits); and the survivor's final weights
    are bit-identical to ``govray run``'s continuous run of its hyperparameters."""
    import ray

    searcher = {"name": "asha", "max_trials": 3, "divisor": 2, "max_rungs": 2, "max_length": {"batches": 20}}
    path = search_example(tmp_path / "search", searcher, workers=2)
    outcome, store, search_dir = searched_from(path)
    results = _tune_results(search_dir)
    last = {t: store.metrics(t, "objective")[-1].step for t in outcome.trial_ids}
    assert sorted(last.values())[0] == 10 and sorted(last.values())[-1] == 20, last  # stopped and survived
    survivors = [r for r in results.values() if r[-1]["step"] == 20]
    stopped = [r for r in results.values() if r[-1]["step"] == 10]
    assert survivors and stopped, {t: [r["step"] for r in rs] for t, rs in results.items()}
    for trial in survivors:
        rung, end = (result_places(result) for result in trial)
        assert set(rung) == {0, 1} and rung == end, (rung, end)  # the same processes, the same group
    groups = {
        place["placement_group"]
        for trial in results.values()
        for r in trial
        for place in result_places(r).values()
    }
    assert len(groups) == len(results) and "" not in groups  # one group per trial
    table = ray.util.placement_group_table()
    assert {group: table[group]["state"] for group in groups} == dict.fromkeys(groups, REMOVED)
    # The search returned with none of its runs alive: no Train controller (one between two worker
    # groups holds no group yet, but would make one and wait for CPUs the next run needs) and no
    # group of this job, named in a result or not.
    assert live_controllers() == set() and held_groups() == []
    # The survivor's weights: those of the same trial trained by `govray run` (one worker group).
    [survivor] = [t for t, step in last.items() if step == 20][:1]
    hparams = json.loads(store.get_trial(survivor).hparams_json)
    alone = search_example(tmp_path / "alone", searcher, workers=2)
    raw = yaml.safe_load(alone.read_text())
    raw["min_validation_period"] = 10  # the search's rungs
    alone.write_text(yaml.safe_dump(raw, sort_keys=False))
    config = load_experiment(alone)
    alone_store = TrackingStore.open(config.database_url)
    checked = check_policy(config, alone_store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, alone_store)
    run = run_trial(config, checked, experiment, ingested.root, alone_store, hparams=hparams, report_every=5)
    assert model_file(find_checkpoints(run.run_dir)[-1]).read_bytes() == final_model(store, survivor)
    # `govray replay --trial` of the survivor and of a stopped trial without the PII corpus, on
    # 2 workers as they trained: removal = replay, bit for bit, the stopped one's to step 10.
    trust = platform_trust(platform_key())
    [stopped_trial] = [t for t, step in last.items() if step == 10][:1]
    for trial_id in (survivor, stopped_trial):
        report = replayed_without_writers(store, trial_id)
        assert_removal_equals_replay(store, trust, report, stopped_at=last[trial_id])


def test_the_placement_guard_removes_only_groups_ray_has_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's guard: a trial's earlier runs' groups go when a later run reports, every group
    of a trial that stopped running goes, and a group Ray removed already is left alone."""
    import ray

    def group(name: str) -> str:  # a placement group id: 18 bytes, in hex
        return name.ljust(36, "0")

    table = {group("a1"): "CREATED", group("a2"): "CREATED", group("b1"): REMOVED, group("c1"): "CREATED"}
    removed: list[str] = []
    monkeypatch.setattr(
        ray.util, "placement_group_table", lambda: {g: {"state": s} for g, s in table.items()}
    )
    monkeypatch.setattr(ray.util, "remove_placement_group", lambda pg: removed.append(pg.id.hex()[:2]))

    def result(name: str) -> dict[str, str]:
        return {"govray_workers": json.dumps({"0": {"pid": 1, "placement_group": group(name)}})}

    guard = PlacementGuard()
    guard.note("a", result("a1"))
    guard.note("b", result("b1"))
    guard.note("c", result("c1"))
    guard.sweep(["a", "b", "c"])
    assert removed == []  # every trial runs in its group
    guard.note("a", result("a2"))  # a restored actor's run
    guard.sweep(["a", "b", "c"])
    assert removed == ["a1"] and guard.removed == [group("a1")]
    guard.sweep(["a", "c"])  # b paused: Ray had removed its group
    guard.release("c")
    guard.release_all()
    assert removed == ["a1", "c1", "a2"]


def _controller() -> Any:
    """An actor that creates a group as Ray Train's controller does, in its own process."""
    import ray
    from ray.util.placement_group import placement_group

    @ray.remote(num_cpus=0)
    class Controller:
        def create(self) -> str:
            group = placement_group([{"CPU": 0.5}])
            ray.get(group.ready())
            return str(group.id.hex())

    return Controller.remote()  # type: ignore[attr-defined]


def _orphan() -> str:
    """A group whose creator was killed, once the GCS calls it an orphan."""
    import ray

    controller = _controller()
    group = ray.get(controller.create.remote())
    ray.kill(controller)
    deadline = time.monotonic() + 30
    while group not in orphaned_groups() and time.monotonic() < deadline:
        time.sleep(0.1)
    return str(group)


def test_the_guard_removes_a_group_whose_creator_died_before_any_result_named_it(ray_session: None) -> None:
    """A Train controller killed with its trial before the trial's first result leaves a group no
    result named: Ray keeps it (holding its CPUs) until the job ends. The guard removes it when a
    trial stops and at the search's end; a group this job held before the search began, one whose
    creator still lives, and one the driver made (Tune's trials' own) are left alone."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group

    before = _orphan()  # held before the search began: not the search's to remove
    guard = PlacementGuard()
    guard.SETTLE_S = guard.KILLED_S = 1.0
    guard.begin()
    by_driver = placement_group([{"CPU": 0.25}])  # as Tune makes each trial's
    ray.get(by_driver.ready())
    stopped = _orphan()
    guard.release("t1")  # a trial stopped (no result named its group)
    assert guard.removed == [stopped] and orphaned_groups() == [before]
    living = _controller()
    alive = ray.get(living.create.remote())
    at_end = _orphan()
    guard.release_all()
    assert guard.removed == [stopped, at_end] and orphaned_groups() == [before]
    table = ray.util.placement_group_table()
    assert table[alive]["state"] == "CREATED" and table[stopped]["state"] == REMOVED
    assert table[by_driver.id.hex()]["state"] == "CREATED"
    ray.util.remove_placement_group(by_driver)
    for group in (before, alive):
        ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group)))
    ray.kill(living)


def test_the_guard_looks_for_orphans_while_the_search_runs_and_trusts_the_actor_table(
    ray_session: None,
) -> None:
    """A controller may die after Tune reported its trial stopped, when no release is left to
    come while the trials still waiting for its CPUs wait: each Tune step's sweep removes the
    search's orphans, at most every ``ORPHAN_CHECK_S``. A group's creator counts as dead when the
    actor table says so (a creator that dies while its group is being created leaves the group's
    record saying alive; seen in CI, where Ray never freed that group)."""
    import ray

    guard = PlacementGuard()
    guard.ORPHAN_CHECK_S = 1.0
    guard.begin()
    first = _orphan()
    guard.sweep(["t1"])  # no trial stopped: only the periodic look finds it
    assert guard.removed == [first]
    second = _orphan()
    guard.sweep(["t1"])  # looked less than ORPHAN_CHECK_S ago
    assert guard.removed == [first] and second in orphaned_groups()
    time.sleep(1.0)
    guard.sweep(["t1"])
    assert guard.removed == [first, second] and orphaned_groups() == []
    living = _controller()
    ray.get(living.create.remote())
    actor = living._actor_id.hex()
    assert not actor_dead(actor)
    ray.kill(living)
    deadline = time.monotonic() + 30
    while not actor_dead(actor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert actor_dead(actor) and actor_dead("ff" * 16)  # killed; never known
    guard.release_all()


def test_the_guard_kills_a_train_controller_that_outlives_the_search(
    ray_session: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A Train controller of the search still alive ``SETTLE_S`` after the search ended (one
    holding a group, one between two worker groups holding none, which would create one later and
    starve the next run) is killed and its group removed; a controller alive before the search
    began is not the search's and lives on."""
    import ray

    earlier = train_controller()
    ray.get(earlier.ready.remote())
    guard = PlacementGuard()
    guard.SETTLE_S = guard.KILLED_S = 1.0
    guard.begin()
    holding, between = train_controller(), train_controller()
    group = ray.get(holding.create.remote())
    ray.get(between.ready.remote())
    ids = {holding._actor_id.hex(), between._actor_id.hex()}
    assert live_controllers() >= ids
    with caplog.at_level("WARNING", logger="govray.platform.search.placement_guard"):
        guard.release_all()
    assert live_controllers() == {earlier._actor_id.hex()}
    assert ray.util.placement_group_table()[group]["state"] == REMOVED and group in guard.removed
    assert "outlived the search: killed" in caplog.text and all(actor in caplog.text for actor in ids)
    ray.kill(earlier)


@pytest.mark.slow  # two whole Ray Tune searches: the slow tier
def test_a_reused_tune_actor_trains_the_next_trial_bit_identically(
    ray_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trials trained in their Tune actors (``GOVRAY_TRIAL_HOSTS=0``; trial hosts have their own
    test): a 1-worker grid search of two points runs both trials in one Tune actor
    (``reuse_actors``); the second trial's final weights are those of a search of its point alone,
    in a fresh actor."""
    monkeypatch.setenv("GOVRAY_TRIAL_HOSTS", "0")
    both, store, search_dir = searched_from(grid_of_lrs(tmp_path / "both", [0.1, 0.01]))
    pids = {result["pid"] for trial in _tune_results(search_dir).values() for result in trial}
    assert len(both.trial_ids) == 2 and len(pids) == 1, pids  # one actor ran both trials
    second = max(both.trial_ids)
    assert json.loads(store.get_trial(second).hparams_json)["lr"] == 0.01
    alone, alone_store, _ = searched_from(grid_of_lrs(tmp_path / "alone", [0.01]))
    assert final_model(store, second) == final_model(alone_store, alone.trial_ids[0])


def _pbt_search(
    root: Path, monkeypatch: pytest.MonkeyPatch, stock: bool
) -> tuple[list[Any], list[tuple[bool, int, bool]]]:
    """A PBT search of two 1-worker trials perturbing at step 5 of 10, seeded by its config
    (``stock``: Tune's synchronous PBT, on the same seeded draws): what each trial recorded, and
    per trial from its Tune results (whether it is a clone, its results since its last restore at
    step 10, whether steps 5 and 10 came from one process), both sorted."""
    import searchers.pbt_scheduler
    from searchers.pbt_scheduler import SeededPbt

    if stock:
        monkeypatch.setattr(
            searchers.pbt_scheduler,
            "SynchronousPbt",
            lambda trial_resources, seed, **pbt: SeededPbt(seed, synch=True, **pbt),
        )
    searcher = {
        "name": "pbt",
        "population_size": 2,
        "perturbation_interval": 5,
        "quantile_fraction": 0.5,
        "resample_probability": 1.0,
        "hyperparam_mutations": {"lr": {"type": "log", "minval": -2.0, "maxval": -1.0, "base": 10}},
        "max_length": {"batches": 10},
    }
    outcome, store, search_dir = searched_from(search_example(root, searcher))
    monkeypatch.undo()
    trials = [store.get_trial(t) for t in outcome.trial_ids]
    recorded = sorted(
        (
            trial.hparams_json,
            trial.cloned_from is not None,
            [(m.step, m.value) for m in store.metrics(trial.id, "validation_loss")],  # type: ignore[arg-type]
            final_model(store, trial.id),  # type: ignore[arg-type]
        )
        for trial in trials
    )
    cloned = {str(t.ray_run_name).rsplit("-", 1)[-1]: t.cloned_from is not None for t in trials}
    restarts = []
    for tune_id, results in _tune_results(search_dir).items():
        # An exploited trial's result file may begin at its restart: Tune rewrites it then.
        at = {r["step"]: r for r in results}
        one_process = 5 in at and at[10]["pid"] == at[5]["pid"]
        restarts.append((cloned[tune_id], at[10]["iterations_since_restore"], one_process))
    return recorded, sorted(restarts)


@pytest.mark.slow  # two whole Ray Tune searches: the slow tier
def test_pbt_restarts_only_the_trial_it_exploits_and_decides_as_tunes_pbt(
    ray_session: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 1-worker PBT trials (reused Tune actors) perturbed at step 5: the donor PBT keeps
    reports its step-10 result from its step-5 process without a restore (Tune's
    ``iterations_since_restore`` goes on), the clone restarted from the donor's checkpoint; Tune's
    synchronous PBT on the same seeds restarted both, and every trial recorded the same
    hyperparameters, clone, validation losses and final weights (bit for bit) under both."""
    kept, kept_restarts = _pbt_search(tmp_path / "kept", monkeypatch, stock=False)
    stock, stock_restarts = _pbt_search(tmp_path / "stock", monkeypatch, stock=True)
    assert kept == stock
    assert sorted(clone for _, clone, _, _ in kept) == [False, True]  # one exploit
    (donor, clone), (stock_donor, stock_clone) = kept_restarts, stock_restarts
    assert donor == (False, 2, True), kept_restarts  # went on in its process: no restore
    assert clone[:2] == (True, 1), kept_restarts  # restored from the donor's checkpoint
    assert (stock_donor[:2], stock_clone[:2]) == ((False, 1), (True, 1)), stock_restarts  # both
