"""``govray search EXPERIMENT``: the experiment's hyperparameter search on Ray Tune."""

from __future__ import annotations

from pathlib import Path

from govray.cli.common import AllowUnsigned, ConfigArgument, Strict, console, open_experiment, table, warn
from govray.platform.preflight import check_policy, ingest_experiment
from govray.platform.runner import refusals
from govray.platform.search import run_search


def search(
    config_path: Path = ConfigArgument, allow_unsigned: bool = AllowUnsigned, strict: bool = Strict
) -> None:
    """Verify, ingest, and search the hyperparameter space (every trial governed and recorded).

    Run again after an interruption: the search resumes where Tune left off, without rerunning
    finished trials."""
    config, store = open_experiment(config_path)
    checked = check_policy(config, store, allow_unsigned=allow_unsigned)
    check = refusals(config, checked)  # refused before the experiment exists
    experiment, ingested = ingest_experiment(config, checked, store, strict=strict, warn=warn, check=check)
    assert experiment.id is not None
    console.print(
        f"experiment {experiment.id} '{config.name}': {config.searcher.name} search, objective "
        f"{config.searcher.metric} + {config.searcher.memorization_lambda:g} x memorization_score"
    )
    outcome = run_search(config, checked, experiment, ingested.root, store)
    listing = table("trial", "state", "hyperparameters", "steps", "objective", "memorization", "cloned from")
    for trial_id in outcome.trial_ids:
        trial = store.get_trial(trial_id)
        latest = {metric.name: metric for metric in store.metrics(trial_id)}
        objective = latest.get("objective")
        score = latest.get("memorization_score")
        listing.add_row(
            str(trial_id),
            trial.state,
            trial.hparams_json,
            str(latest["training_loss"].step) if "training_loss" in latest else "-",
            f"{objective.value:.4f}" if objective else "-",
            f"{score.value:.3f}" if score else "-",
            str(trial.cloned_from) if trial.cloned_from is not None else "-",
        )
    console.print(listing)
    console.print(
        f"best: trial {outcome.best_trial_id} {outcome.best_hparams} objective {outcome.best_objective:.4f}"
    )
