"""Options and helpers shared by the CLI's command groups.

Every command module imports this one, so it stays light: what it needs from the experiment file or
the store is imported where it is used.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from govray.core.identifiers import IdentifierError, parse_id

if TYPE_CHECKING:
    from govray.config.experiment import ExperimentConfig
    from govray.tracking.store import TrackingStore

# Piped output (logs, CI) gets wide lines rather than folded ids and digests.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)

ConfigArgument = typer.Argument(..., exists=False, help="Experiment file (YAML).")
Database = typer.Option(
    None,
    "--database",
    envvar="GOVRAY_DATABASE",
    help="Tracking store URL (default: store.database_url in GOVRAY_HOME/config.yaml).",
)
AllowUnsigned = typer.Option(
    False, "--allow-unsigned-policy", help="Run with an unsigned policy (recorded in the audit log)."
)


def database_url(database: str | None) -> str | None:
    """The tracking store a command opens: ``--database`` (or ``GOVRAY_DATABASE``), else the
    ``store.database_url`` setting (``govray.core.settings``); None when neither names one."""
    if database:
        return database
    from govray.core.settings import load_settings

    return load_settings().store.database_url


def open_store(database: str | None) -> TrackingStore:
    """The tracking store :func:`database_url` names; ``ConfigError`` (exit 2) when none does."""
    from govray.core.errors import ConfigError
    from govray.core.settings import settings_path
    from govray.tracking.store import TrackingStore

    url = database_url(database)
    if not url:
        raise ConfigError(
            "no tracking store given: --database URL, GOVRAY_DATABASE, or store.database_url in "
            f"{settings_path()}"
        )
    return TrackingStore.open(url)


def open_experiment(path: Path) -> tuple[ExperimentConfig, TrackingStore]:
    from govray.config.experiment import load_experiment
    from govray.tracking.store import TrackingStore

    config = load_experiment(path)
    return config, TrackingStore.open(config.database_url)


def table(*headers: str) -> Table:
    """A table whose cells wrap instead of cutting ids and digests short."""
    result = Table()
    for header in headers:
        result.add_column(header, overflow="fold")
    return result


Strict = typer.Option(
    False, "--strict", help="Refuse (instead of warn) when a corpus changed since the last run."
)


def warn(message: str) -> None:
    console.print(f"[bold yellow]warning:[/] {message}", highlight=False)


def record_id(text: str) -> int:
    """An id on the command line: ASCII digits within 1..2^63-1 (``int`` would read other scripts'
    digits, and pass 10^30 on to the database)."""
    try:
        return parse_id(text, "", low=1)
    except IdentifierError as error:
        raise typer.BadParameter(str(error).strip()) from None
