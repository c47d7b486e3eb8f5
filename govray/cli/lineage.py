"""``govray lineage row CORPUS ROW``: which trials, steps, checkpoints and tensors a row reached."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from govray.cli.common import Database, console, open_store, table
from govray.core.identifiers import parse_id

if TYPE_CHECKING:
    from govray.provenance.row_reach import TrialReach

app = typer.Typer(help="Lineage: what a training row reached, from the schedule.", no_args_is_help=True)

SHOWN_STEPS = 12  # steps printed per trial in the table; --json lists them all (up to its cap)


@app.command("row")
def row(
    corpus: str = typer.Argument(..., help="Corpus id."),
    row_text: str = typer.Argument(..., metavar="ROW", help="Row number in the corpus (0-based)."),
    database: str | None = Database,
    as_json: bool = typer.Option(False, "--json", help="The whole answer as one JSON document."),
) -> None:
    """Every trial that ingested CORPUS, and what its row ROW reached there: the global steps whose
    update it joined, the checkpoints carrying it, and the parameter tensors its route updates.
    Exits 18 for an unknown or malformed corpus id, or a row that is not one (out of range, not
    ASCII digits)."""
    from govray.provenance.row_reach import LineageError, row_reach

    number = parse_id(row_text, f"corpus {corpus!r}: row", LineageError, low=0)
    reach = row_reach(open_store(database), corpus, number)
    if as_json:
        typer.echo(reach.model_dump_json(indent=2))
        return
    listing = table("experiment", "trial", "placement", "steps", "checkpoints", "model versions")
    for trial in reach.trials:
        listing.add_row(
            escape(f"{trial.experiment} ({trial.experiment_id})"),
            escape(f"{trial.trial_id} {trial.run_name or ''}".rstrip()),
            escape(_placement(trial)),
            escape(_steps(trial)),
            escape("\n".join(f"{c.id} @ step {c.step} ({c.state})" for c in trial.checkpoints) or "-"),
            escape(_versions(trial)),
        )
    reached = sum(1 for trial in reach.trials if trial.reached)
    console.print(
        f"row {number} of corpus '{escape(corpus)}' reached {reached} of {len(reach.trials)} trials"
    )
    console.print(listing)
    for trial in reach.trials:  # (below the table: a tensor name is never folded inside a cell)
        if trial.tensors:
            console.print(f"trial {trial.trial_id} updated: {escape(_tensors(trial))}", highlight=False)


def _versions(trial: TrialReach) -> str:
    """Each registered version of a checkpoint the row reached, and whether it still carries the
    row (a version that removed the row's adapter does not): what an erasure request asks."""
    lines = [
        f"{m.model}:{m.version} "
        + ("carries it" if m.carries_row else f"not: removed {', '.join(m.removed_adapters)}")
        for m in trial.models
    ]
    return "\n".join(lines) or "-"


def _tensors(trial: TrialReach) -> str:
    """The tensors, grouped by module (``hidden.weight, hidden.bias`` as ``hidden: weight, bias``)."""
    modules: dict[str, list[str]] = {}
    for tensor in trial.tensors:
        module, _, leaf = tensor.rpartition(".")
        modules.setdefault(module or tensor, []).append(leaf if module else "")
    return (
        "\n".join(
            f"{m}: {', '.join(filter(None, leaves))}" if any(leaves) else m for m, leaves in modules.items()
        )
        or "-"
    )


def _placement(trial: TrialReach) -> str:
    if trial.placement is None:
        return "unknown"
    if trial.placement.split == "holdout":
        return "holdout"
    return f"route {trial.placement.route}, row {trial.placement.position}"


def _steps(trial: TrialReach) -> str:
    if not trial.reached:
        return f"none: {trial.note}"
    shown = ", ".join(str(step) for step in trial.steps[:SHOWN_STEPS])
    more = trial.step_count - min(len(trial.steps), SHOWN_STEPS)
    text = f"{trial.step_count} of {trial.trained_steps}: {shown}{f' (+{more} more)' if more else ''}"
    if trial.reverted_steps:
        text += f"\nreverted by a rollback: {', '.join(map(str, trial.reverted_steps))}"
    return text
