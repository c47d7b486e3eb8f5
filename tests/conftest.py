"""Shared fixtures: one Ray instance per test session, keys, signed policies, small corpora."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from govray.core.keys import KeyRole, SigningKey, TrustConfig, save_trust
from govray.governance.policy import sign_policy
from govray.tracking.store import TrackingStore
from jobs.examples.digits.golden import EXAMPLE_CONFIG as EXAMPLE_CONFIG  # tests import it from here
from jobs.examples.digits.golden import (
    GOLDEN_HPARAMS,
    GOLDEN_REPORT_EVERY,
    GOLDEN_STEPS,
    copy_example,
    opened,
    save_experiment,
)
from jobs.examples.digits.golden import golden_example as _golden_example
from tests.tiers import pytest_fixture_setup as pytest_fixture_setup  # the default tier's time budget
from tests.tiers import pytest_runtest_makereport as pytest_runtest_makereport

if TYPE_CHECKING:
    from tests.cluster.postgres import PostgresServer

REPO = Path(__file__).resolve().parents[1]

BASE_CREDENTIAL: dict[str, Any] = {
    "license_class": "public-domain",
    "jurisdiction": "US",
    "sensitivity": "public",
    "source_type": "public-dataset",
    "modality": "tabular",
    "tdm_opt_out": False,
    "collection_period": {"start": "2020-01-01", "end": "2020-12-31"},
}


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole session (Ray takes seconds to start on 2 cores)."""
    import ray

    from govray.core.runtime import ensure_ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ensure_ray()
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_placement_group_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test in the session's Ray: no placement group of this job is left. A group a
    dead Train controller left would hold its CPUs until the session ends, and every later test
    that needs them would hang; this fails the test that left it (and frees it) instead."""
    yield
    import ray

    if "ray_session" not in request.fixturenames or not ray.is_initialized():
        return  # (a cluster test's own Ray may be gone by now)
    from govray.platform.search.placement_guard import held_groups, orphaned_groups, remove_group

    deadline = time.monotonic() + 10.0  # a controller Tune stopped at the test's end is still dying
    while any(g.creator_alive for g in held_groups()) and time.monotonic() < deadline:
        time.sleep(0.25)
    orphans = orphaned_groups()
    for group in orphans:
        remove_group(group)
    held = held_groups()
    holders = _cpus_left_held(timeout=30.0)
    assert not orphans and not held and not holders, (request.node.nodeid, orphans, held, holders)


def _cpus_left_held(timeout: float) -> list[str]:
    """Waits up to ``timeout`` s until every CPU of the session's Ray is free again. If some stay
    held, kills this job's live actors (what a failed test left: a Tune trial, a Train controller
    or its workers) and names them. A CPU left held would make the next test that needs the cores
    wait without end: a 2-worker trial's controller retries its worker group every 60 s forever."""
    import ray
    from ray._private import state

    def free() -> bool:
        return ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources().get("CPU", 0.0) - 1e-6

    deadline = time.monotonic() + timeout
    while not free():
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    else:
        return []
    job = ray.get_runtime_context().get_job_id()
    live = [
        actor
        for actor in state.actors().values()
        if actor["JobID"] == job and actor["State"] == "ALIVE" and not actor["IsDetached"]
    ]
    for actor in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(actor["Pid"], signal.SIGKILL)
    named = [f"{actor['ActorClassName']} (pid {actor['Pid']})" for actor in live]
    return named or ["CPUs held, no live actor"]


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server for the cluster tier, installed and started on first use."""
    from tests.cluster.postgres import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.cluster)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty tracking database: a SQLite file, and in the cluster tier also a database on a real
    PostgreSQL server, so every store-level test runs on both with the same code and migrations."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tracking.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres")
    with server.database() as url:
        yield url


@pytest.fixture
def store(database_url: str) -> Iterator[TrackingStore]:
    """A tracking store migrated to the newest schema in ``database_url``."""
    opened = TrackingStore.open(database_url)
    yield opened
    opened.close()


@pytest.fixture(scope="session")
def authority_key() -> SigningKey:
    return SigningKey.generate(KeyRole.POLICY_AUTHORITY)


@pytest.fixture(scope="session")
def trust(authority_key: SigningKey) -> TrustConfig:
    return TrustConfig(keys=[authority_key.public_key])


@pytest.fixture
def trust_file(tmp_path: Path, trust: TrustConfig) -> Path:
    path = tmp_path / "trust.yaml"
    save_trust(trust, path)
    return path


def write_signed_policy(
    directory: Path, policy: dict[str, Any], key: SigningKey, name: str = "policy"
) -> Path:
    """Write POLICY.yaml and POLICY.yaml.sig (signed by ``key``); return the policy path."""
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    path.with_name(path.name + ".sig").write_text(sign_policy(path, key).to_json())
    return path


def table_rows(count: int, start: int = 0, **extra: list[Any]) -> list[dict[str, Any]]:
    rows = [{"x": float(i) / 7.0, "y": i % 3, "text": f"row {i}"} for i in range(start, start + count)]
    for column, values in extra.items():
        for row, value in zip(rows, values, strict=True):
            row[column] = value
    return rows


def write_corpus(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as parquet, jsonl or csv according to the file extension."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["x"])
            writer.writeheader()
            writer.writerows(rows)
    return path


def write_experiment(directory: Path, **overrides: Any) -> Path:
    """An experiment file in ``directory`` using the digits trial; ``overrides`` replace keys."""
    config: dict[str, Any] = {
        "name": "test-experiment",
        "trial": "jobs.examples.digits.trial:DigitsTrial",
        "hyperparameters": {"hidden": 16, "dropout": 0.0},
        "data": {"holdout_fraction": 0.2, "corpora": []},
        "policy": {"file": "policy.yaml", "trust": "trust.yaml"},
        "storage_path": "storage",
        "seed": 1,
    }
    config.update(overrides)
    path = directory / "experiment.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def example_copy(tmp_path: Path) -> Path:
    """A copy of the digits example (data, policy, trust) whose storage lies in ``tmp_path``."""
    root = tmp_path / "example"
    return save_experiment(root, copy_example(root))


# --- golden runs: a few real Ray Train runs that many tests read ---------------------------------
# (built by jobs/examples/digits/golden.py, which the golden digest uses too)


@dataclass
class GoldenRun:
    config: Any
    checked: Any
    shard_root: Path
    store: Any
    outcome: Any


def _golden_run(path: Path) -> GoldenRun:
    from govray.platform.run.runner import run_trial

    config, store, checked, experiment, ingested = opened(path)
    outcome = run_trial(config, checked, experiment, ingested.root, store, report_every=GOLDEN_REPORT_EVERY)
    return GoldenRun(config, checked, ingested.root, store, outcome)


@pytest.fixture(scope="session")
def golden_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _golden_example(tmp_path_factory.mktemp("golden"), workers=2, max_length={"batches": GOLDEN_STEPS})


@pytest.fixture(scope="session")
def golden_run(ray_session: None, golden_example: Path) -> GoldenRun:
    """2 Ray Train workers, 30 governed steps of the digits example, weights every 10 steps."""
    return _golden_run(golden_example)


@pytest.fixture(scope="session")
def golden_replay_without_writers(golden_run: GoldenRun) -> Any:  # a govray.platform.rerun.replay.Replay
    """The golden run replayed (``govray replay``'s function) with the PII corpus, routed to the
    adapter, excluded: its slots left empty, the recorded LR cuts applied; and its influence report."""
    from govray.platform.rerun.replay import replay_trial

    return replay_trial(
        golden_run.store, golden_run.config.name, ("digits-writers",), trial_id=golden_run.outcome.trial_id
    )


@pytest.fixture(scope="session")
def golden_run_without_writers(golden_run: GoldenRun, golden_replay_without_writers: Any) -> GoldenRun:
    """That replay as a run: the counterfactual the removal and row-lookup tests compare with."""
    return GoldenRun(
        golden_run.config,
        golden_run.checked,
        golden_run.shard_root,
        golden_run.store,
        golden_replay_without_writers.outcome,
    )


@pytest.fixture(scope="session")
def golden_local_epoch(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> GoldenRun:
    """One worker in-process (Train V2 local mode), exactly one epoch, AdamW, default checkpoint GC."""
    hparams = {**GOLDEN_HPARAMS, "optimizer": "adamw", "lr": 0.01}
    path = _golden_example(
        tmp_path_factory.mktemp("local"),
        workers=1,
        max_length={"epochs": 1},
        hparams=hparams,
        keep_checkpoints=None,  # Determined's default GC: the trial's best and latest
        lr_schedule=False,
    )
    return _golden_run(path)


@dataclass(frozen=True)
class RegisteredPair:
    """A registered version of the one-epoch golden run and the version made from it by removing
    its PII adapter: what the tools users already run (model_signing, CycloneDX, MLflow) read."""

    store: Any
    version: Any  # RegisteredVersion
    without_adapter: Any  # RegisteredVersion, without adapter REMOVED_ADAPTER


REMOVED_ADAPTER = "pii-lora"


@pytest.fixture(scope="session")
def registered_pair(golden_local_epoch: GoldenRun) -> RegisteredPair:
    from govray.platform.registry.register import register, remove_adapter
    from govray.train.checkpoints.files import find_checkpoints

    store = golden_local_epoch.store
    final = find_checkpoints(golden_local_epoch.outcome.run_dir)[-1]
    version = register(store, "digits-where-users-look", final, description="one epoch")
    return RegisteredPair(store, version, remove_adapter(store, version.ref, REMOVED_ADAPTER))


def edited_trial_elsewhere(directory: Path) -> dict[str, str]:
    """A working directory away from the project with its own copy of the digits trial, edited
    after the golden runs (its losses doubled: every weight would change), and the environment
    of a process started there on this session's Ray: that copy shadows the project's on
    PYTHONPATH, so only the recorded code snapshot runs the trial as it ran."""
    import ray

    package = directory / "jobs" / "examples" / "digits"
    package.mkdir(parents=True)
    for relative in ("jobs/__init__.py", "jobs/examples/__init__.py", "jobs/examples/digits/__init__.py"):
        shutil.copyfile(REPO / relative, directory / relative)
    source = (REPO / "jobs" / "examples" / "digits" / "trial.py").read_text()
    edited = source.replace("return F.cross_entropy(model(", "return 2.0 * F.cross_entropy(model(")
    assert edited != source
    (package / "trial.py").write_text(edited)
    path = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    imported = subprocess.run(
        [sys.executable, "-c", "import jobs.examples.digits.trial as t; print(t.__file__)"],
        cwd=directory,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.strip() == str(package / "trial.py")  # what a plain import runs there
    return environment


def govray_elsewhere(directory: Path, *args: str) -> str:
    """``python -m govray ARGS`` run from ``directory`` set up by ``edited_trial_elsewhere``;
    fails unless it exits 0; returns what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "govray", *args],
        cwd=directory,
        env=edited_trial_elsewhere(directory),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def kill_driver_when(
    script: str, config: Path | list[str], ready: Callable[[], bool], settle: float = 0.0
) -> None:
    """Run ``jobs/SCRIPT --config CONFIG`` (``config`` a list: ``jobs/SCRIPT ARGS``) in its own
    process on this session's Ray cluster (as ``ray job submit`` would), SIGKILL it once ``ready()``
    holds (polled every 0.05 s, at most 300 s; ``settle`` seconds later), and wait until it is
    gone. Fails if it never got ready."""
    import ray

    environment = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    arguments = config if isinstance(config, list) else ["--config", str(config)]
    driver = subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / script), *arguments],
        cwd=REPO,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    killed = False
    while driver.poll() is None and time.monotonic() < deadline:
        if ready():
            time.sleep(settle)
            driver.send_signal(signal.SIGKILL)  # a real kill, no cleanup
            killed = True
            break
        time.sleep(0.05)
    driver.wait(timeout=60)
    assert killed, f"jobs/{script} ended or timed out before it was ready to be killed"
