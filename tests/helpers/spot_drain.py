"""A spot reclaim with notice on a local Ray cluster: a governed 2-worker run, one of its worker
nodes drained for preemption (what ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N`` asks the GCS), and that node's processes SIGKILLed when the
deadline passes (a drain itself kills nothing). Ray Train restarts the worker group on the nodes
left. Shared by ``tests/cluster/test_preemption.py`` and ``jobs/benchmarks/elastic_notice.py``.

    cluster = LocalRayCluster()
    reclaimed = run_reclaimed(cluster, tmp_path, steps=80, period=50, deadline_s=15)
    reclaimed.steps_lost  # steps the first worker group trained after its last checkpoint
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from ray.core.generated import autoscaler_pb2

from govray.core.rayhead import processes_naming
from jobs.examples.digits.golden import EXAMPLE_CONFIG, GOLDEN_HPARAMS
from tests.helpers.builders import REPO
from tests.helpers.local_ray import LocalRayCluster, RayNodeProcess, _gcs_client

PREEMPTION = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
# Ray Train's controller asks Ray Core for drain notices every 5 s by default: on a fast CPU the
# 50 steps before the first periodic checkpoint take under 3 s, and the notice reached rank 0 only
# after it (a seal at step 75). Every node's processes ask each second here.
DRAIN_POLL = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
_RANK_NODE = re.compile(r"rank (\d+) of \d+ on Ray node ([0-9a-f]+):")
_STEP = re.compile(r"\bstep=(\d+)\b")
_RESUMED = re.compile(r"resumed from a verified checkpoint at step (\d+)")
# The driver: the governed run of `govray run`, reporting every step (so each rank's log names
# every step it trained), joined to the cluster named by RAY_ADDRESS.
DRIVER = """
import sys
from pathlib import Path
from govray.config.experiment import load_experiment
from govray.core.runtime import ensure_ray
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.run.runner import run_trial
from govray.tracking.store import TrackingStore

ensure_ray()
config = load_experiment(Path(sys.argv[1]))
store = TrackingStore.open(config.database_url)
checked = check_policy(config, store, allow_unsigned=False)
experiment, ingested = ingest_experiment(config, checked, store)
outcome = run_trial(config, checked, experiment, ingested.root, store, report_every=1)
print("trial", outcome.trial_id, outcome.state)
"""


def spot_experiment(root: Path, *, steps: int, period: int) -> Path:
    """The digits example on 2 workers of 1 CPU, SPREAD, widened (hidden 2304: steps of a few
    tenths of a second, so a notice lands mid-period), a checkpoint and a validation every
    ``period`` steps, 2 restarts allowed for failures (a preemption has its own budget)."""
    shutil.copytree(REPO / "jobs" / "examples" / "digits" / "data", root / "data")
    shutil.copytree(REPO / "policies", root / "policies")
    raw: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["policy"] = {"file": "policies/digits.policy.yaml", "trust": "policies/trust.yaml"}
    raw["storage_path"] = str(root / "storage")
    raw["hyperparameters"] = {**GOLDEN_HPARAMS, "hidden": 2304}
    raw["resources"] = {"workers": 2, "cpus_per_worker": 1, "placement_strategy": "SPREAD"}
    raw["searcher"] = {"name": "single", "max_length": {"batches": steps}}
    raw["checkpoint"] = {"period": period, "save_trial_latest": 1000}  # the sealed one stays
    raw["min_validation_period"] = period
    raw["max_restarts"] = 2
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@dataclass(frozen=True)
class Reclaimed:
    """What a run whose node was reclaimed with notice left: the driver's exit and output, the
    drained node, the deadline given, the ranks it held, and rank 0's log over both groups."""

    experiment: Path
    returncode: int
    output: str
    node: str
    deadline_ms: int
    ranks: list[int]
    log: str
    seconds: float  # the driver's wall time

    @property
    def first_group_last_step(self) -> int:
        """The last step the first worker group trained (rank 0 logs each step it trained)."""
        first = self.log.split("resumed from a verified checkpoint", 1)[0]
        return max(int(step) for step in _STEP.findall(first))

    @property
    def resumed_from(self) -> int:
        (step,) = _RESUMED.findall(self.log)
        return int(step)

    @property
    def steps_lost(self) -> int:
        """Steps the first group trained that the restart trains again."""
        return self.first_group_last_step - self.resumed_from

    @property
    def restart_seconds(self) -> float:
        """From the checkpoint sealed on the notice to the restarted group resuming from it (the
        wait for the deadline, the kill, Ray Train's restart and the workers' build)."""
        return _logged_at(self.log, "resumed from a verified checkpoint") - _logged_at(
            self.log, "checkpoint sealed after step"
        )


def _logged_at(log: str, words: str) -> float:
    """When (UNIX s) rank 0 first logged a line with ``words``."""
    line = next(line for line in log.splitlines() if words in line)
    return datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def run_reclaimed(
    cluster: LocalRayCluster, root: Path, *, steps: int, period: int, deadline_s: int
) -> Reclaimed:
    """Head (1 CPU) and two nodes (1 CPU each): the 2 workers and room for the restart on the two
    nodes left. Once both workers are up, the node of the highest rank not on the head is
    drained with ``deadline_s`` left and SIGKILLed at the deadline."""
    cluster.start_head(num_cpus=1, env=DRAIN_POLL)
    processes: dict[str, RayNodeProcess] = {}
    for count in (1, 2, 3):
        if count > 1:
            cluster.add_node(num_cpus=1, env=DRAIN_POLL)
        known = {node.node_id for node in cluster.wait_for_nodes(count)}
        (new,) = known - set(processes)
        processes[new] = cluster.nodes[-1]
    head = next(node.node_id for node in cluster.alive_nodes() if node.is_head)
    experiment = spot_experiment(root, steps=steps, period=period)
    logs = root / "storage" / "logs"
    started = time.monotonic()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(experiment)],
        cwd=REPO,
        env=cluster.environment(RAY_ADDRESS=cluster.address),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        placed = _wait_for_ranks(logs, driver)
        node = max((rank, node) for rank, node in placed.items() if node != head)[1]
        deadline_ms = time.time_ns() // 1_000_000 + deadline_s * 1000
        accepted, why = _gcs_client(cluster.address).drain_node(node, PREEMPTION, "spot reclaim", deadline_ms)
        assert accepted, f"the drain of {node} was refused: {why}"
        time.sleep(max(0.0, deadline_ms / 1000 - time.time()))
        _kill(processes[node])
        output, _ = driver.communicate(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    (log,) = logs.glob("*/rank-0.log")
    return Reclaimed(
        experiment,
        driver.returncode,
        output,
        node,
        deadline_ms,
        sorted(r for r, n in placed.items() if n == node),
        log.read_text(),
        time.monotonic() - started,
    )


def _wait_for_ranks(logs: Path, driver: subprocess.Popen[str], timeout: float = 300) -> dict[int, str]:
    """Rank → Ray node, once both ranks' logs say where they run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        placed = {
            int(rank): node
            for log in logs.glob("*/rank-*.log")
            for rank, node in _RANK_NODE.findall(log.read_text())
        }
        if len(placed) == 2:
            return placed
        if driver.poll() is not None:
            output = driver.stdout.read() if driver.stdout else ""
            raise AssertionError(
                f"the driver ended (rc {driver.returncode}) before its workers ran: {output}"
            )
        time.sleep(0.2)
    raise AssertionError(f"the workers did not start in {timeout:.0f} s")


def _kill(node: RayNodeProcess) -> None:
    """SIGKILL a node's `ray start` and every process of it (raylet, agents, workers)."""
    os.killpg(node.process.pid, signal.SIGKILL)
    for pid, _ in processes_naming((str(node.temp_dir),), open_files=True):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    node.process.wait()
