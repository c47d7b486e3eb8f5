"""ASHA vs random search on scikit-learn's digits: epochs spent until a trial reaches the target.

Same space, same trial budget, same seeds, same validation period for all (and Bayesian/TPE for
its best accuracy); one worker per trial, trials one after another, so "epochs until the target"
is well defined: the
training epochs of every trial started before the first validation at or above the target
accuracy, plus that trial's epochs up to it. A search that never reaches the target counts its
whole budget. The ratio is the mean over seeds of ASHA's epochs over random's.

Run: ``python -m jobs.benchmarks.asha_vs_random [--seeds 3 --trials 16 --epochs 8 --target 0.96]``.
The last line is exactly ``asha/random epochs-to-target ratio: X.XXX``, with each strategy's best
accuracy and the epochs its whole search trained per seed printed above it, and the mean ratio of
those whole-search epochs (what ASHA saves over the full budget) on the line before.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from govray.config.experiment import load_experiment
from govray.core.runtime import ensure_ray
from govray.platform.preflight import check_policy, ingest_experiment
from govray.platform.runner import plan_steps
from govray.platform.search import run_search
from govray.tracking.store import TrackingStore

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "examples" / "digits"
# A wide space, as one searches before knowing the model: about a quarter of its points reach 96%
# within 8 epochs (a plain-torch sweep of 20 samples: 4 did), the rest train too slowly or diverge.
SPACE = {
    "hidden": {"type": "categorical", "vals": [16, 32, 64, 128]},
    "dropout": {"type": "double", "minval": 0.0, "maxval": 0.5},
    "lr": {"type": "log", "minval": -5.0, "maxval": 0.0, "base": 10},
    "optimizer": {"type": "categorical", "vals": ["sgd", "adamw"]},
    "batch_size": 32,
}


def experiment_file(
    root: Path, name: str, seed: int, searcher: dict[str, Any], epochs: int, validation_period: int
) -> Path:
    if not (root / "data").exists():
        shutil.copytree(EXAMPLE / "data", root / "data")
    raw = yaml.safe_load((EXAMPLE / "experiment.yaml").read_text())
    raw["name"] = name
    raw["seed"] = seed
    raw["policy"] = {
        "file": str(REPO / "policies" / "digits.policy.yaml"),
        "trust": str(REPO / "policies" / "trust.yaml"),
    }
    raw["storage_path"] = str(root / "storage")
    raw["hyperparameters"] = SPACE
    raw["resources"] = {"workers": 1, "cpus_per_worker": 1}
    raw["searcher"] = {"metric": "validation_loss", "max_length": {"epochs": epochs}, **searcher}
    raw["checkpoint"] = {"period": 10_000, "save_trial_best": 1, "save_trial_latest": 1}
    raw.pop("lr_schedule", None)
    raw["min_validation_period"] = validation_period  # the same for every strategy: a fair count
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def epochs_to_target(
    store: TrackingStore, trial_ids: list[int], steps_per_epoch: int, target: float
) -> float:
    """Epochs trained (trials in the order they ran) until a validation reached ``target``."""
    spent = 0
    for trial_id in sorted(trial_ids):
        for metric in store.metrics(trial_id, "validation_accuracy"):
            if metric.value >= target:
                return (spent + metric.step) / steps_per_epoch
        steps = [m.step for m in store.metrics(trial_id, "training_loss")]
        spent += max(steps, default=0)
    return spent / steps_per_epoch


def search(root: Path, strategy: str, seed: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """(epochs to target, best validation accuracy, epochs of the whole search) of one search."""
    searcher: dict[str, Any] = {"name": strategy, "max_trials": args.trials, "max_concurrent_trials": 1}
    if strategy == "asha":
        searcher.update(divisor=4, max_rungs=3, brackets=1)
    if strategy == "bayesian":
        searcher.update(n_startup_trials=max(2, args.trials // 4))
    path = experiment_file(
        root, f"bench-{strategy}-{seed}", seed, searcher, args.epochs, args.validation_period
    )
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    outcome = run_search(config, checked, experiment, ingested.root, store, report_every=10)
    steps_per_epoch = plan_steps(config, ingested.root, config.default_hparams(), trial_seed=0) // args.epochs
    best = max(m.value for t in outcome.trial_ids for m in store.metrics(t, "validation_accuracy"))
    spent = sum(max((m.step for m in store.metrics(t, "examples")), default=0) for t in outcome.trial_ids)
    return (
        epochs_to_target(store, outcome.trial_ids, steps_per_epoch, args.target),
        best,
        spent / steps_per_epoch,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.96)
    parser.add_argument("--validation-period", type=int, default=12, help="steps (about 1/4 epoch)")
    args = parser.parse_args()
    ensure_ray()
    ratios: list[float] = []
    totals: list[float] = []
    with tempfile.TemporaryDirectory(prefix="govray-asha-") as scratch:
        for seed in range(args.seeds):
            results = {
                strategy: search(Path(scratch), strategy, seed, args)
                for strategy in ("random", "asha", "bayesian")
            }
            for strategy, (epochs, best, total) in results.items():
                print(
                    f"seed {seed} {strategy}: best accuracy {best:.4f}, epochs to {args.target}: "
                    f"{epochs:.2f}, epochs of the whole search: {total:.2f}"
                )
            ratios.append(results["asha"][0] / results["random"][0])
            totals.append(results["asha"][2] / results["random"][2])
    print(f"asha/random whole-search epochs ratio (same trials, same seeds): {statistics.mean(totals):.3f}")
    print(f"asha/random epochs-to-target ratio: {statistics.mean(ratios):.3f}")


if __name__ == "__main__":
    main()
