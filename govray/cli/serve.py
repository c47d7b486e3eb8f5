"""``govray serve``: the lineage app (``serve/``) on Ray Serve, until Ctrl-C.

govray never imports ``serve/`` (it sits above the library): the app is found by its import path
when the command runs, as ``serve run serve.app:app`` would find it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

from govray.cli.common import console
from govray.core.errors import ConfigError

APP_MODULE = "serve.app"


def serve(
    config: Path | None = typer.Option(
        None, "--config", help="Serve config YAML: database_url, trust, token, host, port."
    ),
    database: str | None = typer.Option(
        None,
        "--database",
        help="Tracking store URL (else GOVRAY_DATABASE_URL, GOVRAY_DATABASE or the config).",
    ),
    trust: Path | None = typer.Option(None, "--trust", help="Trust file /api/verify checks keys against."),
    host: str | None = typer.Option(None, "--host", help="Address to listen on (default 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", help="Port to listen on (default 8000)."),
) -> None:
    """Serve lineage, influence, row lookups, audit events and attestations over HTTP (JSON API
    under /api, OpenAPI at /openapi.json). The write token comes from GOVRAY_SERVE_TOKEN or the
    config, never the command line."""
    try:
        lineage_app = importlib.import_module(APP_MODULE)
    except ImportError as error:
        raise ConfigError(f"cannot import the lineage app {APP_MODULE!r}: {error}") from None
    overrides = {"database_url": database, "trust": trust, "host": host, "port": port}
    settings = lineage_app.ServeSettings.load(config, overrides)
    console.print(
        f"lineage app on http://{settings.host}:{settings.port}/api (OpenAPI at /openapi.json); "
        "Ctrl-C stops it",
        highlight=False,
    )
    lineage_app.start(settings, blocking=True)
