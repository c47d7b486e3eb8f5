"""``govray model register | list | versions | describe | tag | remove-adapter``: the registry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from govray.cli.common import Database, console, open_store, record_id, table
from govray.tracking.registry import list_models
from govray.tracking.store import TrackingStore

if TYPE_CHECKING:
    from govray.platform.registry.versions import RegisteredVersion

app = typer.Typer(
    help="The model registry: versions of checkpoints, tags, adapter removal.", no_args_is_help=True
)

Tags = typer.Option([], "--tag", help="KEY=VALUE; repeat for more.")


@app.command("register")
def register_command(
    name: str = typer.Argument(..., help="Model name (letters, digits, ._-)."),
    checkpoint: Path | None = typer.Argument(
        None, help="A checkpoint directory the tracking store recorded (or give --trial)."
    ),
    trial: int | None = typer.Option(
        None,
        "--trial",
        parser=record_id,
        help="Register this completed trial's final checkpoint (a run's or a search trial's).",
    ),
    database: str | None = Database,
    description: str = typer.Option("", "--description"),
    tags: list[str] = Tags,
) -> None:
    """Verify and attest CHECKPOINT (or trial N's final checkpoint), then register it as NAME's
    next version; prints the version and the directory its files are in."""
    from govray.platform.registry.register import register, register_trial

    if (checkpoint is None) == (trial is None):
        raise typer.BadParameter("give a CHECKPOINT directory or --trial N (one of them)")
    store = open_store(database)
    if trial is not None:
        version = register_trial(store, name, trial, description=description, tags=_pairs(tags))
    else:
        assert checkpoint is not None
        version = register(store, name, checkpoint, description=description, tags=_pairs(tags))
    source = f"trial {version.checkpoint.trial_id}, step {version.checkpoint.step}"
    console.print(f"registered {version.ref} ({source}) ← {version.directory}", highlight=False)
    _mirror(store, version)


@app.command("list")
def list_command(database: str | None = Database) -> None:
    """Registered models and how many versions each has."""
    listing = table("model", "versions", "description", "created")
    for model, count in list_models(open_store(database)):
        listing.add_row(
            escape(model.name), str(count), escape(model.description), model.created_at.isoformat()
        )
    console.print(listing)


@app.command("versions")
def versions_command(name: str = typer.Argument(...), database: str | None = Database) -> None:
    """The versions of model NAME, oldest first."""
    from govray.platform.registry.versions import versions

    listing = table("version", "checkpoint", "step", "tags", "removed adapters", "excluded corpora")
    for version in versions(open_store(database), name):
        listing.add_row(
            str(version.version),
            escape(version.checkpoint.uuid),
            str(version.checkpoint.step),
            escape(json.dumps(version.tags, sort_keys=True)),
            escape(", ".join(version.removed_adapters) or "-"),
            escape(", ".join(version.excluded_corpora) or "-"),
        )
    console.print(listing)


@app.command("describe")
def describe_command(
    ref: str = typer.Argument(..., help="NAME or NAME:VERSION."), database: str | None = Database
) -> None:
    """One version as JSON: files, checkpoint, tags, lineage, attestations."""
    from govray.platform.registry.versions import resolve, version_attestations

    store = open_store(database)
    version = resolve(store, ref)
    typer.echo(json.dumps(describe(version, [a.id for a in version_attestations(store, version)]), indent=2))


@app.command("tag")
def tag_command(
    ref: str = typer.Argument(..., help="NAME:VERSION."),
    pairs: list[str] = typer.Argument(None, help="KEY=VALUE tags to set."),
    remove: list[str] = typer.Option([], "--remove", help="A tag to remove; repeat for more."),
    database: str | None = Database,
) -> None:
    """Set or remove tags of a version."""
    from govray.platform.registry.register import set_tags

    version = set_tags(open_store(database), ref, _pairs(pairs or []), remove)
    console.print(f"{version.ref} tags: {json.dumps(version.tags, sort_keys=True)}", highlight=False)


@app.command("remove-adapter")
def remove_adapter_command(
    ref: str = typer.Argument(..., help="NAME:VERSION."),
    adapter: str = typer.Option(..., "--adapter", help="The adapter to leave out."),
    database: str | None = Database,
) -> None:
    """Make a new version without ADAPTER, attested with the corpora that leaves out."""
    from govray.platform.registry.register import remove_adapter

    store = open_store(database)
    version = remove_adapter(store, ref, adapter)
    excluded = ", ".join(version.excluded_corpora) or "none"
    console.print(f"{version.ref}: {version.directory} (excluded corpora: {excluded})", highlight=False)
    _mirror(store, version)


def describe(version: RegisteredVersion, attestation_ids: list[int | None]) -> dict[str, Any]:
    """A version as a JSON document."""
    from govray.platform.registry.versions import model_signature_of

    return {
        "model": version.model,
        "version": version.version,
        "directory": str(version.directory),
        "description": version.record.description,
        "tags": version.tags,
        "created_at": version.record.created_at.isoformat(),
        "checkpoint": {
            "id": version.checkpoint.id,
            "uuid": version.checkpoint.uuid,
            "trial_id": version.checkpoint.trial_id,
            "step": version.checkpoint.step,
            "path": version.checkpoint.path,
        },
        "parent_version_id": version.record.parent_id,
        "removed_adapters": list(version.removed_adapters),
        "excluded_corpora": list(version.excluded_corpora),
        "attestations": attestation_ids,
        "model_signature": str(model_signature_of(version)),
    }


def _mirror(store: TrackingStore, version: RegisteredVersion) -> None:
    """Mirror the version's experiment to MLflow when it names a server (a failure only warns)."""
    from govray.platform.mlflow_mirror import sync_experiment

    sync_experiment(store, store.get_trial(version.checkpoint.trial_id).experiment_id)


def _pairs(items: list[str]) -> dict[str, str]:
    from govray.platform.registry.versions import RegistryError

    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RegistryError(f"tag {item!r}: expected KEY=VALUE")
        pairs[key] = value
    return pairs
