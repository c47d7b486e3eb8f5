"""``govray run``: ingest, then a governed data-parallel run on Ray Train, with progress."""

from __future__ import annotations

from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from govray.cli.common import AllowUnsigned, ConfigArgument, Strict, console, open_experiment, warn
from govray.ledger import format_ledger
from govray.preflight import check_policy, ingest_experiment
from govray.runner import TrainingFailed, run_trial


def run(
    config_path: Path = ConfigArgument, allow_unsigned: bool = AllowUnsigned, strict: bool = Strict
) -> None:
    """Verify the policy, ingest, and train the experiment's trial under governance."""
    config, store = open_experiment(config_path)
    checked = check_policy(config, store, allow_unsigned=allow_unsigned)
    experiment, ingested = ingest_experiment(config, checked, store, strict=strict, warn=warn)
    assert experiment.id is not None
    workers = config.resources.workers
    policy = checked.policy.policy
    console.print(
        f"experiment {experiment.id} '{config.name}': {workers} worker{'s' if workers > 1 else ''}, "
        f"policy '{policy.name}' v{policy.version}, shards {ingested.manifest.key[:12]}"
    )
    store.set_experiment_state(experiment.id, "active")
    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=None, loss="")

        def update(step: int, max_steps: int, latest: dict[str, float]) -> None:
            loss = latest.get("training_loss")
            progress.update(task, completed=step, total=max_steps, loss=f"loss {loss:.4f}" if loss else "")

        try:
            outcome = run_trial(config, checked, experiment, ingested.root, store, progress=update)
        except TrainingFailed:
            store.set_experiment_state(experiment.id, "errored")
            raise
        progress.update(task, completed=outcome.max_steps, total=outcome.max_steps)
    store.set_experiment_state(experiment.id, "completed")
    metrics = outcome.metrics
    console.print(
        f"trial {outcome.trial_id} ({outcome.run_name}) completed {outcome.max_steps} steps: "
        f"validation loss {metrics.get('validation_loss', float('nan')):.4f}"
        + (f", accuracy {metrics['validation_accuracy']:.3f}" if "validation_accuracy" in metrics else "")
    )
    console.print("ledger: training examples that directly reached each layer (per corpus)")
    console.print(format_ledger(outcome.ledger, checked.routing), highlight=False)
