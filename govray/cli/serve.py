"""``govray serve``: the lineage app (``serve/``) on Ray Serve, until Ctrl-C.

govray never imports ``serve/`` (it sits above the library): its settings are checked here
(``govray.config.serve``), and the app is started by what the ``lineage`` entry point of group
``govray.apps`` names (``serve.app:start`` in pyproject.toml), as searchers are found.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import typer

from govray.cli.common import console
from govray.config.serve import ServeSettings
from govray.core.errors import ConfigError

APP_GROUP = "govray.apps"
LINEAGE_APP = "lineage"

StartApp = Callable[..., str]  # start(settings, *, blocking) -> the app's base URL


def lineage_app() -> StartApp:
    """The installed lineage app's ``start`` (the entry point ``lineage`` in ``govray.apps``)."""
    found = {point.name: point for point in entry_points(group=APP_GROUP)}
    if LINEAGE_APP not in found:
        raise ConfigError(
            f"no lineage app is installed (entry point '{LINEAGE_APP}' in group {APP_GROUP}): "
            "reinstall govray (pip install -e .) to register serve.app:start"
        )
    start: StartApp = found[LINEAGE_APP].load()
    return start


def serve(
    config: Path | None = typer.Option(
        None, "--config", help="Serve config YAML: database_url, trust, token, host, port."
    ),
    database: str | None = typer.Option(
        None,
        "--database",
        help="Tracking store URL (else the config, GOVRAY_DATABASE or store.database_url in "
        "GOVRAY_HOME/config.yaml).",
    ),
    trust: Path | None = typer.Option(None, "--trust", help="Trust file /api/verify checks keys against."),
    host: str | None = typer.Option(None, "--host", help="Address to listen on (default 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", help="Port to listen on (default 8000)."),
) -> None:
    """Serve lineage, influence, row lookups, audit events and attestations over HTTP (JSON API
    under /api, OpenAPI at /openapi.json). The write token comes from serve.token in
    GOVRAY_HOME/config.yaml, GOVRAY_SERVE_TOKEN or the config, never the command line."""
    overrides = {"database_url": database, "trust": trust, "host": host, "port": port}
    settings = ServeSettings.load(config, overrides)
    start = lineage_app()
    console.print(
        f"lineage app on http://{settings.host}:{settings.port}/api (OpenAPI at /openapi.json); "
        "Ctrl-C stops it",
        highlight=False,
    )
    start(settings, blocking=True)
