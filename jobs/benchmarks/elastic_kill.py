"""An elastic run losing a worker node without notice, then getting it back.

The digits example (golden hyperparameters, no validations) on ``resources.workers: {min: 2,
max: 3}``, one CPU per worker, a signed checkpoint every ``PERIOD`` steps, on a local Ray cluster
of a head and two more nodes of one CPU each (``tests/helpers/local_ray.py``). Once the run has
trained half a period past a checkpoint on 3 workers, every process of one worker node (its
raylet, agents and workers) is SIGKILLed at once, as a reclaimed spot instance vanishes: Ray Train
restarts the run on the 2 workers left from the newest verified checkpoint. Once that world has
sealed a checkpoint of its own, a node is started again: Ray Train's elastic policy (it looks
every ``resize_check_s``) grows the run back to 3 workers, again from the newest checkpoint. The
run is then paused (``govray experiment pause``) at its next checkpoint.

Measured from rank 0's log (a line per step, with its time): the steps the 3-worker world had
trained past the checkpoint the 2-worker world resumed from (the steps lost), and the resize's
wall-clock cost both ways (the kill to the first step on 2 workers; the node back in the cluster
to the first step on 3).

Run: ``python -m jobs.benchmarks.elastic_kill`` (from the repository root: it starts its own
local Ray nodes). Its last line is::

    steps lost to a worker killed without notice: N (checkpoint period P)

(``jobs/benchmarks/elastic.py`` prints it with the other elastic scenarios' lines.)
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml

REPO = Path(__file__).resolve().parents[2]
PERIOD = 10  # steps between checkpoints
STEPS = 100_000  # more than the scenario lets it train: it is paused once it has grown back
RESIZE_CHECK_S = 2.0
WAIT_S = 240.0  # for each stage of the scenario
# The head's GCS declares a node dead after 3 failed health checks 2 s apart (not 5, 3 s apart; a
# dead raylet fails each at once), and Ray Train gives a worker group 20 s (not 60) to start
# before it retries with what is there.
FAST_FAILURE_DETECTION = {
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",
}
_LINE = re.compile(r"^(\S+) rank0 \| (.*)$")
_WORLD = re.compile(r"^rank 0 of (\d+)\b")
_RESUMED = re.compile(r"^resumed from a verified checkpoint at step (\d+)")
_STEP = re.compile(r"^step=(\d+) ")
T = TypeVar("T")


@dataclass
class Attempt:
    """One start of the run's workers, as rank 0's log tells it."""

    workers: int
    resumed_from: int  # the checkpoint's step (0: from scratch)
    started: float  # the time of its first line
    steps: list[tuple[float, int]] = field(default_factory=list)  # (time, step) of each step trained

    @property
    def last_step(self) -> int:
        return self.steps[-1][1] if self.steps else self.resumed_from


@dataclass(frozen=True)
class ElasticKill:
    """What the scenario did and saw."""

    experiment: Path
    attempts: list[Attempt]
    killed_at: float  # the node's SIGKILL
    back_at: float  # the new node alive in the cluster
    state: str  # the trial's, after the pause

    @property
    def shrunk(self) -> Attempt:
        """The first attempt on 2 workers (after the kill)."""
        return next(a for a in self.attempts if a.started > self.killed_at and a.workers == 2)

    @property
    def grown(self) -> Attempt:
        """The first attempt on 3 workers after the node came back."""
        return next(a for a in self.attempts if a.started > self.back_at and a.workers == 3)

    @property
    def steps_lost(self) -> int:
        """Steps the 3-worker world trained past the checkpoint the 2-worker world resumed from."""
        before = [a for a in self.attempts if a.started < self.killed_at]
        return before[-1].last_step - self.shrunk.resumed_from

    @property
    def shrink_s(self) -> float:
        return self.shrunk.steps[0][0] - self.killed_at

    @property
    def grow_s(self) -> float:
        return self.grown.steps[0][0] - self.back_at


def elastic_experiment(root: Path) -> Path:
    """The digits example under ``root`` as an elastic run of 2 to 3 one-CPU workers."""
    from jobs.examples.digits.golden import golden_example

    # Every checkpoint kept (not the golden 100 latest): the run trains on through each stage, some
    # 40 steps a second, while a node starts and the run resizes, and the tests train each world's
    # stretch again from the checkpoint it resized at, which GC of the latest 100 deletes once 100
    # newer ones are sealed (a slow node start or resize on a loaded machine).
    path = golden_example(root, 3, {"batches": STEPS}, lr_schedule=False, keep_checkpoints=STEPS // PERIOD)
    raw: dict[str, Any] = yaml.safe_load(path.read_text())
    raw["resources"] = {
        "workers": {"min": 2, "max": 3},
        "resize_check_s": RESIZE_CHECK_S,
        "cpus_per_worker": 1,
        "placement_strategy": "SPREAD",
    }
    raw["checkpoint"]["period"] = PERIOD
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def attempts(log: Path) -> list[Attempt]:
    """The run's attempts, from rank 0's log (every attempt's rank 0 appends to it)."""
    from govray.core.logs import TIMESTAMP_FORMAT

    found: list[Attempt] = []
    resumed = 0
    for line in log.read_text().splitlines() if log.exists() else []:
        matched = _LINE.match(line)
        if matched is None:
            continue
        stamp = datetime.strptime(matched[1], TIMESTAMP_FORMAT).replace(tzinfo=UTC).timestamp()
        text = matched[2]
        if world := _WORLD.match(text):
            found.append(Attempt(int(world[1]), resumed, stamp))
            resumed = 0
        elif again := _RESUMED.match(text):
            resumed = int(again[1])
        elif (step := _STEP.match(text)) and found:
            found[-1].steps.append((stamp, int(step[1])))
    return found


def wait_for(what: str, found: Callable[[], T | None], driver: subprocess.Popen[bytes]) -> T:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (value := found()) is not None:
            return value
        if driver.poll() is not None:
            raise RuntimeError(f"the run ended (rc {driver.returncode}) before {what}")
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not after {WAIT_S:.0f} s")


def kill_node(temp_dir: Path, spare: int) -> None:
    """SIGKILL every process of the node whose temp dir this is, as a spot instance vanishes: its
    raylet, its agents and its workers (retitled ``ray::...``: found by the files they hold open
    below it), all at once; ``spare`` (the run's driver) is not the node's."""
    from govray.core.rayhead import processes_naming

    processes = [pid for pid, _ in processes_naming((str(temp_dir),), open_files=True) if pid != spare]
    if not processes:
        raise RuntimeError(f"no process of the node under {temp_dir}")
    for pid in processes:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def node_back(cluster: Any, driver: subprocess.Popen[bytes], tries: int = 3) -> None:
    """Start a node of one CPU and wait until the cluster has 3 alive; a node whose ``ray start``
    gives up (it times out when the machine is overloaded) is started again."""

    def alive(started: subprocess.Popen[bytes]) -> bool | None:
        if len(cluster.alive_nodes()) >= 3:
            return True
        return False if started.poll() is not None else None  # False: it gave up

    for _ in range(tries):
        cluster.add_node(num_cpus=1)
        if wait_for("the new node alive", functools.partial(alive, cluster.nodes[-1].process), driver):
            return
    raise RuntimeError(f"no node came back in {tries} tries: {cluster.nodes[-1].log.read_text()[-2000:]}")


def kill_and_regrow(cluster: Any, root: Path) -> ElasticKill:
    """The scenario (the module doc) on ``cluster`` (a ``LocalRayCluster`` of a head and two nodes
    of one CPU each, all alive), in ``root``."""
    from govray.tracking.store import TrackingStore

    experiment = elastic_experiment(root)
    storage = experiment.parent / "storage"
    with open(root / "driver.log", "wb") as output:
        driver = subprocess.Popen(
            [sys.executable, "-m", "jobs.benchmarks.elastic_kill", "--drive", str(experiment)],
            cwd=REPO,
            env=cluster.environment(RAY_ADDRESS=cluster.address, **FAST_FAILURE_DETECTION),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        log = wait_for("rank 0's log", lambda: next(storage.glob("logs/*/rank-0.log"), None), driver)

        def trained(workers: int, past: int, after: float = 0.0) -> Attempt | None:
            """The newest attempt, if it is on ``workers``, started after ``after`` and trained
            ``past`` steps beyond a checkpoint of its own world."""
            found = attempts(log)
            newest = found[-1] if found else None
            if newest is None or newest.workers != workers or newest.started < after:
                return None
            own = newest.resumed_from - newest.resumed_from % PERIOD + PERIOD  # its first checkpoint
            return newest if newest.last_step >= own + past else None

        wait_for("half a period past a checkpoint on 3 workers", lambda: trained(3, PERIOD // 2 + 1), driver)
        victim = cluster.nodes[-1]
        kill_node(victim.temp_dir, spare=driver.pid)
        killed_at = time.time()
        wait_for("a checkpoint on 2 workers", lambda: trained(2, PERIOD // 2, killed_at), driver)
        node_back(cluster, driver)
        back_at = time.time()
        wait_for("a checkpoint on 3 workers again", lambda: trained(3, PERIOD // 2, back_at), driver)
        store = TrackingStore.open(f"sqlite:///{storage / 'govray.db'}")
        (recorded,) = store.list_experiments()
        assert recorded.id is not None
        store.request(recorded.id, "pause")
        driver.wait(timeout=WAIT_S)
        (trial,) = store.list_trials(recorded.id)
        state = trial.state
        store.close()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    if driver.returncode != 0:
        raise RuntimeError(
            f"the driver exited {driver.returncode}: {(root / 'driver.log').read_text()[-3000:]}"
        )
    return ElasticKill(experiment, attempts(log), killed_at, back_at, state)


def drive(experiment: Path) -> None:
    """The run's driver (a process of its own, joined to the cluster by ``RAY_ADDRESS``): a report
    every step, so that rank 0's log has a line per step."""
    from govray.platform.run.runner import run_trial
    from jobs.examples.digits.golden import opened

    config, store, checked, recorded, ingested = opened(experiment)
    outcome = run_trial(config, checked, recorded, ingested.root, store, report_every=1)
    print(f"trial {outcome.trial_id}: {outcome.state} after {outcome.steps_done} steps")


def measure(workdir: Path) -> str:
    """Run the scenario on a fresh local cluster in ``workdir``; print the resize's costs and
    return the last line."""
    from tests.helpers.local_ray import LocalRayCluster

    cluster = LocalRayCluster()
    try:
        cluster.start_head(num_cpus=1, env=FAST_FAILURE_DETECTION)
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes(3)
        seen = kill_and_regrow(cluster, workdir)
    finally:
        cluster.stop()
    worlds = " -> ".join(str(a.workers) for a in seen.attempts)
    print(f"attempts (workers): {worlds}; the trial is {seen.state}")
    print(f"resize 3 -> 2 (node killed -> first step on 2 workers): {seen.shrink_s:.1f} s")
    print(f"resize 2 -> 3 (node back -> first step on 3 workers): {seen.grow_s:.1f} s")
    return f"steps lost to a worker killed without notice: {seen.steps_lost} (checkpoint period {PERIOD})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drive", type=Path, help="(the scenario's driver process) run this experiment")
    args = parser.parse_args()
    if args.drive is not None:
        drive(args.drive)
        return
    with tempfile.TemporaryDirectory(prefix="govray-elastic-kill-") as workdir:
        print(measure(Path(workdir)))


if __name__ == "__main__":
    main()
