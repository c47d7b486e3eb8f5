"""What a running search shows: one view of its trials, in place of Ray Tune's tables.

After every step of Tune's loop, ``SearchProgress`` (a Tune ``Callback`` on the driver) reads
Tune's trials into a plain ``SearchState``: trials planned, running, completed, stopped early
and errored, the rung of each running trial, and the best objective so far with its trial. When
the state changed it goes to a view (``govray.cli.search_lines``): ``govray search`` redraws one
panel in a terminal, or prints one line per change at most every few seconds (ray job logs, CI)::

    search 3/3 trials · 0 running · 1 completed · 2 stopped early · best validation_loss 2.3054 (trial 1)

Trials are named by their id in the tracking store, as ``govray search`` lists them at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray.tune

from govray.config.experiment import ExperimentConfig
from govray.train.run.session import EARLY_STOP_KEY, LAST_KEY

TrialStatus = Literal["pending", "running", "completed", "stopped early", "errored"]
ENDED: tuple[TrialStatus, ...] = ("completed", "stopped early", "errored")


@dataclass(frozen=True)
class TrialProgress:
    number: int  # the trial's id in the tracking store (0 while pending: it has no row yet)
    status: TrialStatus
    step: int  # its last reported step (0 before its first validation)
    rung: int  # ASHA rungs passed, or validations reported for other schedulers
    objective: float | None  # its last objective


@dataclass(frozen=True)
class SearchState:
    """A search at one moment: plain data, rendered by the CLI (``govray.cli.search_lines``)."""

    objective: str  # the objective's definition, e.g. "validation_loss+0.1·mem"
    planned: int  # trials the search runs in all
    trials: tuple[TrialProgress, ...] = ()
    best: tuple[float, int] | None = None  # (best objective so far, its trial)

    def count(self, *statuses: TrialStatus) -> int:
        return sum(trial.status in statuses for trial in self.trials)

    @property
    def running(self) -> tuple[TrialProgress, ...]:
        return tuple(trial for trial in self.trials if trial.status == "running")


def objective_label(config: ExperimentConfig) -> str:
    """``metric ± λ·mem``, as the trials compute it (minus for larger-is-better metrics)."""
    searcher = config.searcher
    if searcher.memorization_lambda == 0:
        return searcher.metric
    sign = "+" if searcher.smaller_is_better else "-"
    return f"{searcher.metric}{sign}{searcher.memorization_lambda:g}·mem"


def asha_rung(step: int, rungs: Sequence[int]) -> int:
    """ASHA's rungs a trial at ``step`` has passed (the plan's milestone steps, ``notes['rungs']``)."""
    return sum(step >= milestone for milestone in rungs)


def trial_progress(trial: Any, number: int, rungs: Sequence[int] | None) -> TrialProgress:
    """One Tune trial (``status``, ``last_result``) as the view shows it."""
    result: dict[str, Any] = trial.last_result or {}
    step = int(result.get("step", 0))
    status: TrialStatus = {
        "PENDING": "pending",
        "RUNNING": "running",
        "PAUSED": "running",  # waiting on a synchronous scheduler (PBT)
        "ERROR": "errored",
    }.get(trial.status, "completed")  # type: ignore[assignment]
    if status == "completed" and (not result.get(LAST_KEY) or result.get(EARLY_STOP_KEY)):
        status = "stopped early"  # by the scheduler before its last step, or by its own early stopping
    rung = asha_rung(step, rungs) if rungs is not None else int(result.get("training_iteration", 0))
    objective = result.get("objective")
    return TrialProgress(number, status, step, rung, float(objective) if objective is not None else None)


def search_state(
    trials: Sequence[Any],
    planned: int,
    objective: str,
    smaller_is_better: bool,
    number: Callable[[Any], int],
    rungs: Sequence[int] | None = None,
) -> SearchState:
    """The search's state from Tune's trials (also those a resumed search finished before);
    ``number`` names a started trial (its tracking row)."""
    shown: list[TrialProgress] = []
    best: tuple[float, int] | None = None
    for trial in trials:
        started = trial.status != "PENDING"
        progress = trial_progress(trial, number(trial) if started else 0, rungs)
        shown.append(progress)
        extremes = trial.metric_analysis.get("objective")  # Tune's min and max over all its results
        if started and extremes is not None:
            value = float(extremes["min" if smaller_is_better else "max"])
            if best is None or (value < best[0] if smaller_is_better else value > best[0]):
                best = (value, progress.number)
    return SearchState(objective, max(planned, len(shown)), tuple(shown), best)


def _nowhere(state: SearchState) -> None:
    """The view of a callback Tune unpickled (``run_search`` gives a resumed search its own)."""


class SearchProgress(ray.tune.Callback):
    """On the driver: after each step of Tune's loop, the search's state for ``show`` when it changed."""

    def __init__(
        self,
        show: Callable[[SearchState], None],
        config: ExperimentConfig,
        number: Callable[[Any], int],
        rungs: Sequence[int] | None = None,
    ) -> None:
        self.show = show
        self.objective = objective_label(config)
        self.smaller_is_better = config.searcher.smaller_is_better
        self.number = number
        self.rungs = rungs
        self.planned = 0
        self.shown: SearchState | None = None

    def setup(
        self,
        stop: Any = None,
        num_samples: int | None = None,
        total_num_samples: int | None = None,  # grid points counted
        **info: Any,
    ) -> None:
        self.planned = total_num_samples or 0

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        state = search_state(
            trials, self.planned, self.objective, self.smaller_is_better, self.number, self.rungs
        )
        if state != self.shown:
            self.shown = state
            self.show(state)

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self.on_step_end(0, trials)

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its callbacks with the experiment; a view (a terminal, a stream) stays here.
        return {**self.__dict__, "show": _nowhere, "shown": None}
