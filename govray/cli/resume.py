"""``govray resume EXPERIMENT``: continue a run whose driver died, from its latest checkpoint."""

from __future__ import annotations

import typer

from govray.cli.common import Database, console, open_store
from govray.cli.run import progress_bar, report
from govray.config.experiment import ExperimentConfig
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment


def resume(
    experiment: str = typer.Argument(..., help="Experiment id or name in the tracking store."),
    database: str | None = Database,
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=1,
        help="Resume on this many workers (default: the experiment's resources.workers); the "
        "schedule keeps its slots per step, split among them.",
    ),
) -> None:
    """Resume the experiment's interrupted (or paused) trial under its own Ray Train run name; an
    experiment that ran a search resumes its search where Ray Tune left off."""
    from govray.platform.rerun.resume import (
        on_workers,
        resume_trial,
        resumes_search,
        use_interrupted_trial_code,
    )
    from govray.platform.run.preflight import check_policy

    store = open_store(database)
    recorded = store.get_experiment(experiment)
    configured = ExperimentConfig.model_validate_json(recorded.config_json)
    if resumes_search(configured, store, recorded):
        if workers is not None:
            raise typer.BadParameter(
                "a search's trials resume on their configured workers", param_hint="--workers"
            )
        _resume_search(configured, store, recorded)
        return
    try:
        config = on_workers(configured, workers)
    except ValueError as error:  # (pydantic's): e.g. an HSDP shard group that does not divide it
        raise typer.BadParameter(str(error), param_hint="--workers") from None
    use_interrupted_trial_code(config, store, recorded)  # the recorded trial, from any directory
    checked = check_policy(config, store, allow_unsigned=config.policy.allow_unsigned)
    resources = configured.resources
    before = f"{resources.min_workers} to {resources.max_workers}, elastic" if resources.elastic else None
    elsewhere = (
        f" on {config.resources.describe_workers()} (configured: {before or resources.max_workers}; "
        "each step keeps its run's slots, split among them)"
        if config.resources != resources
        else ""
    )
    console.print(f"resuming experiment {recorded.id} '{recorded.name}'{elsewhere}")
    with progress_bar() as update:
        outcome = resume_trial(config, checked, recorded, store, progress=update)
    report(outcome, checked, recorded)


def _resume_search(config: ExperimentConfig, store: TrackingStore, recorded: Experiment) -> None:
    from govray.cli.search import search_view, show_outcome
    from govray.core.storage import open_storage
    from govray.platform.run.preflight import check_policy
    from govray.platform.search.began import began_record
    from govray.platform.search.driver import resume_search

    began_record(store, open_storage(config.storage_path), config, recorded)  # its code, from any directory
    checked = check_policy(config, store, allow_unsigned=config.policy.allow_unsigned)
    console.print(
        f"resuming experiment {recorded.id} '{recorded.name}': its {config.searcher.name} search, "
        "where Ray Tune left off (finished trials are not run again)"
    )
    with search_view() as show:
        outcome = resume_search(config, checked, recorded, store, progress=show)
    show_outcome(store, outcome)
