"""`govray search` shows one progress view (trials, rungs, best so far, objective) instead of Ray
Tune's tables: the state read from Tune's trials and its rendering, without Ray."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from govray.cli.search_lines import LinePrinter, progress_line
from govray.config.experiment import load_experiment
from govray.platform.search.progress import SearchState, TrialProgress, objective_label, search_state
from govray.train.run.session import EARLY_STOP_KEY, LAST_KEY
from searchers.asha import rung_steps
from tests.helpers.search import search_example


def tune_trial(
    status: str, *objectives: float, step: int = 0, last: bool = False, early_stop: bool = False
) -> Any:
    """What the view reads of a Tune trial: its status, last result and Tune's min/max of the objective."""
    result: dict[str, Any] = {}
    if objectives:
        result = {
            "step": step,
            "objective": objectives[-1],
            "training_iteration": len(objectives),
            LAST_KEY: int(last or early_stop),
            EARLY_STOP_KEY: int(early_stop),
        }
    analysis = {"objective": {"min": min(objectives), "max": max(objectives)}} if objectives else {}
    return SimpleNamespace(status=status, last_result=result, metric_analysis=analysis, row=0)


def numbered(*trials: Any, first: int = 7) -> list[Any]:
    for index, trial in enumerate(trials):
        trial.row = first + index
    return list(trials)


def test_the_state_counts_tunes_trials_and_keeps_the_best_objective_with_its_trial() -> None:
    trials = numbered(
        tune_trial("TERMINATED", 0.9, 0.5, 0.4, step=30, last=True),  # 7: completed
        tune_trial("TERMINATED", 0.8, 0.3, step=20),  # 8: ASHA stopped it; its best is the best
        tune_trial("TERMINATED", 0.7, step=10, early_stop=True),  # 9: its own early stopping
        tune_trial("RUNNING", 0.6, 0.5, step=20),  # 10
        tune_trial("PAUSED", 0.9, step=10),  # 11: waiting on synchronous PBT
        tune_trial("RUNNING"),  # 12: before its first validation
        tune_trial("ERROR", 0.95, step=10),  # 13
        tune_trial("PENDING"),  # no row yet
    )
    asked: list[int] = []

    def number(trial: Any) -> int:
        asked.append(trial.row)
        return int(trial.row)

    state = search_state(trials, 12, "validation_loss", True, number)
    assert asked == [7, 8, 9, 10, 11, 12, 13]  # a pending trial gets no row
    assert [t.status for t in state.trials] == [
        "completed",
        "stopped early",
        "stopped early",
        "running",
        "running",
        "running",
        "errored",
        "pending",
    ]
    assert (state.count("completed"), state.count("stopped early"), state.count("errored")) == (1, 2, 1)
    assert [(t.number, t.step, t.rung, t.objective) for t in state.running] == [
        (10, 20, 2, 0.5),  # rung: validations reported
        (11, 10, 1, 0.9),
        (12, 0, 0, None),
    ]
    assert state.best == (0.3, 8)  # Tune's minimum over all of a trial's results, not its last
    assert search_state(trials, 12, "validation_accuracy", False, number).best == (0.95, 13)
    assert search_state(trials, 4, "validation_loss", True, number).planned == 8  # never fewer than seen

    asha = search_state(trials, 12, "validation_loss", True, number, rungs=[10, 20, 40])
    rungs = [(t.number, t.rung) for t in asha.trials[:6]]
    assert rungs == [(7, 2), (8, 2), (9, 1), (10, 2), (11, 1), (12, 0)]


def test_asha_rungs_are_grace_period_times_divisor_powers_up_to_max_t() -> None:
    assert rung_steps(20, 10, 2.0) == [10, 20] and rung_steps(64, 4, 4.0) == [4, 16, 64]
    assert rung_steps(100, 4, 2.5) == [4, 10, 25, 63]  # a trial passes a rung at its first report after it


def test_the_objective_is_named_as_the_trials_compute_it(tmp_path: Path) -> None:
    def label(name: str, **searcher: Any) -> str:
        return objective_label(load_experiment(search_example(tmp_path / name, {"name": "grid", **searcher})))

    assert label("plain") == "validation_loss"
    assert label("penalized", memorization_lambda=0.1) == "validation_loss+0.1·mem"
    larger = {"metric": "validation_accuracy", "smaller_is_better": False, "memorization_lambda": 0.25}
    assert label("larger", **larger) == "validation_accuracy-0.25·mem"


def running(number: int, rung: int, step: int = 10) -> TrialProgress:
    return TrialProgress(number, "running", step, rung, 0.5)


def test_the_progress_line_shows_trials_ended_of_planned_the_best_and_the_running_trials_rungs() -> None:
    objective = "validation_loss+0.1·mem"
    assert progress_line(SearchState(objective, 48)) == "search 0/48 trials · 0 running"
    state = SearchState(
        objective,
        48,
        (
            *(TrialProgress(n, "completed", 40, 3, 0.3) for n in range(1, 6)),
            *(TrialProgress(n, "stopped early", 10, 1, 0.9) for n in range(6, 12)),
            TrialProgress(12, "errored", 0, 0, None),
            running(14, 2, 20),
            running(13, 1),
            running(15, 1),
            TrialProgress(0, "pending", 0, 0, None),
        ),
        best=(0.21434, 7),
    )
    assert progress_line(state) == (
        "search 12/48 trials · 3 running · 5 completed · 6 stopped early · 1 errored · "
        "best validation_loss+0.1·mem 0.2143 (trial 7) · rung 2: trial 14; rung 1: trials 13, 15"
    )


def test_without_a_terminal_a_change_is_printed_at_most_every_interval_and_the_end_at_once() -> None:
    now = [0.0]
    printed: list[str] = []
    printer = LinePrinter(printed.append, interval=5.0, clock=lambda: now[0])

    def at(seconds: float, *trials: TrialProgress) -> None:
        now[0] = seconds
        printer.show(SearchState("validation_loss", 2, trials))

    at(0.0)
    at(1.0, running(1, 0))  # held back: the last line is 1 s old
    at(5.0, running(1, 0))  # 5 s later: the held change
    at(6.0, running(1, 0))  # no change, nothing printed
    at(7.0, running(1, 1))
    printer.flush()  # the search ended in between: the held line still appears
    at(8.0, TrialProgress(1, "completed", 20, 2, 0.4), TrialProgress(2, "completed", 20, 2, 0.5))
    assert printed == [
        "search 0/2 trials · 0 running",
        "search 0/2 trials · 1 running · rung 0: trial 1",
        "search 0/2 trials · 1 running · rung 1: trial 1",
        "search 2/2 trials · 0 running · 2 completed",  # every trial ended: at once
    ]
