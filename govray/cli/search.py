"""``govray search EXPERIMENT``: the experiment's hyperparameter search on Ray Tune."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from govray.cli.common import AllowUnsigned, ConfigArgument, Strict, console, open_experiment, table, warn

if TYPE_CHECKING:
    from govray.platform.search.driver import SearchOutcome
    from govray.platform.search.progress import SearchState
    from govray.tracking.store import TrackingStore


def search(
    config_path: Path = ConfigArgument, allow_unsigned: bool = AllowUnsigned, strict: bool = Strict
) -> None:
    """Verify, ingest, and search the hyperparameter space (every trial governed and recorded).

    Run again after an interruption: the search resumes where Tune left off, without rerunning
    finished trials."""
    from govray.platform.run.plan import RunPlanner
    from govray.platform.run.preflight import check_policy, ingest_experiment
    from govray.platform.search.began import use_search_code
    from govray.platform.search.driver import search_planned

    config, store = open_experiment(config_path)
    use_search_code(config, store)  # a search begun before: the code it began with
    checked = check_policy(config, store, allow_unsigned=allow_unsigned)
    planner = RunPlanner(config, checked)  # refused before the experiment exists
    experiment, _ = ingest_experiment(config, checked, store, strict=strict, warn=warn, check=planner)
    assert experiment.id is not None
    console.print(
        f"experiment {experiment.id} '{config.name}': {config.searcher.name} search, objective "
        f"{config.searcher.metric} + {config.searcher.memorization_lambda:g} x memorization_score"
    )
    with search_view() as show:
        outcome = search_planned(planner.plan, experiment, store, progress=show)
    show_outcome(store, outcome)


def show_outcome(store: TrackingStore, outcome: SearchOutcome) -> None:
    """Every trial of the search in a table, then the best."""
    listing = table("trial", "state", "hyperparameters", "steps", "objective", "memorization", "cloned from")
    for trial_id in outcome.trial_ids:
        trial = store.get_trial(trial_id)
        latest = {metric.name: metric for metric in store.metrics(trial_id)}
        objective = latest.get("objective")
        score = latest.get("memorization_score")
        listing.add_row(
            str(trial_id),
            trial.state,
            trial.hparams_json,
            str(latest["training_loss"].step) if "training_loss" in latest else "-",
            f"{objective.value:.4f}" if objective else "-",
            f"{score.value:.3f}" if score else "-",
            str(trial.cloned_from) if trial.cloned_from is not None else "-",
        )
    console.print(listing)
    console.print(
        f"best: trial {outcome.best_trial_id} {outcome.best_hparams} objective {outcome.best_objective:.4f}"
    )


@contextmanager
def search_view() -> Iterator[Callable[[SearchState], None]]:
    """The search's progress: one panel redrawn in a terminal, else one line per change at most
    every 5 seconds (ray job logs, CI)."""
    from govray.cli.search_lines import LinePrinter

    if console.is_terminal:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            yield lambda state: live.update(progress_panel(state))
        return
    printer = LinePrinter(lambda line: console.print(line, highlight=False, markup=False))
    try:
        yield printer.show
    finally:
        printer.flush()


def progress_panel(state: SearchState) -> RenderableType:
    """The terminal view: counts, the best so far, and a row for each running trial."""
    from govray.cli.search_lines import progress_best, progress_counts

    lines: list[RenderableType] = [Text(progress_counts(state))]
    if best := progress_best(state):
        lines.append(Text(best))
    if state.running:
        rows = Table("trial", "step", "rung", state.objective, box=None, padding=(0, 2, 0, 0))
        for trial in sorted(state.running, key=lambda t: t.number):
            shown = f"{trial.objective:.4f}" if trial.objective is not None else "-"
            rows.add_row(str(trial.number), str(trial.step), str(trial.rung), shown)
        lines.append(rows)
    return Group(*lines)
