"""Experiments as Ray jobs against a real `ray start --head` with its dashboard (the Jobs API),
started and stopped here, token authentication on: `govray submit` runs a governed job to
completion and `govray job logs | status` show it; `govray job stop` stops one; Ray's own
`ray job submit` runs the same entry point. Cluster tier: `python -m pytest -m cluster`."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from govray.tracking.lineage import ledger_rows
from tests.helpers.builders import REPO
from tests.helpers.governed_job import digits_experiment, finished_run
from tests.helpers.local_ray import LocalRayCluster
from tests.helpers.ports import free_port

pytestmark = pytest.mark.cluster

STEPS = 12
ENTRY = ("python", "jobs/train.py", "--config", "digits/experiment.yaml")


@pytest.fixture(scope="module")
def jobs_api() -> Iterator[tuple[LocalRayCluster, str]]:
    cluster, port = LocalRayCluster(), free_port()
    try:
        cluster.start_head(num_cpus=2, dashboard_port=port)
        cluster.wait_for_nodes(1)
        yield cluster, f"http://127.0.0.1:{port}"
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == []


def project(root: Path, steps: int) -> Path:
    """A project directory to ship as the job's working_dir: govray's jobs/ (entry points and
    the digits trial) and the digits experiment, writing to storage outside it (absolute)."""
    shutil.copytree(REPO / "jobs", root / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
    experiment = digits_experiment(root / "digits", steps=steps)
    raw = yaml.safe_load(experiment.read_text())
    raw["storage_path"] = str(root.parent / "shared-storage")
    experiment.write_text(yaml.safe_dump(raw, sort_keys=False))
    return experiment


def govray(cluster: LocalRayCluster, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The CLI as a user on another machine runs it: no RAY_ADDRESS, the token from
    ~/.ray/auth_token (Ray's token mode is switched on by govray itself)."""
    environment = cluster.environment()
    environment.pop("RAY_AUTH_MODE", None)
    return subprocess.run(
        ["govray", *args], cwd=cwd, env=environment, capture_output=True, text=True, timeout=600
    )


def test_govray_submit_runs_a_governed_job_and_job_logs_shows_it(
    jobs_api: tuple[LocalRayCluster, str], tmp_path: Path
) -> None:
    cluster, address = jobs_api
    experiment = project(tmp_path / "project", STEPS)
    submitted = govray(
        cluster, "submit", "digits/experiment.yaml", "--address", address, cwd=experiment.parent.parent
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    (job_id,) = [
        line.split()[2] for line in submitted.stdout.splitlines() if line.startswith("submitted job ")
    ]
    assert f"completed {STEPS} steps" in submitted.stdout  # the job's logs, streamed
    assert f"job {job_id} SUCCEEDED" in submitted.stdout

    logs = govray(cluster, "job", "logs", job_id, "--address", address, cwd=tmp_path)
    assert logs.returncode == 0 and f"completed {STEPS} steps" in logs.stdout, logs.stdout + logs.stderr
    assert "packages match the submission's" in logs.stdout  # the job checked its pins first
    status = govray(cluster, "job", "status", job_id, "--address", address, cwd=tmp_path)
    assert status.returncode == 0 and f"job {job_id} SUCCEEDED" in status.stdout, status.stdout

    storage = tmp_path / "shared-storage"
    run = finished_run(experiment, storage=storage)
    assert run.trial.state == "completed"
    assert [m.step for m in run.store.metrics(run.trial.id, "training_loss")][-1] == STEPS  # type: ignore[arg-type]
    assert {row.corpus_id for row in ledger_rows(run.store, run.trial.id)} == {  # type: ignore[arg-type]
        "digits-public",
        "digits-licensed",
        "digits-writers",
    }


def test_govray_job_stop_stops_a_running_job(jobs_api: tuple[LocalRayCluster, str], tmp_path: Path) -> None:
    cluster, address = jobs_api
    experiment = project(tmp_path / "project", steps=100_000)
    submitted = govray(
        cluster,
        "submit",
        "digits/experiment.yaml",
        "--address",
        address,
        "--no-wait",
        "--submission-id",
        "govray-stop-me",
        cwd=experiment.parent.parent,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    deadline = time.monotonic() + 300
    while (
        "policy 'digits'"
        not in govray(cluster, "job", "logs", "govray-stop-me", "--address", address, cwd=tmp_path).stdout
    ):
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(2)
    stopped = govray(cluster, "job", "stop", "govray-stop-me", "--address", address, cwd=tmp_path)
    assert stopped.returncode == 0 and "govray-stop-me STOPPED" in stopped.stdout, (
        stopped.stdout + stopped.stderr
    )
    followed = govray(
        cluster, "job", "logs", "govray-stop-me", "--follow", "--address", address, cwd=tmp_path
    )
    assert followed.returncode == 21, followed.stdout + followed.stderr  # stopped before it finished
    unknown = govray(cluster, "job", "status", "govray-no-such-job", "--address", address, cwd=tmp_path)
    assert unknown.returncode == 20 and "govray-no-such-job" in unknown.stderr + unknown.stdout


def test_ray_job_submit_runs_the_same_entry_point(
    jobs_api: tuple[LocalRayCluster, str], tmp_path: Path
) -> None:
    cluster, address = jobs_api
    experiment = project(tmp_path / "project", steps=5)
    environment = cluster.environment()  # RAY_AUTH_MODE=token: Ray's CLI sends ~/.ray/auth_token
    job = subprocess.run(
        [*("ray", "job", "submit", "--address", address, "--working-dir", ".", "--"), *ENTRY],
        cwd=experiment.parent.parent,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in output and "completed 5 steps" in output, output
