"""ASHA vs random search, measured as ASHA's authors measure it: training spent until a quality.

Li et al. (MLSys 2020) compare searches by the time until some trial reaches a target quality,
with many trials running at once and promotions made asynchronously. Here, on scikit-learn's
digits (the example's data), every strategy runs ``--concurrency`` trials at a time (one worker of
half a CPU each), ``--trials`` sampled configurations from a wide space in which about a quarter
reach the target, for ``--seeds`` seeds. Random search, ASHA and adaptive ASHA draw the same
configurations in the same order (Tune's sampler, seeded by the experiment's seed); TPE proposes
its own. Every strategy validates at the same period (ASHA's first rung).

- **cost to target**: the training epochs consumed by all trials up to the moment (wall-clock
  order: the order the driver recorded their reports) the first validation reached ``--target``,
  i.e. the sum over trials of the last step each had reported by then. A search that never
  reaches the target counts its whole search;
- **whole search**: the epochs every trial trained, with the best validation accuracy it found
  ("at equal best" holds in the seeds where ASHA's best equals random search's).

The ratios are medians over seeds. The last lines are exactly::

    asha/random cost-to-target ratio (median of N seeds): X.XXX
    asha/random whole-search ratio at equal best: X.XXX
    asha/random wall-clock ratio at equal best (median of N seeds): X.XXX

the last one the whole searches' wall-clock time (Ray started once before them), over the seeds
in which ASHA's best equals random search's.

Run: ``python -m jobs.benchmarks.asha_vs_random [--seeds 5 --trials 48 --epochs 4 --target 0.95]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from govray.config.experiment import load_experiment
from govray.core.runtime import ensure_ray
from govray.platform.run.plan import plan_run
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.search.driver import run_search
from govray.tracking.store import TrackingStore

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "examples" / "digits"
# A wide space, as one searches before knowing the model: the learning rate spans five decades
# and about a quarter of the points reach 95% within 4 epochs; most train too slowly or diverge.
SPACE = {
    "hidden": {"type": "categorical", "vals": [16, 32, 64, 128]},
    "dropout": {"type": "double", "minval": 0.0, "maxval": 0.5},
    "lr": {"type": "log", "minval": -5.0, "maxval": 0.0, "base": 10},
    "optimizer": {"type": "categorical", "vals": ["sgd", "adamw"]},
    "batch_size": 32,
}
STRATEGIES = ("random", "asha", "adaptive_asha", "bayesian")


@dataclass(frozen=True)
class Searched:
    """One search's costs, in epochs."""

    to_target: float | None  # None: no validation reached the target
    whole: float
    best: float
    first_good: int | None  # 1-based start order of the first trial that reached the target
    seconds: float

    def cost(self) -> float:
        return self.whole if self.to_target is None else self.to_target


def experiment_file(
    root: Path,
    name: str,
    seed: int,
    searcher: dict[str, Any],
    args: argparse.Namespace,
    validation_period: int,
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
    raw["resources"] = {"workers": 1, "cpus_per_worker": args.cpus_per_trial}
    raw["searcher"] = {"metric": "validation_loss", "max_length": {"epochs": args.epochs}, **searcher}
    raw["checkpoint"] = {"period": 10_000, "save_trial_best": 1, "save_trial_latest": 1}
    raw.pop("lr_schedule", None)
    raw["min_validation_period"] = validation_period  # the same for every strategy
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def costs(
    store: TrackingStore, trial_ids: list[int], steps_per_epoch: int, target: float
) -> tuple[float | None, float, int | None]:
    """(epochs to target, epochs of the whole search, start order of the first good trial)."""
    rows = {t: store.metrics(t) for t in trial_ids}
    hits = [
        (m.id or 0, t)
        for t, metrics in rows.items()
        for m in metrics
        if m.name == "validation_accuracy" and m.value >= target
    ]
    whole = sum(max((m.step for m in metrics), default=0) for metrics in rows.values()) / steps_per_epoch
    if not hits:
        return None, whole, None
    moment, first = min(hits)  # row ids are the driver's recording order
    spent = sum(
        max((m.step for m in metrics if (m.id or 0) <= moment), default=0) for metrics in rows.values()
    )
    return spent / steps_per_epoch, whole, sorted(trial_ids).index(first) + 1


def opened(path: Path) -> tuple[Any, TrackingStore, Any, Any, Any]:
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    return config, store, checked, experiment, ingested


def trial_steps(root: Path, args: argparse.Namespace) -> int:
    """Steps of one trial (the schedule's, for the space's fixed batch size)."""
    config, _, checked, _, ingested = opened(
        experiment_file(root, "bench-steps", 0, {"name": "single"}, args, 1)
    )
    return plan_run(config, checked, ingested.root).spec.max_steps


def search(root: Path, strategy: str, seed: int, args: argparse.Namespace, steps: int) -> Searched:
    searcher: dict[str, Any] = {
        "name": strategy,
        "max_trials": args.trials,
        "max_concurrent_trials": args.concurrency,
    }
    if strategy == "asha":
        searcher.update(divisor=4, max_rungs=3, brackets=1)
    if strategy == "adaptive_asha":
        searcher.update(divisor=4, max_rungs=3, mode="standard")
    if strategy == "bayesian":
        searcher.update(n_startup_trials=max(2, args.trials // 4))
    # Every strategy validates at ASHA's first rung (max length / 4^2).
    path = experiment_file(root, f"bench-{strategy}-{seed}", seed, searcher, args, max(1, steps // 16))
    config, store, checked, experiment, ingested = opened(path)
    started = time.perf_counter()
    outcome = run_search(config, checked, experiment, ingested.root, store, report_every=args.report_every)
    seconds = time.perf_counter() - started
    best = max(m.value for t in outcome.trial_ids for m in store.metrics(t, "validation_accuracy"))
    to_target, whole, first_good = costs(store, outcome.trial_ids, steps // args.epochs, args.target)
    return Searched(to_target, whole, best, first_good, seconds)


def describe(strategy: str, seed: int, result: Searched, target: float) -> str:
    reached = "never" if result.to_target is None else f"{result.to_target:.2f} (trial {result.first_good})"
    return (
        f"seed {seed} {strategy}: best accuracy {result.best:.4f}, epochs to {target}: {reached}, "
        f"whole search: {result.whole:.2f} epochs in {result.seconds:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cpus-per-trial", type=float, default=0.5)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    args = parser.parse_args()
    ensure_ray()
    to_target: list[float] = []
    whole: list[float] = []
    wall: list[float] = []  # at equal best
    equal_best = 0
    with tempfile.TemporaryDirectory(prefix="govray-asha-") as scratch:
        steps = trial_steps(Path(scratch), args)
        for seed in range(args.seeds):
            results = {
                strategy: search(Path(scratch), strategy, seed, args, steps) for strategy in args.strategies
            }
            for strategy, result in results.items():
                print(describe(strategy, seed, result, args.target), flush=True)
            asha, plain = results.get("asha"), results.get("random")
            if asha is None or plain is None:
                continue
            to_target.append(asha.cost() / plain.cost())
            whole.append(asha.whole / plain.whole)
            equal_best += asha.best == plain.best
            if asha.best == plain.best:
                wall.append(asha.seconds / plain.seconds)
            print(
                f"seed {seed} asha/random: cost to target {to_target[-1]:.3f}, whole search {whole[-1]:.3f}, "
                f"wall clock {asha.seconds / plain.seconds:.3f}, "
                f"best {'equal' if asha.best == plain.best else 'different'}",
                flush=True,
            )
    if not to_target:
        return
    print(f"asha's best equals random search's in {equal_best} of {len(whole)} seeds")
    median = statistics.median(to_target)
    print(f"asha/random cost-to-target ratio (median of {len(to_target)} seeds): {median:.3f}")
    print(f"asha/random whole-search ratio at equal best: {statistics.median(whole):.3f}")
    if wall:
        median_wall = statistics.median(wall)
        print(f"asha/random wall-clock ratio at equal best (median of {len(wall)} seeds): {median_wall:.3f}")


if __name__ == "__main__":
    main()
