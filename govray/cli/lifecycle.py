"""``govray experiment pause | activate | kill | fork``."""

from __future__ import annotations

from pathlib import Path

import typer

from govray.cli.common import AllowUnsigned, Database, Strict, console, open_store
from govray.cli.run import progress_bar, report
from govray.config.experiment import ExperimentConfig
from govray.platform.lifecycle import LATEST, activate, fork, request_kill, request_pause, wait_while_active
from govray.tracking.store import TrackingStore

ExperimentArgument = typer.Argument(..., help="Experiment id, or name (the newest of that name).")
Wait = typer.Option(
    0.0, "--wait", min=0.0, help="Seconds to wait for the running driver to act on the request."
)


def _outcome_of_wait(store: TrackingStore, experiment: str, wait: float, verb: str) -> None:
    if not wait:
        console.print(f"{verb} requested: the running trial stops at its next step boundary")
        return
    found = wait_while_active(store, experiment, wait)
    if found.state == "active":
        console.print(
            f"experiment {found.id} is still active after {wait:g} s: is its driver alive? "
            f"(a driver that died is continued with `govray resume {found.id}`)"
        )
        raise typer.Exit(1)
    console.print(f"experiment {found.id} '{found.name}' is {found.state}")


def pause(experiment: str = ExperimentArgument, wait: float = Wait, database: str | None = Database) -> None:
    """Checkpoint the running trial at its next step boundary and stop; `activate` continues it."""
    store = open_store(database)
    request_pause(store, experiment)
    _outcome_of_wait(store, experiment, wait, "pause")


def kill(
    experiment: str = ExperimentArgument,
    wait: float = Wait,
    force: bool = typer.Option(
        False, "--force", help="Mark an active experiment killed without its driver (the driver died)."
    ),
    database: str | None = Database,
) -> None:
    """Stop the experiment for good (a running trial stops at its next step boundary)."""
    store = open_store(database)
    found = request_kill(store, experiment, force=force)
    if found.state == "killed":
        console.print(f"experiment {found.id} '{found.name}' is killed")
        return
    _outcome_of_wait(store, experiment, wait, "kill")


def activate_command(experiment: str = ExperimentArgument, database: str | None = Database) -> None:
    """Continue a paused experiment from its pause checkpoint; this process drives the run."""
    from govray.platform.run.preflight import check_policy

    store = open_store(database)
    with progress_bar() as update:
        outcome = activate(store, experiment, progress=update)
    found = store.get_experiment(experiment)
    config = ExperimentConfig.model_validate_json(found.config_json)
    report(outcome, check_policy(config, store, allow_unsigned=config.policy.allow_unsigned), found)


def fork_command(
    experiment: str = ExperimentArgument,
    config: Path | None = typer.Option(
        None, "--config", help="Edited experiment file (default: the parent's recorded config)."
    ),
    from_checkpoint: str | None = typer.Option(
        None,
        "--from-checkpoint",
        help=f"Start from this checkpoint directory, or '{LATEST}' (the parent's newest kept one).",
    ),
    allow_unsigned: bool = AllowUnsigned,
    strict: bool = Strict,
    database: str | None = Database,
) -> None:
    """A new experiment from this one, the parent recorded in its lineage; trains it now."""
    from govray.platform.run.preflight import check_policy

    store = open_store(database)
    with progress_bar() as update:
        child, outcome = fork(
            store,
            experiment,
            config_path=config,
            from_checkpoint=from_checkpoint,
            allow_unsigned=allow_unsigned,
            strict=strict,
            progress=update,
        )
    console.print(f"experiment {child.id} '{child.name}' forked from experiment {child.parent_id}")
    recorded = ExperimentConfig.model_validate_json(child.config_json)
    report(outcome, check_policy(recorded, store, allow_unsigned=allow_unsigned), child)
