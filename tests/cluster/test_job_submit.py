"""`ray job submit` against a real `ray start --head` (started and stopped here): a governed run
completes as a Ray job and lands in the tracking store. Cluster tier: `python -m pytest -m cluster`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from govray.tracking.lineage import ledger_rows
from govray.tracking.store import TrackingStore
from tests.conftest import EXAMPLE_CONFIG, REPO

pytestmark = pytest.mark.cluster


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local head node with the dashboard (the Jobs API); token authentication stays on."""
    port, dashboard = free_port(), free_port()
    temp = tmp_path_factory.mktemp("ray-head")
    subprocess.run(
        [
            "ray",
            "start",
            "--head",
            f"--port={port}",
            f"--dashboard-port={dashboard}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)


def test_ray_job_submit_runs_a_governed_experiment(ray_head: str, tmp_path: Path) -> None:
    shutil.copytree(EXAMPLE_CONFIG.parent / "data", tmp_path / "data")
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    for corpus in raw["data"]["corpora"]:
        corpus["path"] = str(tmp_path / corpus["path"])
    policies = REPO / "policies"
    raw["policy"] = {"file": str(policies / "digits.policy.yaml"), "trust": str(policies / "trust.yaml")}
    raw["storage_path"] = str(tmp_path / "storage")
    raw["searcher"]["max_length"] = {"batches": 12}
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(raw))
    environment = {**os.environ, "RAY_AUTH_MODE": "token"}  # the client sends ~/.ray/auth_token
    environment.pop("RAY_ADDRESS", None)
    job = subprocess.run(
        [
            "ray",
            "job",
            "submit",
            "--address",
            ray_head,
            "--working-dir",
            str(REPO),
            "--",
            "python",
            "jobs/train.py",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
        cwd=REPO,
    )
    output = job.stdout + job.stderr
    assert job.returncode == 0, output
    assert "succeeded" in output and "completed 12 steps" in output
    store = TrackingStore.open(f"sqlite:///{tmp_path / 'storage' / 'govray.db'}")
    (experiment,) = store.list_experiments()
    assert experiment.state == "completed"
    (trial,) = store.list_trials(experiment.id)  # type: ignore[arg-type]
    assert trial.state == "completed" and trial.ray_run_name
    assert [m.step for m in store.metrics(trial.id, "training_loss")] == [12]  # type: ignore[arg-type]
    assert {row.corpus_id for row in ledger_rows(store, trial.id)} == {  # type: ignore[arg-type]
        "digits-public",
        "digits-licensed",
        "digits-writers",
    }
