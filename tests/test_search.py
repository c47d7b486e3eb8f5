"""Hyperparameter search on Ray Tune: each strategy maps Determined's fields exactly, and a real
small search records every trial (state, hyperparameters, metrics, objective) in the store."""

from __future__ import annotations

import itertools
import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from ray import tune
from sqlalchemy.exc import SQLAlchemyError

from govray.config.experiment import load_experiment
from govray.core.errors import ConfigError
from govray.core.keys import platform_key, platform_trust
from govray.core.storage import open_storage
from govray.platform.search.driver import strategy
from govray.platform.search.placement_guard import result_places
from govray.platform.search.progress import SearchState
from govray.platform.search.tune_trial import TUNE_TRIAL_MEMORY, _continuous_trial, ends_trial
from govray.tracking.lineage import ledger_rows
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import (
    MODEL_FILE,
    checkpoint_step,
    find_checkpoints,
    load_checkpoint,
)
from govray.train.run.loop import train_worker
from govray.train.run.reports import StepReport
from govray.train.run.session import LocalSession, tune_reports, tune_result
from govray.train.runspec import RUN_SPEC_FILE, Attempt, RunSpec
from searchers.asha import grace_period
from searchers.space import grid_points, grid_space
from tests.helpers.golden import GoldenRun
from tests.helpers.planted import planted_pickle
from tests.helpers.processes import kill_driver_when
from tests.helpers.search import SEARCH_HPARAMS, assert_recorded, plan_of, search_example, searched
from tests.helpers.search_replays import (
    assert_removal_equals_replay,
    hparams_history,
    replayed_without_writers,
)
from tests.helpers.signing import channel_for

# -- the mapping to Tune, no Ray needed ---------------------------------------------------------


def test_every_strategy_is_an_installed_entry_point() -> None:
    for name in ("single", "grid", "random", "asha", "adaptive_asha", "pbt", "bayesian"):
        assert callable(strategy(name))
    with pytest.raises(
        ConfigError, match="no searcher 'hyperband' is installed.*adaptive_asha, asha, bayesian, grid"
    ):
        strategy("hyperband")


def test_grid_points_follow_determineds_count(tmp_path: Path) -> None:
    config = load_experiment(search_example(tmp_path, {"name": "grid"}))
    assert grid_points("lr", config.hyperparameters["lr"]) == pytest.approx([0.01, 0.1])
    space = grid_space(config)
    assert space["dropout"] == 0.0 and space["hidden"] == tune.grid_search([8, 16])
    assert plan_of(tmp_path / "b", {"name": "grid"}).notes == {"trials": 4}


def test_asha_grace_period_is_max_t_over_divisor_to_the_rungs_minus_one(tmp_path: Path) -> None:
    assert grace_period(64, 4.0, 3) == 4 and grace_period(64, 2.0, 4) == 8 and grace_period(10, 4.0, 5) == 1
    plan = plan_of(tmp_path, {"name": "asha", "max_trials": 6, "divisor": 2, "max_rungs": 3, "brackets": 1})
    assert plan.notes == {"max_t": 64, "grace_period": 16, "rungs": [16, 32, 64]}
    assert plan.validation_period == 16
    assert plan.num_samples == 6 and plan.scheduler._reduction_factor == 2


def test_samplers_hold_the_concurrency_limit_tune_would_ignore(tmp_path: Path) -> None:
    for index, name in enumerate(("random", "asha")):
        searcher = {"name": name, "max_trials": 4, "max_concurrent_trials": 2}
        assert plan_of(tmp_path / str(index), searcher).search_alg.max_concurrent == 2


def test_pbt_refuses_mutating_what_fixes_the_schedule(tmp_path: Path) -> None:
    searcher = {
        "name": "pbt",
        "population_size": 2,
        "perturbation_interval": 5,
        "hyperparam_mutations": {"batch_size": {"type": "categorical", "vals": [8, 16]}},
    }
    with pytest.raises(ConfigError, match="batch_size fixes the schedule"):
        plan_of(tmp_path, searcher)


# -- real searches on Ray Tune ------------------------------------------------------------------


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
def test_grid_search_runs_every_point_once(ray_session: None, tmp_path: Path) -> None:
    outcome, store = searched(tmp_path, {"name": "grid", "max_length": {"batches": 10}})
    assert_recorded(outcome, store, trials=4)
    points = sorted(
        (
            json.loads(store.get_trial(t).hparams_json)["hidden"],
            round(json.loads(store.get_trial(t).hparams_json)["lr"], 6),
        )
        for t in outcome.trial_ids
    )
    assert points == [(8, 0.01), (8, 0.1), (16, 0.01), (16, 0.1)]
    for trial_id in outcome.trial_ids:
        assert store.metrics(trial_id, "validation_loss")[-1].step == 10
        assert store.metrics(trial_id, "memorization_score")


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
def test_random_search_samples_max_trials_points_inside_the_space(ray_session: None, tmp_path: Path) -> None:
    outcome, store = searched(tmp_path, {"name": "random", "max_trials": 3, "max_length": {"batches": 10}})
    assert_recorded(outcome, store, trials=3)
    for trial_id in outcome.trial_ids:
        hparams = json.loads(store.get_trial(trial_id).hparams_json)
        assert hparams["hidden"] in (8, 16) and 0.01 <= hparams["lr"] <= 0.1
    # max_concurrent_trials (default 1) held: each trial started after the previous one ended.
    trials = sorted((store.get_trial(t) for t in outcome.trial_ids), key=lambda t: t.created_at)
    for earlier, later in itertools.pairwise(trials):
        assert earlier.ended_at is not None and later.created_at >= earlier.ended_at, (earlier, later)


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
def test_bayesian_search_runs_through_optuna(ray_session: None, tmp_path: Path) -> None:
    searcher = {"name": "bayesian", "max_trials": 3, "n_startup_trials": 2, "max_length": {"batches": 10}}
    outcome, store = searched(tmp_path, searcher)
    assert_recorded(outcome, store, trials=3)


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
def test_asha_stops_weak_trials_at_a_rung_and_records_the_early_stop(
    ray_session: None, tmp_path: Path
) -> None:
    searcher = {
        "name": "asha",
        "max_trials": 4,
        "divisor": 2,
        "max_rungs": 2,  # grace period 20 / 2 = 10: rungs at steps 10 and 20
        "max_length": {"batches": 20},
    }
    shown: list[SearchState] = []
    outcome, store = searched(tmp_path, searcher, progress=shown.append)
    assert_recorded(outcome, store, trials=4)
    last = {t: store.metrics(t, "objective")[-1].step for t in outcome.trial_ids}
    assert set(last.values()) == {10, 20}, last  # some stopped at the first rung, some finished
    for trial_id, step in last.items():
        kinds = [d.kind for d in store.decisions(trial_id)]
        assert kinds == (["early_stop"] if step == 10 else []), (trial_id, kinds)
    # The progress view ended with what the store holds: the same trials stopped, the same best.
    final = shown[-1]
    stopped = {t for t, step in last.items() if step == 10}
    assert (final.planned, final.count("running"), final.count("stopped early")) == (4, 0, len(stopped))
    assert {t.number for t in final.trials if t.status == "stopped early"} == stopped
    assert {(t.number, t.rung) for t in final.trials} == {(t, 1 if t in stopped else 2) for t in last}
    assert final.best == pytest.approx((outcome.best_objective, outcome.best_trial_id))
    assert max(state.count("running") for state in shown) == 1  # max_concurrent_trials (default 1)


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
def test_pbt_with_two_worker_trials_exploits_and_the_clone_records_its_donor(
    ray_session: None, tmp_path: Path
) -> None:
    """Two 2-worker trials in segments of 5 steps; at each perturbation the worse one continues
    the better one's signed state (weights, optimizer, ledger) with a mutated learning rate. Both
    fit the 2 CPUs at once (half a CPU a worker), so the donor keeps its workers across the
    perturbation (the same PIDs); only the clone's are new."""
    searcher = {
        "name": "pbt",
        "population_size": 2,
        "perturbation_interval": 5,
        "quantile_fraction": 0.5,
        "resample_probability": 1.0,
        "hyperparam_mutations": {"lr": SEARCH_HPARAMS["lr"]},
        "max_length": {"batches": 10},
    }
    # A metric-driven LR schedule: a cut at every validation after the first.
    cut_always = {"metric": "validation_loss", "factor": 0.5, "patience": 0, "threshold": 0.9}
    outcome, store = searched(
        tmp_path, searcher, workers=2, report_every=2, cpus_per_worker=0.5, lr_schedule=cut_always
    )
    assert_recorded(outcome, store, trials=2)
    places: dict[str, dict[int, Any]] = {}  # Tune trial id: step: worker places
    for path in tmp_path.rglob("result.json"):  # Tune's results (a clone's may begin at its restart)
        for result in map(json.loads, path.read_text().splitlines()):
            places.setdefault(result["trial_id"], {})[result["step"]] = result_places(result)
    trials = [store.get_trial(t) for t in outcome.trial_ids]
    cloned = {str(t.ray_run_name).rsplit("-", 1)[-1]: t.cloned_from for t in trials}
    [kept] = [places[t] for t, donor in cloned.items() if donor is None]
    [clone] = [places[t] for t, donor in cloned.items() if donor is not None]
    assert kept[5] and kept[5] == kept[10], places  # the donor's workers went on
    before = [*kept[5].values(), *clone.get(5, {}).values()]
    assert not {p["pid"] for p in before} & {p["pid"] for p in clone[10].values()}, places  # new ones
    for trial_id in outcome.trial_ids:  # the reports between validations reach the store too
        assert [m.step for m in store.metrics(trial_id, "training_loss")] == [2, 4, 5, 6, 8, 10]
        assert [m.step for m in store.metrics(trial_id, "validation_loss")] == [5, 10]
    clones = [t for t in outcome.trial_ids if store.get_trial(t).cloned_from is not None]
    assert clones, "PBT never exploited"
    for clone in clones:
        donor = store.get_trial(clone).cloned_from
        assert donor in outcome.trial_ids and donor != clone
    # Every trial continued one schedule (same seed, batch size, world size): after 10 steps, the
    # clone's ledger is the donor's first steps plus its own, i.e. all 10 steps' contributions.
    ledgers = {
        t: {(r.corpus_id, r.parameter): r.examples for r in ledger_rows(store, t)} for t in outcome.trial_ids
    }
    donor = store.get_trial(clones[0]).cloned_from
    assert donor is not None and ledgers[clones[0]] and ledgers[clones[0]] == ledgers[donor]
    # The clone's state was its donor's up to the exploit (the donor's learning rate), then its own:
    # `govray replay --trial CLONE` follows that lineage, and removal = replay holds for it.
    lineage = hparams_history(store, clones[0])
    donor_row, clone_row = store.get_trial(donor), store.get_trial(clones[0])
    assert [(step, run) for step, run, _ in lineage] == [
        (0, donor_row.ray_run_name),
        (5, clone_row.ray_run_name),
    ]
    assert lineage[0][2] == json.loads(donor_row.hparams_json) and lineage[1][2]["lr"] != lineage[0][2]["lr"]
    # The first validation sets the plateau rule's best; the clone's cut at 10 is the decision its
    # state carries, and the replay (from the state's record) applies it where it was taken.
    assert [(d.seq, d.step, d.kind) for d in store.decisions(clones[0])] == [(0, 10, "lr_scale")]
    report = replayed_without_writers(store, clones[0])
    assert_removal_equals_replay(store, platform_trust(platform_key()), report, stopped_at=10)
    replayed_cuts = [(d.seq, d.step, d.kind) for d in store.decisions(report.replay_trial)]
    assert replayed_cuts == [(0, 10, "lr_scale")], replayed_cuts
    # The replay's own state followed the same hyperparameters from the same steps.
    assert [(step, hparams) for step, _, hparams in hparams_history(store, report.replay_trial)] == [
        (step, hparams) for step, _, hparams in lineage
    ]


def test_pbt_never_pauses_a_trial_at_its_last_report() -> None:
    """The last result (it carries the ledger) stops the trial before the scheduler sees it: a
    synchronous PBT cannot hold a finished trial back to hand its final state to another."""

    def report(step: int, objective: float, **fields: Any) -> StepReport:
        return StepReport(step=step, epoch=0, metrics={"objective": objective}, **fields)

    segment_end = tune_result([report(5, 0.5, ledger={})], max_steps=10)
    last = tune_result([report(6, 0.4), report(10, 0.3, ledger={})], 10)
    early_stop = tune_result([report(5, 0.5, ledger={}, stop="early_stop")], 10)
    assert [ends_trial("t", r) for r in (segment_end, last, early_stop)] == [False, True, True]


def _clone_of_final_checkpoint(donor_run: Path, run_dir: Path, report_sink: str = "") -> tuple[Path, Attempt]:
    """A trial resuming from another run's final checkpoint, as PBT would hand it over, with a
    mutated learning rate (its N workers reporting to ``report_sink``)."""
    donor = find_checkpoints(donor_run)[-1]
    spec = RunSpec.model_validate_json((donor / RUN_SPEC_FILE).read_text())
    assert checkpoint_step(donor) == spec.max_steps
    hparams = {**spec.hparams, "lr": spec.hparams["lr"] * 0.8}
    update = {"run_name": "clone", "run_dir": str(run_dir), "hparams": hparams}
    clone = spec.model_copy(update={**update, "log_dir": "", "control_file": ""})
    channel = channel_for(clone)  # what the trial's launch opens
    return donor, Attempt.of(clone, resume_checkpoint=str(donor), report_sink=report_sink, signer=channel)


def assert_clone_of(donor: Path, report: StepReport, saved: Path, trust: Any) -> None:
    """The clone's last report and checkpoint: the donor's step, ledger and weights (bit for bit)
    under the clone's own name, signed."""
    source = load_checkpoint(donor, trust)
    assert report.step == source.state.step and report.cloned_from_run == source.state.run
    assert report.ledger == source.state.ledger and math.isfinite(report.metrics["objective"])
    clone = load_checkpoint(saved, trust)
    assert (clone.state.run, clone.state.step, clone.state.ledger) == (
        "clone",
        source.state.step,
        source.state.ledger,
    )
    for name in [MODEL_FILE, *(f"adapter-{a}.safetensors" for a in source.state.adapters)]:
        assert (saved / name).read_bytes() == (donor / name).read_bytes(), name


def test_a_clone_of_a_finished_trial_ends_with_its_donors_state_under_its_own_name(
    golden_local_epoch: GoldenRun, tmp_path: Path
) -> None:
    """Handed another run's final checkpoint (nothing left to train), a one-worker trial still
    ends with a last report (objective, ledger, donor) and a signed checkpoint of its own."""
    donor, attempt = _clone_of_final_checkpoint(golden_local_epoch.outcome.run_dir, tmp_path / "clone")
    reports: list[StepReport] = []
    train_worker(attempt.model_dump(mode="json"), session=partial(LocalSession, deliver=reports.append))
    assert len(reports) == 1, [report.step for report in reports]
    assert reports[0].checkpoint is not None
    assert_clone_of(donor, reports[0], Path(reports[0].checkpoint), attempt.trust)


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
def test_a_clone_of_a_finished_two_worker_trial_ends_through_tune(
    golden_run: GoldenRun, tmp_path: Path
) -> None:
    """The same for N workers: one Ray Train run inside the Tune trial checkpoints the
    donor's state under the clone's name, and Tune keeps it as the trial's checkpoint."""
    config = golden_run.config
    storage = open_storage(config.storage_path)
    run = f"clone-{tmp_path.name}"  # a Ray Train run of the golden storage, as a trial's would be
    donor, attempt = _clone_of_final_checkpoint(
        golden_run.outcome.run_dir, storage.root / "ray" / run, report_sink=f"govray-reports-{run}"
    )

    def trial(params: dict[str, Any]) -> None:
        _continuous_trial(config, storage, attempt)

    tuner = tune.Tuner(
        tune.with_resources(trial, {"memory": TUNE_TRIAL_MEMORY}),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name="clone", verbose=0),
    )
    [result] = list(tuner.fit())
    assert result.error is None and result.checkpoint is not None
    [report] = tune_reports(result.metrics)
    assert_clone_of(donor, report, Path(result.checkpoint.path), attempt.trust)


@pytest.mark.slow  # a whole Ray Tune search: the slow tier
@pytest.mark.parametrize("resumed_by", ["search-again", "govray-resume"])
def test_an_interrupted_search_resumes_without_rerunning_finished_trials(
    ray_session: None, tmp_path: Path, capfd: pytest.CaptureFixture[str], resumed_by: str
) -> None:
    """`jobs/search.py` in its own process, SIGKILLed once two of four grid trials finished;
    the same call again (or `govray resume EXPERIMENT`) resumes Tune's state and runs only the
    other two, and shows it in plain progress lines."""
    import time

    from govray.cli import main
    from jobs.search import parse

    path = search_example(tmp_path, {"name": "grid", "max_length": {"batches": 10}})
    database = load_experiment(path).database_url
    finished: list[int] = []

    def two_trials_finished() -> bool:
        if not Path(database.removeprefix("sqlite:///")).exists():
            return False
        store = TrackingStore(database)
        try:
            finished[:] = [t.id for t in store.list_trials(1) if t.state == "completed"]  # type: ignore[misc]
        except SQLAlchemyError:  # the driver is still creating or migrating the database
            finished.clear()
        finally:
            store.close()
        return len(finished) >= 2

    # Tune saves its state within a second of a trial's end: kill 2 s after the second one.
    kill_driver_when("search.py", path, two_trials_finished, settle=2.0)
    store = TrackingStore.open(database)
    before = {t: len(store.metrics(t)) for t in finished}
    time.sleep(3)  # the dead driver's Tune trials die with it
    # An engineer with storage write access plants a pickle of their own as Tune's state: the
    # resume puts the state the signer sealed back before Tune unpickles anything.
    (tuner_state,) = [p for p in tmp_path.rglob("tuner.pkl") if not p.parent.name.startswith("tune-state-")]
    assert list(tuner_state.parent.glob("tune-state-*/manifest.sig"))
    marker = tmp_path / "unpickled"
    tuner_state.write_bytes(planted_pickle(marker))
    capfd.readouterr()
    again = (
        parse(["--config", str(path)])
        if resumed_by == "search-again"
        else ["resume", "1", "--database", database]
    )
    assert main(again) == 0
    assert not marker.exists()
    trials = store.list_trials(1)
    assert len(trials) == 4 and all(t.state == "completed" for t in trials)
    # What `govray search` printed (no terminal here): progress lines, none of Tune's tables; the
    # resumed search counts the trials finished before the kill.
    printed = capfd.readouterr().out
    assert "Trial status" not in printed and "Configuration for experiment" not in printed, printed
    progress = [line for line in printed.splitlines() if line.startswith("search ")]
    best = min((m.value, t.id) for t in trials for m in store.metrics(t.id, "objective"))
    assert progress[-1] == (
        f"search 4/4 trials · 0 running · 4 completed · best validation_loss {best[0]:.4f} (trial {best[1]})"
    )
    assert int(progress[0].split()[1].split("/")[0]) >= 2, progress
    assert {t: len(store.metrics(t)) for t in finished} == before  # not run again
    # Every trial, before the kill and after the resume, kept the search's reproducibility record
    # (one code snapshot: the resumed search ran the code it recorded).
    assert len({t.reproducibility_json for t in trials}) == 1 and trials[0].reproducibility_json
    sampled = sorted(
        (json.loads(t.hparams_json)["hidden"], round(json.loads(t.hparams_json)["lr"], 6)) for t in trials
    )
    assert sampled == [(8, 0.01), (8, 0.1), (16, 0.01), (16, 0.1)]
