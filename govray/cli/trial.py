"""``govray trial logs``."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from govray.cli.common import Database, open_store, record_id
from govray.core.errors import GovrayError
from govray.core.logs import follow_logs, log_dir, read_logs
from govray.tracking.tables import TrialState

if TYPE_CHECKING:
    from govray.core.storage import Storage

app = typer.Typer(help="Trials in the tracking store.", no_args_is_help=True)

# States in which a trial's workers may still write; --follow stops once the trial left them.
WRITING_STATES = frozenset({TrialState.PENDING.value, TrialState.ACTIVE.value})
REMOTE_POLL_S = 5.0  # how often --follow asks object storage for longer copies


@app.command()
def logs(
    trial_id: int = typer.Argument(..., parser=record_id, help="Trial id."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing new lines until the trial stops running."
    ),
    database: str | None = Database,
) -> None:
    """Print the trial's worker logs, every rank's lines merged by time (with object storage, the
    copies in the bucket: each rank's log as of its last checkpoint, whole once it ended)."""
    from govray.core.storage import open_storage

    store = open_store(database)
    trial = store.get_trial(trial_id)
    if trial.ray_run_name is None:
        raise GovrayError(
            f"trial {trial.id} ({trial.state}) has no Ray run name yet: it never started, so it has no logs"
        )
    storage = open_storage(store.get_experiment(trial.experiment_id).storage_path)
    with _readable(storage, log_dir(storage.root, trial.ray_run_name)) as (directory, refresh):

        def done() -> bool:
            refresh()
            return store.get_trial(trial_id).state not in WRITING_STATES

        refresh()
        if follow:
            lines = follow_logs(directory, done=done, poll=REMOTE_POLL_S if storage.is_remote else 0.3)
        else:
            lines = iter(read_logs(directory))
        printed = 0
        for line in lines:
            typer.echo(line)
            printed += 1
    if printed == 0:
        where = storage.uri_of(log_dir(storage.root, trial.ray_run_name))
        raise GovrayError(
            f"trial {trial_id} ({store.get_trial(trial_id).state}) has no worker logs in {where}"
        )


@contextlib.contextmanager
def _readable(storage: Storage, directory: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """The directory to read the logs from and how to bring it up to date: the run's log directory
    itself, or for object storage a temporary mirror of the bucket's copies (this node's cache
    may hold a live file a worker here appends to)."""
    if not storage.is_remote:
        yield directory, lambda: None
        return
    mirror = Path(tempfile.mkdtemp(prefix="govray-logs-"))

    def refresh() -> None:
        for name in storage.list_files(directory):
            storage.pull_growing(directory / name, mirror / name)

    try:
        yield mirror, refresh
    finally:
        shutil.rmtree(mirror, ignore_errors=True)
