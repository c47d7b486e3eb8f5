"""``govray experiment list | describe | mlflow-sync | set gc-policy``
(``govray experiments``: the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape

from govray.cli import lifecycle
from govray.cli.common import Database, console, open_store, table
from govray.core.errors import GovrayError
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.tracking.tables import TrialKind, TrialRecord

if TYPE_CHECKING:
    from govray.cli.describe import ExperimentDescription, TrialDescription
    from govray.platform.gc import GcPlan, GcPolicy

app = typer.Typer(help="Experiments in the tracking store.", no_args_is_help=True)
settings = typer.Typer(help="Change an experiment's settings.", no_args_is_help=True)
app.add_typer(settings, name="set")
app.command("pause")(lifecycle.pause)
app.command("activate")(lifecycle.activate_command)
app.command("kill")(lifecycle.kill)
app.command("fork")(lifecycle.fork_command)

ExperimentArgument = typer.Argument(..., help="Experiment id, or name (the newest of that name).")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


@app.command("list")
def list_experiments(
    database: str | None = Database,
    config: Path | None = typer.Option(None, "--config", help="Use this experiment file's tracking store."),
) -> None:
    """List experiments, newest last."""
    if database is None and config is not None:
        from govray.config.experiment import load_experiment

        database = load_experiment(config).database_url
    store = open_store(database)
    listing = table("id", "name", "state", "trials", "parent", "created", "config digest", "policy digest")
    for experiment in store.list_experiments():
        assert experiment.id is not None
        listing.add_row(
            str(experiment.id),
            experiment.name,
            experiment.state,
            _trial_counts(store.list_trials(experiment.id)),
            str(experiment.parent_id) if experiment.parent_id is not None else "-",
            experiment.created_at.strftime(TIME_FORMAT),
            experiment.config_digest[:12],
            (experiment.policy_digest or "-")[:12],
        )
    console.print(listing)


@app.command()
def describe(
    experiment: str = ExperimentArgument,
    as_json: bool = typer.Option(False, "--json", help="One JSON document instead of tables."),
    database: str | None = Database,
) -> None:
    """State, lineage, digests, GC policy, corpora, and each trial's metrics, checkpoints and decisions."""
    from govray.cli.describe import describe_experiment

    description = describe_experiment(open_store(database), experiment)
    if as_json:
        typer.echo(description.model_dump_json(indent=2))
        return
    _print_overview(description)
    corpora = table("corpus", "role", "rows", "fingerprint")
    for corpus in description.corpora:
        corpora.add_row(corpus.corpus_id, corpus.role, str(corpus.rows), corpus.fingerprint[:16])
    console.print(corpora if description.corpora else "corpora: none ingested", highlight=False)
    trials = table(
        "trial", "kind", "state", "run name", "seed", "last step", "training loss", "validation", "source"
    )
    for trial in description.trials:
        trials.add_row(
            str(trial.id),
            trial.kind if trial.replay_of is None else f"replay of trial {trial.replay_of}",
            trial.state,
            trial.ray_run_name or "-",
            str(trial.seed),
            str(trial.last_step) if trial.last_step is not None else "-",
            _number(trial.training_loss.value) if trial.training_loss is not None else "-",
            ", ".join(f"{name}={_number(m.value)} (step {m.step})" for name, m in trial.validation.items())
            or "-",
            _source(trial),
        )
    console.print(trials if description.trials else "trials: none", highlight=False)
    for trial in description.trials:
        _print_trial_records(trial)


@app.command("mlflow-sync")
def mlflow_sync(experiment: str = ExperimentArgument, database: str | None = Database) -> None:
    """Copy to the experiment's MLflow server (``tracking.mlflow``) what it lacks: trials, metrics,
    states, registered versions. Runs and registrations do this themselves; this catches up after
    an outage at once."""
    from govray.platform.mlflow_mirror import sync_experiment

    store = open_store(database)
    found = store.get_experiment(experiment)
    assert found.id is not None
    synced = sync_experiment(store, found.id)
    if synced is None:
        raise GovrayError(f"experiment {found.id} '{found.name}' names no MLflow server (tracking.mlflow)")
    if not synced:
        raise GovrayError(f"experiment {found.id} '{found.name}': the MLflow server did not take the mirror")
    console.print(f"experiment {found.id} '{found.name}' mirrored to MLflow", highlight=False)


@settings.command("gc-policy")
def gc_policy(
    experiment: str = ExperimentArgument,
    save_experiment_best: int | None = typer.Option(
        None, "--save-experiment-best", min=0, help="Keep the experiment's N best checkpoints."
    ),
    save_trial_best: int | None = typer.Option(
        None, "--save-trial-best", min=0, help="Keep each trial's N best checkpoints."
    ),
    save_trial_latest: int | None = typer.Option(
        None, "--save-trial-latest", min=0, help="Keep each trial's N latest checkpoints."
    ),
    database: str | None = Database,
) -> None:
    """Override the experiment's checkpoint GC policy and apply it now (audited); counts not given stay."""
    from govray.platform.gc import GcPolicy, effective_gc_policy, set_gc_policy

    given = {
        "save_experiment_best": save_experiment_best,
        "save_trial_best": save_trial_best,
        "save_trial_latest": save_trial_latest,
    }
    if all(value is None for value in given.values()):
        raise typer.BadParameter(
            "give at least one of --save-experiment-best, --save-trial-best, --save-trial-latest"
        )
    store = open_store(database)
    found = store.get_experiment(experiment)
    assert found.id is not None
    old = effective_gc_policy(store, found.id)
    new = GcPolicy.model_validate(
        {**old.model_dump(), **{name: value for name, value in given.items() if value is not None}}
    )
    plan = set_gc_policy(store, found.id, new)
    console.print(
        f"experiment {found.id} '{found.name}': GC policy {_policy_text(new)} (was {_policy_text(old)})",
        highlight=False,
    )
    _print_plan(store, found.id, plan)


def _print_overview(description: ExperimentDescription) -> None:
    parent = "-"
    if description.parent_id is not None:
        parent = f"{description.parent_id} '{description.parent_name}'"
    origin = "override" if description.gc_policy_overridden else "from the config"
    lines = [
        f"experiment {description.id} '{description.name}'",
        f"  state          {description.state}",
        f"  requested      {description.requested or '-'}",
        f"  parent         {parent}",
        f"  created        {description.created_at.strftime(TIME_FORMAT)} UTC",
        f"  updated        {description.updated_at.strftime(TIME_FORMAT)} UTC",
        f"  config digest  {description.config_digest}",
        f"  policy digest  {description.policy_digest or '-'}",
        f"  gc policy      {_policy_text(description.gc_policy)} ({origin})",
    ]
    console.print("\n".join(lines), highlight=False, markup=False)


def _print_trial_records(trial: TrialDescription) -> None:
    if trial.world_history:
        worlds = ", ".join(f"{workers} from step {step}" for step, workers in trial.world_history)
        resized = f" ({trial.resizes} resize{'s' if trial.resizes != 1 else ''})" if trial.resizes else ""
        console.print(f"trial {trial.id} workers: {worlds}{resized}", highlight=False)
    if trial.checkpoints:
        saved = table("checkpoint", "step", "state", "path")
        for checkpoint in trial.checkpoints:
            saved.add_row(str(checkpoint.id), str(checkpoint.step), checkpoint.state, escape(checkpoint.path))
        console.print(f"trial {trial.id} checkpoints", highlight=False)
        console.print(saved)
    else:
        console.print(f"trial {trial.id} checkpoints: none", highlight=False)
    if trial.decisions:
        decided = table("seq", "step", "kind", "payload")
        for decision in trial.decisions:
            kind = f"{decision.kind} (replayed)" if decision.replayed else decision.kind
            decided.add_row(
                str(decision.seq),
                str(decision.step),
                kind,
                escape(json.dumps(decision.payload, sort_keys=True)),
            )
        console.print(f"trial {trial.id} decisions", highlight=False)
        console.print(decided)
    else:
        console.print(f"trial {trial.id} decisions: none", highlight=False)


def _print_plan(store: TrackingStore, experiment_id: int, plan: GcPlan) -> None:
    deleted = {record.id for record in plan.delete}
    outcome = table("checkpoint", "trial", "step", "outcome", "why kept / path deleted")
    for trial in store.list_trials(experiment_id):
        assert trial.id is not None
        for record in checkpoints(store, trial.id):
            if record.id in plan.keep:
                outcome.add_row(
                    str(record.id),
                    str(trial.id),
                    str(record.step),
                    "kept",
                    "; ".join(plan.reasons[record.id]),
                )
            elif record.id in deleted:
                outcome.add_row(
                    str(record.id), str(trial.id), str(record.step), "deleted", escape(record.path)
                )
    console.print(f"checkpoints kept: {len(plan.keep)}, deleted: {len(plan.delete)}", highlight=False)
    if plan.keep or plan.delete:
        console.print(outcome)


def _policy_text(policy: GcPolicy) -> str:
    return " ".join(f"{name}={value}" for name, value in policy.model_dump().items())


def _source(trial: TrialDescription) -> str:
    if trial.source_checkpoint is not None:
        return escape(json.dumps(trial.source_checkpoint, sort_keys=True))
    return f"clone of trial {trial.cloned_from}" if trial.cloned_from is not None else "-"


def _trial_counts(trials: list[TrialRecord]) -> str:
    """``3 (1 replay)``: replays are counterfactual reruns, never the experiment's result."""
    replays = sum(trial.kind == TrialKind.REPLAY for trial in trials)
    return f"{len(trials)} ({replays} replay{'s' if replays != 1 else ''})" if replays else str(len(trials))


def _number(value: float) -> str:
    return f"{value:.6g}"
