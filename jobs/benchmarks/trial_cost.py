"""What a 1-worker search trial costs besides its training, part by part (issue 33, item 4).

``--searches`` random searches of the digits example, one after another in one job, each run
``--trials`` trials one at a time (one worker of one CPU each) on local Ray, each ``--epochs``
long with a validation every quarter epoch (ASHA's first rung in ``asha_vs_random``). The columns:
the first trial of the first search (it starts a Tune actor and a trial host, which imports torch
and govray), the first trial of each later search (a new Tune actor, a warm host), and every
later trial (a reused Tune actor and host). The parts come from three clocks:

- the worker's ``timings`` line in its log (``govray.train.run.timings``): opening the session,
  building the ``GovernedStep``, the first step, the steps, each validation's probe, each
  checkpoint, each report to Tune, and how long its process (the trial host) had lived when the
  worker began;
- the driver's Tune callbacks (``SearchTracking``), timed here by wrapping them: the records
  of each result and checkpoint, the end-of-trial attestation;
- when Tune asked for the trial's actor (its controller's ``_schedule_trial_actor``, wrapped here).

Training is what grows with epochs: the steps (the first at a later step's price) and every
validation with its checkpoint but the last; everything else is the trial's fixed cost. The last
line is exactly::

    per-trial fixed cost: X.XX s (Y.YY epochs of training)

Run: ``python -m jobs.benchmarks.trial_cost [--trials 6 --epochs 1 --searches 2]``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.tune.execution.tune_controller import TuneController

from govray.core.logs import log_path
from govray.platform.search import tracking as search_tracking
from govray.platform.search.driver import run_search
from govray.platform.search.tracking import SearchTracking
from govray.train.run.timings import read_timings
from jobs.benchmarks.asha_vs_random import experiment_file, opened, trial_steps

DriverClock = dict[str, dict[str, list[float]]]  # Tune trial id → part → seconds (or moments)


def timed(
    clock: DriverClock, part: str, method: Callable[..., Any], stamp: bool = False
) -> Callable[..., Any]:
    """``method`` of a Tune callback, its seconds added to the trial's ``part`` (``stamp``: the
    moment it ended, too)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        trial = kwargs.get("trial")
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - started
            if trial is not None:
                clock[trial.trial_id][part].append(seconds)
                if stamp:
                    clock[trial.trial_id][f"{part}_at"].append(time.time())

    return wrapper


def instrument(clock: DriverClock) -> None:
    """Wrap the driver's callbacks, the attestation and Tune's actor request (this process only)."""
    for name, part in [
        ("on_trial_start", "record_start"),
        ("on_trial_result", "record_result"),
        ("on_checkpoint", "record_checkpoint"),
        ("on_trial_complete", "record_complete"),
    ]:
        setattr(SearchTracking, name, timed(clock, part, getattr(SearchTracking, name), stamp=True))
    attest = search_tracking.attest_trial_end
    current: dict[str, str] = {}

    def attest_timed(store: Any, row_id: int) -> Any:
        started = time.perf_counter()
        try:
            return attest(store, row_id)
        finally:
            clock[current["trial"]]["attestation"].append(time.perf_counter() - started)

    search_tracking.attest_trial_end = attest_timed  # type: ignore[assignment]
    complete = SearchTracking.on_trial_complete

    def on_complete(self: Any, *args: Any, **kwargs: Any) -> Any:
        current["trial"] = kwargs["trial"].trial_id
        return complete(self, *args, **kwargs)

    SearchTracking.on_trial_complete = on_complete  # type: ignore[method-assign]
    schedule = TuneController._schedule_trial_actor

    def schedule_timed(self: Any, trial: Any) -> Any:
        clock[trial.trial_id]["requested_at"].append(time.time())
        return schedule(self, trial)

    TuneController._schedule_trial_actor = schedule_timed  # type: ignore[method-assign]


def trial_parts(driver: dict[str, list[float]], worker: dict[str, Any], epochs: float) -> dict[str, float]:
    """One trial's wall time by part (seconds), and its training (what grows with epochs)."""
    parts: dict[str, list[float]] = worker["parts"]
    requested = driver["requested_at"][0]
    process_start = worker["began"] - worker["process_age"]
    steps = parts.get("steps", [])
    typical = statistics.median(steps) if steps else 0.0
    validations, checkpoints = parts.get("validation", []), parts.get("checkpoint", [])
    ended = driver["record_complete_at"][-1]
    worker_end = worker["began"] + sum(sum(seconds) for seconds in parts.values())
    row = {
        "host start (request to host process)": max(0.0, process_start - requested),
        "Tune actor, imports, plan (to the loop)": worker["began"] - max(process_start, requested),
        "open session": sum(parts.get("open", [])),
        "GovernedStep build": sum(parts.get("build", [])),
        "first step, beyond a step": sum(parts.get("first_step", [])) - typical,
        "steps": sum(steps) + typical,
        "validations but the last (probe)": sum(validations[:-1]),
        "checkpoints but the last": sum(checkpoints[:-1]),
        "last validation (probe)": sum(validations[-1:]),
        "last checkpoint (signed)": sum(checkpoints[-1:]),
        "reports to Tune": sum(parts.get("report", [])),
        "close": sum(parts.get("close", [])),
        "driver: records of results": sum(driver.get("record_result", [])),
        "driver: records of checkpoints": sum(driver.get("record_checkpoint", [])),
        "driver: attestation": sum(driver.get("attestation", [])),
        "driver: end records": sum(driver.get("record_complete", [])) - sum(driver.get("attestation", [])),
        "Tune, between worker end and records": max(
            0.0,
            ended
            - worker_end
            - sum(driver.get("record_complete", []))
            - sum(driver.get("record_checkpoint", [])[-1:]),
        ),
    }
    row["wall (request to end records)"] = ended - requested
    row["training"] = (
        row["steps"]
        + row["validations but the last (probe)"]
        + row["checkpoints but the last"]
        + row["last validation (probe)"]
    )
    row["epochs"] = epochs
    return row


def search_rows(
    root: Path, name: str, clock: DriverClock, args: argparse.Namespace, steps: int
) -> tuple[list[dict[str, float]], float]:
    """One random search of ``args.trials`` trials one at a time: each trial's parts (but the
    last trial's: it has no next request), and the search's seconds."""
    searcher = {"name": "random", "max_trials": args.trials, "max_concurrent_trials": 1}
    path = experiment_file(root, name, 0, searcher, args, max(1, steps // (4 * args.epochs)))
    config, store, checked, experiment, ingested = opened(path)
    before = set(clock)
    started = time.perf_counter()
    run_search(config, checked, experiment, ingested.root, store, report_every=args.report_every)
    seconds = time.perf_counter() - started
    rows = []
    ran = [
        (trial, parts)
        for trial, parts in clock.items()
        if trial not in before and parts["record_complete_at"]
    ]
    for trial_id, driver in sorted(ran, key=lambda item: item[1]["requested_at"][0]):
        worker = read_timings(log_path(config.storage_path, f"{config.name}-{trial_id}", 0))
        if worker is None:
            continue
        rows.append(trial_parts(driver, worker, args.epochs))
        rows[-1]["requested_at"] = driver["requested_at"][0]
        rows[-1]["ended_at"] = driver["record_complete_at"][-1]
    for row, after in itertools.pairwise(rows):  # the next trial's actor waits for this one's end
        row["Tune, to the next trial's request"] = after["requested_at"] - row["ended_at"]
    return (rows[:-1] if len(rows) > 1 else rows), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--searches", type=int, default=2, help="searches one after another in one job")
    args = parser.parse_args()
    args.cpus_per_trial = 1.0
    clock: DriverClock = defaultdict(lambda: defaultdict(list))
    instrument(clock)
    # A Ray of its own, never a running one (``govray up``'s, another checkout's): its workers would
    # import that instance's govray, not this checkout's.
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    searches: list[list[dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="govray-trialcost-") as scratch:
        root = Path(scratch)
        steps = trial_steps(root, args)
        for number in range(args.searches):
            rows, seconds = search_rows(root, f"bench-trialcost-{number}", clock, args, steps)
            searches.append(rows)
            print(
                f"search {number + 1}: {len(rows)} trials of {steps} steps ({args.epochs} epoch(s)) "
                f"one at a time in {seconds:.1f} s"
            )
    # The first trial of the first search starts its Tune actor and its trial host, which imports;
    # the first of a later search starts a Tune actor only (the job's hosts are warm); a later
    # trial runs in the reused Tune actor and host.
    rows = [row for search in searches for row in search]
    columns = {
        "first": [searches[0][0]],
        "first, warm": [s[0] for s in searches[1:]],
        "later": [r for s in searches for r in s[1:]],
    }
    columns = {name: group for name, group in columns.items() if group}
    print(f"{'part (seconds)':44s} {'mean':>8s}" + "".join(f" {name:>12s}" for name in columns))
    for name in rows[0]:
        if name not in ("epochs", "requested_at", "ended_at"):
            means = [statistics.mean(r.get(name, 0.0) for r in group) for group in (rows, *columns.values())]
            print(f"{name:44s} {means[0]:8.3f}" + "".join(f" {mean:12.3f}" for mean in means[1:]))
    per_epoch = statistics.mean(r["training"] / r["epochs"] for r in rows)

    def fixed_cost(row: dict[str, float]) -> float:
        waited = row.get("Tune, to the next trial's request", 0.0)
        return row["wall (request to end records)"] + waited - row["training"]

    fixed = statistics.mean(fixed_cost(r) for r in rows)
    print(f"training per epoch: {per_epoch:.3f} s")
    print(
        "fixed cost of a trial: "
        + "; ".join(
            f"{name} {statistics.mean(fixed_cost(r) for r in group):.2f} s" for name, group in columns.items()
        )
    )
    print(f"per-trial fixed cost: {fixed:.2f} s ({fixed / per_epoch:.2f} epochs of training)")


if __name__ == "__main__":
    main()
