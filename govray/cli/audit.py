"""``govray audit verify|list``: read and check the hash-chained audit log of governance events."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import typer
from rich.markup import escape

from govray.cli.common import Database, console, open_store, table
from govray.core.errors import TrackingError
from govray.tracking.audit import AuditEventType, AuditLog

app = typer.Typer(help="The audit log: verify its hash chain, list its events.", no_args_is_help=True)


@app.command("verify")
def verify(database: str | None = Database) -> None:
    """Check the whole hash chain; exits 8 naming the first edited, missing or reordered event."""
    count = AuditLog(open_store(database)).verify()
    console.print(f"audit log intact: {count} events, hash chain verified from seq 1")


@app.command("list")
def list_events(
    database: str | None = Database,
    experiment: str | None = typer.Option(None, "--experiment", help="Experiment id or name."),
    event_type: str | None = typer.Option(
        None, "--type", help=f"Event type ({', '.join(member.value for member in AuditEventType)})."
    ),
    since: str | None = typer.Option(None, "--since", help="ISO time (UTC when no offset): at or after."),
    until: str | None = typer.Option(None, "--until", help="ISO time (UTC when no offset): before."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document per line."),
) -> None:
    """Events in chain order, filtered by experiment, type and time."""
    store = open_store(database)
    experiment_id = store.get_experiment(experiment).id if experiment is not None else None
    events = AuditLog(store).list(
        experiment_id, event_type, _moment(since, "--since"), _moment(until, "--until")
    )
    if as_json:
        for event in events:
            document = event.model_dump()
            document["payload"] = json.loads(document.pop("payload_json"))
            typer.echo(json.dumps(document, sort_keys=True))
        return
    listing = table("seq", "at", "type", "experiment", "actor", "payload")
    for event in events:
        listing.add_row(
            str(event.seq),
            event.at,
            event.event_type,
            "-" if event.experiment_id is None else str(event.experiment_id),
            escape(event.actor),
            escape(event.payload_json),
        )
    console.print(listing)


def _moment(text: str | None, option: str) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise TrackingError(f"{option} {text!r} is not an ISO time (e.g. 2026-11-22T04:00:00)") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
