"""A small governed digits run for the cluster tier, and what it left behind (tracking store,
final checkpoint, the Ray node each rank ran on)."""

from __future__ import annotations

import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from govray.core.logs import log_dir
from govray.tracking.store import TrackingStore
from govray.tracking.tables import TrialRecord
from govray.train.checkpoints.files import find_checkpoints
from jobs.examples.digits.golden import EXAMPLE_CONFIG, GOLDEN_HPARAMS
from tests.helpers.builders import REPO
from tests.helpers.local_ray import LocalRayCluster

# The governed step's outputs: what "bit-identical results" compares.
MODEL_FILES = ("model.safetensors", "adapter-pii-lora.safetensors", "optimizer.safetensors")
_RANK_NODE = re.compile(r"rank (\d+) of \d+ on Ray node ([0-9a-f]+):")


def digits_experiment(
    root: Path,
    *,
    steps: int,
    placement: str = "PACK",
    workers: int = 2,
    sharding: dict[str, Any] | None = None,
) -> Path:
    """The digits example (three credentialed corpora, the signed policy with its PII adapter) in
    ``root``: ``workers`` CPU workers placed by ``placement`` (and holding the model as
    ``sharding`` says: ``strategy``, ``shard_group``), ``steps`` steps, a validation (and a
    metric-driven LR decision) and a checkpoint every 5 steps."""
    shutil.copytree(REPO / "jobs" / "examples" / "digits" / "data", root / "data")
    shutil.copytree(REPO / "policies", root / "policies")
    raw: dict[str, Any] = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["policy"] = {"file": "policies/digits.policy.yaml", "trust": "policies/trust.yaml"}
    raw["storage_path"] = "storage"
    raw["hyperparameters"] = GOLDEN_HPARAMS  # dropout and per-route clipping in play
    raw["resources"] = {
        "workers": workers,
        "cpus_per_worker": 1,
        "placement_strategy": placement,
        **(sharding or {}),
    }
    raw["searcher"] = {"name": "single", "max_length": {"batches": steps}}
    raw["checkpoint"] = {"period": 5}
    raw["min_validation_period"] = 5
    raw["lr_schedule"] = {"metric": "validation_loss", "factor": 0.5, "patience": 0, "threshold": 0.9}
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@dataclass(frozen=True)
class FinishedRun:
    store: TrackingStore
    trial: TrialRecord
    final_checkpoint: Path
    worker_nodes: dict[int, str]  # rank → Ray node id, from the workers' logs


def finished_run(experiment: Path, storage: Path | None = None) -> FinishedRun:
    """The one trial of the experiment in ``experiment``'s directory, as the tracking store and
    the storage (default: ``storage`` next to it) hold it."""
    storage = storage or experiment.parent / "storage"
    store = TrackingStore.open(f"sqlite:///{storage / 'govray.db'}")
    (recorded,) = store.list_experiments()
    assert recorded.id is not None
    (trial,) = store.list_trials(recorded.id)
    assert trial.ray_run_name is not None
    checkpoints = find_checkpoints(storage / "ray" / trial.ray_run_name)
    nodes = {}
    for log in log_dir(storage, trial.ray_run_name).glob("rank-*.log"):
        for rank, node in _RANK_NODE.findall(log.read_text()):
            nodes[int(rank)] = node
    return FinishedRun(store, trial, checkpoints[-1], nodes)


def query_one(database: Path, sql: str) -> int | None:
    """The first column of the query's first row, read with sqlite3 (opening a TrackingStore
    would race the driver's migrations); None before the store or the row exists."""
    try:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as connection:
            found = connection.execute(sql).fetchone()
    except sqlite3.OperationalError:  # not created yet
        return None
    return int(found[0]) if found and found[0] is not None else None


def kill_driver_when(
    cluster: LocalRayCluster,
    script: str,
    experiment: Path,
    ready: Callable[[], int | None],
    settle: float = 0,
) -> int:
    """``jobs/SCRIPT --config EXPERIMENT`` as a driver of the cluster, SIGKILLed ``settle`` s
    after ``ready()`` first returns a value; returns that value."""
    log = experiment.with_name(f"{script}.log")
    with open(log, "w") as output:
        driver = subprocess.Popen(
            [sys.executable, f"jobs/{script}", "--config", str(experiment)],
            cwd=REPO,
            env=cluster.environment(RAY_ADDRESS=cluster.address),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 400
    try:
        while driver.poll() is None and time.monotonic() < deadline:
            if (value := ready()) is not None:
                time.sleep(settle)
                driver.send_signal(signal.SIGKILL)
                driver.wait(timeout=60)
                return value
            time.sleep(0.1)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    raise AssertionError(
        f"jobs/{script} ended (rc {driver.returncode}) or timed out before it was ready: {log.read_text()}"
    )
