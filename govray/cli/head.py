"""``govray up`` and ``govray down``: this machine's Ray head, started once for every command."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from govray.cli.common import console


def up(
    port: int = typer.Option(6379, "--port", help="The head's GCS port (Ray's default 6379)."),
    num_cpus: int | None = typer.Option(None, "--num-cpus", help="CPUs to offer (default: all)."),
    temp_dir: Path | None = typer.Option(
        None, "--temp-dir", help="Ray's temp dir for the head (default: a new /tmp/govray-ray-*)."
    ),
) -> None:
    """Start a local Ray head that every later command joins (until ``govray down``), so each
    command pays Ray's start once; a no-op when one is running."""
    from govray.core.rayhead import govray_head, settle_token_auth, start_head

    running = govray_head()
    if running is not None:
        console.print(f"Ray is already running at {running.address} (started by govray up)", highlight=False)
        return
    notice = settle_token_auth(starting=True)
    if notice is not None:
        print(f"govray: {notice}", file=sys.stderr)
    head = start_head(port=port, num_cpus=num_cpus, temp_dir=temp_dir)
    console.print(
        f"started Ray at {head.address} ({head.num_cpus} CPUs, logs under {head.temp_dir}); "
        "govray commands on this machine join it; `govray down` stops it",
        highlight=False,
    )


def down() -> None:
    """Stop the Ray head ``govray up`` started (and nothing else: other Ray instances on this
    machine keep running); a no-op when none is running."""
    from govray.core.rayhead import stop_head

    stopped = stop_head()
    if stopped is None:
        console.print("no Ray started by govray up is running", highlight=False)
        return
    console.print(f"stopped Ray at {stopped.address}", highlight=False)
