"""``govray replay EXPERIMENT --exclude-corpus X``: the counterfactual run and its influence report."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from govray.cli.common import Database, console, open_store, record_id

if TYPE_CHECKING:
    from govray.platform.rerun.replay import InfluenceReport


def replay(
    experiment: str = typer.Argument(..., help="Experiment id or name in the tracking store."),
    exclude_corpus: list[str] = typer.Option(
        ..., "--exclude-corpus", help="Corpus to leave out (repeatable)."
    ),
    database: str | None = Database,
    trial: int | None = typer.Option(
        None,
        "--trial",
        parser=record_id,
        help="Trial to replay (default: the latest completed original; a replay only when named).",
    ),
) -> None:
    """Rerun a recorded trial with the corpus's schedule slots empty; report its influence."""
    from govray.platform.rerun.replay import replay_trial
    from govray.platform.rerun.world_history import describe_segments

    store = open_store(database)
    replayed = replay_trial(store, experiment, tuple(exclude_corpus), trial_id=trial)
    report = replayed.report
    if report.original_replay_of is not None:
        console.print(
            f"trial {report.original_trial} is itself a replay of trial {report.original_replay_of}"
            + (f" without {', '.join(report.already_excluded)}" if report.already_excluded else "")
            + ": this replay leaves those corpora out too and measures influence against it, "
            f"not against trial {report.original_replay_of}"
        )
    console.print(
        f"replay trial {report.replay_trial} ({report.replay_run}) of trial {report.original_trial} without "
        f"{', '.join(report.excluded_corpora)}: {report.step} steps"
    )
    console.print(describe_segments(replayed.segments), highlight=False)
    if len(replayed.lineage) > 1:  # a PBT clone: its state began as its donors'
        parts = [
            f"from step {entry.from_step} as {entry.run} trained it "
            f"({json.dumps(entry.hparams, sort_keys=True)})"
            for entry in replayed.lineage
        ]
        lineage = "replayed along the state's lineage: " + "; ".join(parts)
        console.print(lineage, highlight=False, markup=False)
    console.print(influence_table(report), highlight=False)
    console.print(f"influence report: {replayed.report_path}")


def influence_table(report: InfluenceReport) -> str:
    """The influence report, a line per tensor."""
    lines = [f"{'tensor':40} {'kind':9} {'direct examples':>15} {'distance':>12} {'relative':>10}"]
    for row in report.tensors:
        numbers = f"{row.direct_examples:>15} {row.distance:>12.6g} {row.relative:>10.3g}"
        lines.append(f"{row.tensor:40} {row.kind:9} {numbers}")
    return "\n".join(lines)
