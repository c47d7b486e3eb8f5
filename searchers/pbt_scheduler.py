"""Tune's synchronous PBT, but a perturbation restarts only the trials it exploits.

Tune's ``PopulationBasedTraining(synch=True)`` pauses every trial reaching the perturbation time
until the whole population has, then exploits the lower quantile. Pausing a function trial ends its
actor: every trial restarted from its checkpoint at every perturbation (an N-worker trial with its
whole Ray Train worker group). :class:`SynchronousPbt` lets a trial wait RUNNING instead (``NOOP``:
Tune schedules no next result, so a 1-worker trial's function stays blocked in
``ray.tune.report`` and an N-worker trial's relay with it, while its Ray Train run goes on).
Once the population is there, Tune's own code perturbs — the same decisions and the same random
draws as the stock scheduler, which never depend on which trials restarted — and the trials it
did not exploit are asked for their next result. An exploited trial restarts from its donor's
checkpoint, as before.

A population that does not fit the cluster at once waits as Tune's does (paused: a waiting trial
would hold the resources a trial behind it needs). A trial that ends while others wait (its last
result, an early stop, an error) no longer holds them back: those there perturb without it (stock
synchronous PBT waits forever for an errored trial).

Its random draws (the donor each exploited trial clones, the resampled or perturbed
hyperparameters) come from generators of its own seeded by the experiment's seed, not from the
driver's ``random`` and ``numpy.random``: the same experiment perturbs the same way in every run,
whatever else the driver draws. Tune's code draws from those modules, so the scheduler swaps its
own states in around the one call that draws (``_checkpoint_or_exploit``) and back out after.

Ray is pinned (2.60): the two private controller calls below, and the drawing call, are pinned by
``tests/test_pbt_scheduler.py``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray
from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler


class SeededPbt(PopulationBasedTraining):
    """Tune's PBT drawing from generators of its own, seeded by ``seed`` (see the module)."""

    def __init__(self, seed: int, **pbt: Any) -> None:
        super().__init__(**pbt)
        self._random_state = random.Random(seed).getstate()
        self._numpy_state = np.random.RandomState(seed % 2**32).get_state()  # (numpy's seeds: 32 bits)

    @contextmanager
    def own_draws(self) -> Iterator[None]:
        """Within: ``random`` and ``numpy.random`` draw from this scheduler's generators."""
        saved = random.getstate(), np.random.get_state()
        random.setstate(self._random_state)
        np.random.set_state(self._numpy_state)
        try:
            yield
        finally:
            self._random_state, self._numpy_state = random.getstate(), np.random.get_state()
            random.setstate(saved[0])
            np.random.set_state(saved[1])

    def _checkpoint_or_exploit(self, *args: Any, **kwargs: Any) -> None:
        with self.own_draws():
            super()._checkpoint_or_exploit(*args, **kwargs)


class SynchronousPbt(SeededPbt):
    """``SeededPbt(synch=True, **pbt)`` keeping unexploited trials running. ``trial_resources``
    is what one trial holds while it waits (its workers' CPUs and GPUs)."""

    def __init__(self, trial_resources: dict[str, float], seed: int, **pbt: Any) -> None:
        super().__init__(seed, synch=True, **pbt)
        self._trial_resources = trial_resources
        self._waiting: list[Trial] = []  # RUNNING at the perturbation time, in arrival order

    def on_trial_result(self, tune_controller: Any, trial: Trial, result: dict[str, Any]) -> str:
        self._count_errored_as_arrived(tune_controller)
        sync = self._next_perturbation_sync
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision == TrialScheduler.CONTINUE:  # not at the perturbation time
            return decision
        perturbed = self._next_perturbation_sync != sync
        if perturbed:
            waiting, self._waiting = self._waiting, []
            for other in waiting:
                _resume(tune_controller, other)
        if not self._population_fits(tune_controller):
            return decision  # Tune's: PAUSE (NOOP when exploited)
        if not perturbed:  # the others are not there yet
            self._waiting.append(trial)
            return TrialScheduler.NOOP
        return TrialScheduler.NOOP if trial.status == Trial.PAUSED else TrialScheduler.CONTINUE

    def choose_trial_to_run(self, tune_controller: Any) -> Trial | None:
        self._perturb_without_the_missing(tune_controller)
        return super().choose_trial_to_run(tune_controller)

    def on_trial_error(self, tune_controller: Any, trial: Trial) -> None:
        self._forget(trial)  # an errored trial is recovered (a new first result) or ends

    def on_trial_complete(self, tune_controller: Any, trial: Trial, result: dict[str, Any]) -> None:
        self._forget(trial)

    def on_trial_remove(self, tune_controller: Any, trial: Trial) -> None:
        self._forget(trial)

    def _forget(self, trial: Trial) -> None:
        if trial in self._waiting:
            self._waiting.remove(trial)

    def _perturb_without_the_missing(self, tune_controller: Any) -> None:
        """When no trial still training stands between the waiting ones and the perturbation time
        (the one they waited for ended), present the last arrival's result again: Tune's code
        then perturbs those there."""
        if not self._waiting:
            return
        self._count_errored_as_arrived(tune_controller)
        behind = [
            t
            for t in tune_controller.get_live_trials()
            if t not in self._waiting and self._trial_state[t].last_train_time < self._next_perturbation_sync
        ]
        if behind:
            return
        last = self._waiting.pop()
        result = self._trial_state[last].last_result
        assert result is not None  # it waits because its result reached the perturbation time
        if self.on_trial_result(tune_controller, last, result) == TrialScheduler.PAUSE:
            tune_controller.pause_trial(last)  # the population no longer fits: Tune's way
        elif last not in self._waiting:
            _resume(tune_controller, last)

    def _count_errored_as_arrived(self, tune_controller: Any) -> None:
        """An errored trial stays among Tune's live trials, where synchronous PBT would wait for
        it forever: it counts as at the perturbation time (it is out of the quantiles, being
        finished, and the next perturbation time follows the others' train times as before)."""
        for trial in tune_controller.get_trials():
            state = self._trial_state.get(trial)
            if trial.status == Trial.ERROR and state is not None:
                # Tune types it int; it holds the time attribute's values (govray's steps).
                state.last_train_time = max(state.last_train_time, int(self._next_perturbation_sync))

    def _population_fits(self, tune_controller: Any) -> bool:
        """Whether every unfinished trial can hold its resources at once."""
        trials = sum(not t.is_finished() for t in tune_controller.get_live_trials())
        cluster = ray.cluster_resources()
        return all(
            trials * amount <= cluster.get(name, 0.0) for name, amount in self._trial_resources.items()
        )


def _resume(tune_controller: Any, trial: Trial) -> None:
    """Ask a waiting trial PBT kept for its next result; clear what an exploited one's stop left."""
    # The controller behind Tune's TrialRunnerWrapper (schedulers see the wrapper).
    controller = getattr(tune_controller, "_tune_controller", tune_controller)
    if trial.status == Trial.PAUSED:
        # Exploited: TuneController.pause_trial stopped it, caching STOP for a save still in
        # flight whose result it discarded; the restarted trial must not inherit that STOP.
        controller._cached_trial_decisions.pop(trial.trial_id, None)
    elif trial.status == Trial.RUNNING:
        if trial.is_saving:  # Tune runs the cached decision once the save is in
            controller._cached_trial_decisions[trial.trial_id] = TrialScheduler.CONTINUE
        else:
            controller._schedule_trial_train(trial)  # what a CONTINUE decision runs
