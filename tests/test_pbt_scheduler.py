"""govray's synchronous PBT decides what Tune's synchronous PBT decides (same exploits, same
mutated hyperparameters, from the same random draws), but only the trials it exploits stop: the
others are asked for their next result. Its draws come from generators seeded by the experiment,
never from the driver's. Driven here by a stand-in for Tune's controller (no Ray);
``tests/test_search_workers.py`` runs it in real searches."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray import tune
from ray.train import Checkpoint
from ray.train._internal.session import _TrainingResult
from ray.train._internal.storage import StorageContext
from ray.tune.execution.tune_controller import TrialRunnerWrapper, TuneController
from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

from searchers.pbt_scheduler import SeededPbt, SynchronousPbt

SEED = 7
PBT: dict[str, Any] = {
    "time_attr": "step",
    "metric": "loss",
    "mode": "min",
    "perturbation_interval": 5,
    "hyperparam_mutations": {"lr": tune.loguniform(1e-3, 1e-1)},
    "quantile_fraction": 0.25,
    "log_config": False,  # Tune's policy log needs a Ray session
}


class Controller:
    """What a scheduler sees of Tune's controller, acting as Tune 2.60 acts on its decisions."""

    def __init__(self, trials: list[Trial], scheduler: PopulationBasedTraining, root: Path) -> None:
        self.trials, self.scheduler, self.root = trials, scheduler, root
        self.live = set(trials)
        self.search_alg = None
        self._cached_trial_decisions: dict[str, str] = {}
        self.trained: list[str] = []  # trial ids asked for their next result
        for trial in trials:
            trial.set_status(Trial.RUNNING)
            scheduler.on_trial_add(self, trial)  # type: ignore[arg-type]

    def get_trials(self) -> list[Trial]:
        return self.trials

    def get_live_trials(self) -> set[Trial]:
        return self.live

    def _schedule_trial_save(self, trial: Trial, result: dict[str, Any] | None = None) -> Checkpoint:
        return trial.checkpoint

    def pause_trial(self, trial: Trial, should_checkpoint: bool = True) -> None:
        if trial.is_saving:  # TuneController._schedule_trial_stop
            self._cached_trial_decisions[trial.trial_id] = TrialScheduler.STOP
        trial.set_status(Trial.PAUSED)

    def _schedule_trial_train(self, trial: Trial) -> None:
        self.trained.append(trial.trial_id)

    def report(self, trial: Trial, step: int, loss: float) -> str:
        """A result with its checkpoint; the decision is acted on."""
        folder = self.root / f"{trial.trial_id}-{step}"
        folder.mkdir()
        result = {"step": step, "loss": loss}
        checkpoint = _TrainingResult(checkpoint=Checkpoint.from_directory(folder), metrics=result)
        trial.run_metadata.checkpoint_manager._latest_checkpoint_result = checkpoint
        decision = self.scheduler.on_trial_result(self, trial, result)  # type: ignore[arg-type]
        if decision == TrialScheduler.PAUSE:
            self.pause_trial(trial)
        elif decision == TrialScheduler.CONTINUE:
            self._schedule_trial_train(trial)
        return decision


def population(root: Path, size: int) -> list[Trial]:
    storage = StorageContext(storage_path=str(root), experiment_dir_name="search", trial_dir_name="t")
    return [
        Trial("__fake", stub=True, config={"lr": 0.01 * (i + 1)}, storage=storage, experiment_tag=str(i))
        for i in range(size)
    ]


def perturbed(
    scheduler: PopulationBasedTraining, root: Path, losses: list[float]
) -> tuple[Controller, list[str]]:
    """A population reporting ``losses`` at the perturbation time, in order, on seeded draws."""
    random.seed(SEED)  # (Tune's stock scheduler draws from the driver's generators)
    np.random.seed(SEED)
    trials = population(root, len(losses))
    controller = Controller(trials, scheduler, root)
    decisions = [controller.report(trial, 5, loss) for trial, loss in zip(trials, losses, strict=True)]
    return controller, decisions


@pytest.fixture(autouse=True)
def _two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})


def test_only_the_exploited_trial_stops_and_every_decision_is_tunes(tmp_path: Path) -> None:
    losses = [0.3, 0.9, 0.1, 0.5]  # trial 1 is the lower quantile, trial 2 the upper
    stock, stock_decisions = perturbed(PopulationBasedTraining(synch=True, **PBT), tmp_path / "stock", losses)
    kept, decisions = perturbed(SynchronousPbt({"CPU": 1.0}, SEED, **PBT), tmp_path / "kept", losses)
    assert stock_decisions == [TrialScheduler.PAUSE] * 4  # Tune stops every trial
    assert decisions == [TrialScheduler.NOOP] * 3 + [TrialScheduler.CONTINUE]
    assert [t.status for t in kept.trials] == [Trial.RUNNING, Trial.PAUSED, Trial.RUNNING, Trial.RUNNING]
    ids = [t.trial_id for t in kept.trials]
    assert kept.trained == [ids[0], ids[2], ids[3]]  # the waiting ones, then the last to arrive
    # The same exploit: trial 1 continues trial 2's checkpoint with the same mutated learning rate.
    assert [t.config for t in kept.trials] == [t.config for t in stock.trials]
    assert kept.trials[1].config != {"lr": 0.02}
    restored = [
        t.run_metadata.checkpoint_manager._latest_checkpoint_result.checkpoint.path for t in kept.trials
    ]
    assert restored[1] == restored[2] and Path(restored[2]).name == f"{ids[2]}-5"


def test_a_trial_ending_while_the_others_wait_no_longer_holds_them(tmp_path: Path) -> None:
    scheduler = SynchronousPbt({"CPU": 1.0}, SEED, **{**PBT, "quantile_fraction": 0.5})
    random.seed(SEED)  # (Tune's stock scheduler draws from the driver's generators)
    np.random.seed(SEED)
    trials = population(tmp_path, 3)
    controller = Controller(trials, scheduler, tmp_path)
    assert controller.report(trials[0], 5, 0.2) == TrialScheduler.NOOP
    assert controller.report(trials[1], 5, 0.7) == TrialScheduler.NOOP
    scheduler.choose_trial_to_run(controller)  # type: ignore[arg-type]
    assert controller.trained == []  # trial 2 is still training
    trials[2].set_status(Trial.ERROR)  # Tune keeps an errored trial among its live ones
    scheduler.on_trial_error(controller, trials[2])  # type: ignore[arg-type]
    scheduler.choose_trial_to_run(controller)  # type: ignore[arg-type]
    assert controller.trained == [trials[0].trial_id]  # kept: the better of the two there
    assert trials[1].status == Trial.PAUSED and trials[1].config != {"lr": 0.02}  # exploited trial 0


def test_a_waiting_trial_an_exploit_stops_keeps_no_stale_stop(tmp_path: Path) -> None:
    """TuneController.pause_trial caches STOP for a save in flight and discards the save: the
    exploited trial's restart must not be stopped by it at its first checkpoint."""
    scheduler = SynchronousPbt({"CPU": 1.0}, SEED, **{**PBT, "quantile_fraction": 0.5})
    trials = population(tmp_path, 2)
    controller = Controller(trials, scheduler, tmp_path)
    controller.report(trials[0], 5, 0.9)
    trials[0].temporary_state.saving_to = object()  # its checkpoint's save still in flight
    controller.report(trials[1], 5, 0.1)
    assert trials[0].status == Trial.PAUSED and controller._cached_trial_decisions == {}


def test_a_population_that_does_not_fit_waits_paused_as_tunes_does(tmp_path: Path) -> None:
    _, decisions = perturbed(SynchronousPbt({"CPU": 2.0}, SEED, **PBT), tmp_path, [0.3, 0.9, 0.1])
    assert decisions == [TrialScheduler.PAUSE] * 3  # 3 trials x 2 CPUs > 4 CPUs


def test_its_draws_are_its_own_seeded_ones_whatever_the_driver_draws(tmp_path: Path) -> None:
    """Two schedulers of one seed clone the same donor with the same mutated learning rate, one
    after the driver drew from ``random`` and ``numpy.random`` and one without; the driver's
    generators are where they were (a perturbation draws none of theirs); another seed mutates
    otherwise."""
    losses = [0.3, 0.9, 0.1, 0.5, 0.2, 0.8]

    def exploited(seed: int, root: Path, driver_draws: int) -> tuple[list[dict[str, Any]], Any]:
        scheduler = SynchronousPbt({"CPU": 0.5}, seed, **{**PBT, "quantile_fraction": 0.5})
        trials = population(root, len(losses))
        controller = Controller(trials, scheduler, root)
        random.seed(123)
        np.random.seed(123)
        for _ in range(driver_draws):
            random.random(), np.random.random()
        before = random.getstate(), np.random.get_state()[1].copy()
        for trial, loss in zip(trials, losses, strict=True):
            controller.report(trial, 5, loss)
        after = random.getstate(), np.random.get_state()[1]
        assert before[0] == after[0] and np.array_equal(before[1], after[1]), "the driver's draws untouched"
        index = {t.trial_id: i for i, t in enumerate(trials)}
        donors = [t.run_metadata.checkpoint_manager._latest_checkpoint_result.checkpoint.path for t in trials]
        return [t.config for t in trials], [index[Path(path).name.split("-")[0]] for path in donors]

    first = exploited(SEED, tmp_path / "a", driver_draws=0)
    assert first == exploited(SEED, tmp_path / "b", driver_draws=5)
    other = exploited(SEED + 1, tmp_path / "c", driver_draws=0)
    assert other[0] != first[0]
    assert sum(config != {"lr": 0.01 * (i + 1)} for i, config in enumerate(first[0])) == 3  # 3 exploited


def test_a_seeded_pbt_is_tunes_pbt_on_the_seeded_draws(tmp_path: Path) -> None:
    """``SeededPbt(seed)`` decides exactly what Tune's PBT decides on the driver's generators
    seeded by ``seed``."""
    losses = [0.3, 0.9, 0.1, 0.5]
    stock, _ = perturbed(PopulationBasedTraining(synch=True, **PBT), tmp_path / "stock", losses)
    seeded, _ = perturbed(SeededPbt(SEED, synch=True, **PBT), tmp_path / "seeded", losses)
    assert [t.config for t in seeded.trials] == [t.config for t in stock.trials]


def test_the_private_controller_calls_exist_in_the_pinned_ray() -> None:
    """``searchers.pbt_scheduler._resume`` reaches past Tune's scheduler interface."""
    assert ray.__version__ == "2.60.0"
    assert callable(TuneController._schedule_trial_train)
    assert "_tune_controller" in TrialRunnerWrapper.__init__.__code__.co_names
    assert "_cached_trial_decisions" in TuneController.__init__.__code__.co_names
    # ``SeededPbt`` swaps its generators in around the one call of Tune's PBT that draws.
    assert callable(PopulationBasedTraining._checkpoint_or_exploit)
