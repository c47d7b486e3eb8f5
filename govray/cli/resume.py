"""``govray resume EXPERIMENT``: continue a run whose driver died, from its latest checkpoint."""

from __future__ import annotations

import typer

from govray.cli.common import console
from govray.cli.run import progress_bar, report
from govray.config.experiment import ExperimentConfig
from govray.tracking.store import TrackingStore


def resume(
    experiment: str = typer.Argument(..., help="Experiment id or name in the tracking store."),
    database: str = typer.Option(..., "--database", envvar="GOVRAY_DATABASE", help="Tracking store URL."),
) -> None:
    """Resume the experiment's interrupted (or paused) trial under its own Ray Train run name."""
    from govray.platform.preflight import check_policy
    from govray.platform.resume import resume_trial, use_interrupted_trial_code

    store = TrackingStore.open(database)
    recorded = store.get_experiment(experiment)
    config = ExperimentConfig.model_validate_json(recorded.config_json)
    use_interrupted_trial_code(config, store, recorded)  # the recorded trial, from any directory
    checked = check_policy(config, store, allow_unsigned=config.policy.allow_unsigned)
    console.print(f"resuming experiment {recorded.id} '{recorded.name}'")
    with progress_bar() as update:
        outcome = resume_trial(config, checked, recorded, store, progress=update)
    report(outcome, checked, recorded)
