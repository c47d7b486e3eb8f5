"""What a surviving N-worker search trial pays to continue past a rung: the Tune trial relays the
rung's report and checkpoint to Tune while its one Ray Train run keeps training (issue 33; until
then every rung restarted the worker group: one ``TorchTrainer`` per segment, 23-27 s a rung here).

The same 2-worker trial of the digits example (golden hyperparameters, no LR schedule, one CPU per
worker) runs four ways in one local Ray session, all for the same steps, ``--repeats`` rounds of
the four (each figure below is the median over the rounds: a search here varies by seconds from
one run to the next):

- a 1-point grid search validating every ``steps / segments`` steps: ``segments - 1`` rungs it
  continues past;
- the same search validating only at its end;
- ``govray run``'s continuous run (one worker group) with the same validations as the first;
- and with the one validation of the second.

The ``govray run`` runs price the extra validations (probe, memorization, signed checkpoint), so
what the search adds to continue past a rung (relaying to Tune, Tune's copy of the checkpoint, and
any restart) costs, per rung::

    ((search, rungs - search, one validation) - (run, same validations - run, one)) / (segments - 1)

A training step is timed from the reports the continuous one-validation run sends the driver
(least squares of arrival time on step; the driver looks every 0.5 s, so long runs measure it
better). The final weights must not depend on the rungs: the script compares the final
checkpoints' ``model.safetensors`` bit for bit and prints what it found.

Run: ``python -m jobs.benchmarks.segment_restart [--steps 600 --segments 5 --repeats 3]``. Last line::

    segment restart cost per rung: X.XX s (Y.YYx a training step)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from govray.core.runtime import ensure_ray
from govray.platform.run.runner import run_trial
from govray.platform.search.driver import run_search
from govray.tracking.lineage import checkpoints
from govray.train.checkpoints.files import find_checkpoints, model_file
from jobs.examples.digits.golden import GOLDEN_HPARAMS, golden_example, opened


def experiment(root: Path, steps: int, period: int, searcher: str) -> Path:
    """The 2-worker digits trial validating every ``period`` steps, searched by ``searcher``."""
    return golden_example(
        root,
        2,
        {"batches": steps},
        GOLDEN_HPARAMS,  # every hyperparameter fixed: a grid search of one point
        keep_checkpoints=None,
        lr_schedule=False,
        min_validation_period=period,
        checkpoint={"period": steps, "save_trial_latest": 1, "save_trial_best": 1},
        searcher={"name": searcher, "metric": "validation_loss", "max_length": {"batches": steps}},
    )


def searched(root: Path, steps: int, period: int) -> tuple[float, bytes]:
    """(wall seconds of ``run_search``, the final model file) of the 1-point search."""
    config, store, checked, experiment_row, ingested = opened(experiment(root, steps, period, "grid"))
    started = time.perf_counter()
    outcome = run_search(config, checked, experiment_row, ingested.root, store)
    seconds = time.perf_counter() - started
    [trial_id] = outcome.trial_ids
    final = [c for c in checkpoints(store, trial_id) if c.state == "active"][-1]
    return seconds, model_file(Path(final.path)).read_bytes()


def continuous(root: Path, steps: int, period: int) -> tuple[float, bytes, float]:
    """(wall seconds of ``run_trial``, the final model file, seconds per training step)."""
    config, store, checked, experiment_row, ingested = opened(experiment(root, steps, period, "single"))
    arrivals: list[tuple[int, float]] = []

    def arrived(step: int, max_steps: int, latest: dict[str, float], workers: int | None) -> None:
        arrivals.append((step, time.perf_counter()))

    started = time.perf_counter()
    outcome = run_trial(
        config, checked, experiment_row, ingested.root, store, report_every=1, progress=arrived
    )
    seconds = time.perf_counter() - started
    training = [(step, at) for step, at in arrivals if step < steps]  # the last step validates
    fitted = statistics.linear_regression([step for step, _ in training], [at for _, at in training])
    final = find_checkpoints(outcome.run_dir)[-1]
    return seconds, model_file(final).read_bytes(), fitted.slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--segments", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the four runs (medians)")
    args = parser.parse_args()
    if args.steps % args.segments:
        parser.error("--steps must be a multiple of --segments")
    period = args.steps // args.segments
    ensure_ray()
    rounds: list[tuple[float, float, float, float, float]] = []
    identical_runs: list[tuple[bool, bool]] = []
    for round_ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="govray-segments-") as scratch:
            root = Path(scratch)
            one, one_model = searched(root / "one", args.steps, args.steps)
            with_rungs, rungs_model = searched(root / "rungs", args.steps, period)
            same, same_model, _ = continuous(root / "continuous", args.steps, period)
            single, _, step = continuous(root / "single", args.steps, args.steps)
        rounds.append((one, with_rungs, same, single, step))
        identical_runs.append((rungs_model == one_model, rungs_model == same_model))
        cost = ((with_rungs - one) - (same - single)) / (args.segments - 1)
        print(f"round {round_ + 1}: cost per rung {cost:.2f} s", flush=True)
    one, with_rungs, same, single, step = (statistics.median(column) for column in zip(*rounds, strict=True))
    print(f"{args.steps} steps, 2 workers; validation every {period} steps")
    print(f"search, one validation: {one:.2f} s")
    print(f"search, {args.segments} validations ({args.segments - 1} rungs): {with_rungs:.2f} s")
    print(f"continuous run, {args.segments} validations: {same:.2f} s; 1 validation: {single:.2f} s")
    print(f"training step: {step:.4f} s (continuous run, 1 validation)")
    identical = {True: "yes", False: "NO"}
    print(
        f"final model.safetensors bit-identical (every round): search with rungs vs one validation: "
        f"{identical[all(a for a, _ in identical_runs)]}; search with rungs vs continuous run: "
        f"{identical[all(b for _, b in identical_runs)]}"
    )
    rungs = args.segments - 1
    print(f"validations, per extra one (continuous runs): {(same - single) / rungs:.2f} s")
    print(f"search with rungs / one validation wall time: {with_rungs / one:.3f}")
    cost = ((with_rungs - one) - (same - single)) / rungs  # of the medians
    print(f"segment restart cost per rung: {cost:.2f} s ({cost / step:.2f}x a training step)")


if __name__ == "__main__":
    main()
