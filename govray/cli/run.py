"""``govray run``: ingest, then a governed data-parallel run on Ray Train, with progress."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from govray.cli.common import AllowUnsigned, ConfigArgument, Strict, console, open_experiment, warn

if TYPE_CHECKING:
    from govray.platform.run.preflight import CheckedPolicy
    from govray.platform.run.runner import Progress as ProgressCallback
    from govray.platform.run.runner import TrialOutcome
    from govray.tracking.tables import Experiment

FromCheckpoint = typer.Option(
    None,
    "--from-checkpoint",
    help="Start from this checkpoint directory's weights and ledger (verified; kept as lineage).",
)


def run(
    config_path: Path = ConfigArgument,
    allow_unsigned: bool = AllowUnsigned,
    strict: bool = Strict,
    from_checkpoint: Path | None = FromCheckpoint,
    from_model: str | None = typer.Option(
        None,
        "--from-model",
        help="Fine-tune from this registered model version (NAME[:VERSION]); its attestation "
        "becomes a dependency of the new one.",
    ),
    resume_interrupted: bool = typer.Option(
        False,
        "--resume-interrupted",
        help="If this experiment has an interrupted or paused trial, continue it instead of starting anew.",
    ),
) -> None:
    """Verify the policy, ingest, and train the experiment's trial under governance."""
    from govray.config.hyperparameters import default_point_said
    from govray.platform.registry.register import start_reference
    from govray.platform.registry.versions import resolve
    from govray.platform.rerun.resume import interrupted_trial, resume_trial
    from govray.platform.run.plan import RunPlanner
    from govray.platform.run.preflight import check_policy, ingest_experiment
    from govray.platform.run.runner import run_planned

    config, store = open_experiment(config_path)
    start_model = None
    if from_model is not None:
        if from_checkpoint is not None:
            raise typer.BadParameter("give --from-checkpoint or --from-model, not both")
        version = resolve(store, from_model)
        from_checkpoint, start_model = version.directory, start_reference(store, version)
    checked = check_policy(config, store, allow_unsigned=allow_unsigned)
    # A run refused on its shards or start checkpoint is refused before its experiment exists; the
    # run then runs the plan that was checked.
    planner = RunPlanner(config, checked, from_checkpoint, start_model)
    experiment, ingested = ingest_experiment(config, checked, store, strict=strict, warn=warn, check=planner)
    assert experiment.id is not None
    policy = checked.policy.policy
    console.print(
        f"experiment {experiment.id} '{config.name}': {config.resources.describe_workers()}, "
        f"policy '{policy.name}' v{policy.version}, shards {ingested.manifest.key[:12]} "
        f"(row hash v{ingested.manifest.row_hash_version})"
    )
    if point := default_point_said(config.hyperparameters):
        console.print(f"hyperparameters at the space's default point (a search samples it): {point}")
    if resume_interrupted and (trial := interrupted_trial(store, experiment)) is not None:
        console.print(f"continuing interrupted trial {trial.id} ({trial.ray_run_name})")
        with progress_bar() as update:
            outcome = resume_trial(config, checked, experiment, store, progress=update)
    else:
        with progress_bar() as update:
            outcome = run_planned(planner.plan, experiment, store, progress=update)
    report(outcome, checked, experiment)


@contextmanager
def progress_bar() -> Iterator[ProgressCallback]:
    """A terminal progress bar: steps, elapsed, ETA, the world size and the latest metrics."""
    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[metrics]}"),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=None, metrics="")

        def update(step: int, max_steps: int, latest: dict[str, float], workers: int | None) -> None:
            shown = [f"{workers} worker{'s' if workers > 1 else ''}"] if workers is not None else []
            shown += [f"loss {latest['training_loss']:.4f}"] if "training_loss" in latest else []
            shown += [
                f"{name.removeprefix('validation_')} {value:.4f}"
                for name, value in sorted(latest.items())
                if name.startswith("validation_") and "/" not in name
            ]
            progress.update(task, completed=step, total=max_steps, metrics="  ".join(shown))

        yield update


def report(outcome: TrialOutcome, checked: CheckedPolicy, experiment: Experiment) -> None:
    """What a finished, paused or killed run prints."""
    from govray.cli.ledger_table import format_ledger

    if outcome.state != "completed":
        console.print(
            f"trial {outcome.trial_id} ({outcome.run_name}) {outcome.state} after {outcome.steps_done} "
            f"of {outcome.max_steps} steps"
            + (
                f"; continue with: govray experiment activate {experiment.id}"
                if outcome.state == "paused"
                else ""
            )
        )
        return
    metrics = outcome.metrics
    console.print(
        f"trial {outcome.trial_id} ({outcome.run_name}) completed {outcome.max_steps} steps: "
        f"validation loss {metrics.get('validation_loss', float('nan')):.4f}"
        + (f", accuracy {metrics['validation_accuracy']:.3f}" if "validation_accuracy" in metrics else "")
    )
    assert outcome.ledger is not None
    console.print("ledger: training examples that directly reached each layer (per corpus)")
    console.print(format_ledger(outcome.ledger, checked.routing), highlight=False)
