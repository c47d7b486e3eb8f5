"""``govray experiments list``."""

from __future__ import annotations

from pathlib import Path

import typer

from govray.cli.common import console, table
from govray.config import load_experiment
from govray.errors import ConfigError
from govray.tracking.store import TrackingStore

app = typer.Typer(help="Experiments in the tracking store.", no_args_is_help=True)


@app.command("list")
def list_experiments(
    database: str | None = typer.Option(
        None, "--database", envvar="GOVRAY_DATABASE", help="Tracking store URL."
    ),
    config: Path | None = typer.Option(None, "--config", help="Use this experiment file's tracking store."),
) -> None:
    """List experiments, newest last."""
    if database is None and config is None:
        raise ConfigError("give --database URL (or GOVRAY_DATABASE) or --config EXPERIMENT.yaml")
    url = database if database is not None else load_experiment(config).database_url  # type: ignore[arg-type]
    store = TrackingStore.open(url)
    listing = table("id", "name", "state", "created", "config digest", "policy digest")
    for experiment in store.list_experiments():
        listing.add_row(
            str(experiment.id),
            experiment.name,
            experiment.state,
            experiment.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            experiment.config_digest[:12],
            (experiment.policy_digest or "-")[:12],
        )
    console.print(listing)
