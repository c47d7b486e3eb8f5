"""``govray trial logs``."""

from __future__ import annotations

from pathlib import Path

import typer

from govray.cli.common import Database
from govray.errors import GovrayError
from govray.logs import follow_logs, log_dir, read_logs
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Trial, TrialState

app = typer.Typer(help="Trials in the tracking store.", no_args_is_help=True)

# States in which a trial's workers may still write; --follow stops once the trial left them.
WRITING_STATES = frozenset({TrialState.PENDING.value, TrialState.ACTIVE.value})


@app.command()
def logs(
    trial_id: int = typer.Argument(..., help="Trial id."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing new lines until the trial stops running."
    ),
    database: str = Database,
) -> None:
    """Print the trial's worker logs, every rank's lines merged by time."""
    store = TrackingStore.open(database)
    trial = store.get_trial(trial_id)
    directory = _log_directory(store, trial)
    if follow:
        lines = follow_logs(directory, done=lambda: store.get_trial(trial_id).state not in WRITING_STATES)
    else:
        lines = iter(read_logs(directory))
    printed = 0
    for line in lines:
        typer.echo(line)
        printed += 1
    if printed == 0:
        state = store.get_trial(trial_id).state
        raise GovrayError(f"trial {trial_id} ({state}) has no worker logs in {directory}")


def _log_directory(store: TrackingStore, trial: Trial) -> Path:
    if trial.ray_run_name is None:
        raise GovrayError(
            f"trial {trial.id} ({trial.state}) has no Ray run name yet: it never started, so it has no logs"
        )
    storage = store.get_experiment(trial.experiment_id).storage_path
    if "://" in storage:
        raise GovrayError(f"trial {trial.id} keeps its logs in remote storage {storage}; read them there")
    return log_dir(storage, trial.ray_run_name)
