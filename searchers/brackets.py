"""Adaptive ASHA's scheduler: Ray Tune's asynchronous HyperBand with Determined's brackets
(``searchers.adaptive_asha`` plans them). Its own module, since subclassing Tune's scheduler loads
Ray: validating an ``adaptive_asha`` section must not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray.tune.schedulers import AsyncHyperBandScheduler
from ray.tune.schedulers.async_hyperband import _Bracket

if TYPE_CHECKING:  # adaptive_asha imports this module when it plans: no import back at run time
    from searchers.adaptive_asha import BracketPlan


class DeterminedBrackets(AsyncHyperBandScheduler):
    """Tune's asynchronous HyperBand with Determined's brackets and its trial quotas per bracket."""

    def __init__(self, grace: int, max_t: int, divisor: float, plans: list[BracketPlan]) -> None:
        super().__init__(time_attr="step", max_t=max_t, grace_period=grace, reduction_factor=divisor)
        self.plans = plans
        self._brackets = [_Bracket(plan.milestones[0], max_t, divisor, 0) for plan in plans]
        for bracket, plan in zip(self._brackets, plans, strict=True):
            # Tune derives the rungs from floating-point logs; the plan's milestones are exact.
            bracket._rungs = [(milestone, {}) for milestone in reversed(plan.milestones)]
        self.assigned = [0] * len(plans)  # trials given to each bracket so far
        self.running: dict[str, int] = {}  # Tune trial id → its bracket's index

    def bracket_of(self, trial_id: str) -> int | None:
        return self.running.get(trial_id)

    def _next_bracket(self) -> int:
        """The bracket with a free concurrency slot that has had the smallest share of its quota
        (ties: the one that stops most); past every quota, the least loaded."""
        active = [list(self.running.values()).count(index) for index in range(len(self.plans))]

        def load(index: int) -> tuple[bool, bool, float, int]:
            plan = self.plans[index]
            return (
                self.assigned[index] >= plan.max_trials,
                active[index] >= plan.max_concurrent,
                self.assigned[index] / plan.max_trials,
                index,
            )

        return min(range(len(self.plans)), key=load)

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        super().on_trial_add(tune_controller, trial)  # checks metric and mode (draws a bracket)
        if trial.trial_id not in self.running:
            index = self._next_bracket()
            self.assigned[index] += 1
            self.running[trial.trial_id] = index
        self._trial_info[trial.trial_id] = self._brackets[self.running[trial.trial_id]]

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> None:
        super().on_trial_complete(tune_controller, trial, result)
        self.running.pop(trial.trial_id, None)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        super().on_trial_remove(tune_controller, trial)
        self.running.pop(trial.trial_id, None)
