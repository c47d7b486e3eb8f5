"""Shared fixtures: one Ray instance per test session, keys, signed policies, small corpora."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from govray.core.key_creation import init_platform_keys
from govray.core.keys import (
    KeyRole,
    SigningKey,
    TrustConfig,
    govray_home,
    save_trust,
)
from govray.core.settings import OVERRIDES, SETTINGS_FILE
from govray.tracking.store import TrackingStore
from jobs.examples.digits.golden import GOLDEN_HPARAMS, GOLDEN_STEPS, copy_example, save_experiment
from jobs.examples.digits.golden import golden_example as golden_example_at
from tests.helpers.golden import REMOVED_ADAPTER, GoldenRun, RegisteredPair, golden_run_at
from tests.helpers.tiers import pytest_fixture_setup as pytest_fixture_setup  # the default tier's time budget
from tests.helpers.tiers import pytest_runtest_makereport as pytest_runtest_makereport

if TYPE_CHECKING:
    from tests.helpers.postgres import PostgresServer


TESTS_HOME = "GOVRAY_TESTS_HOME"  # (not govray's: where this session put its GOVRAY_HOME)


def pytest_configure(config: pytest.Config) -> None:
    """The session's own ``GOVRAY_HOME`` (settings file, platform keys, logs, Ray head record), and
    none of the settings' environment overrides: what the developer's machine holds never changes
    what a test sees, or what a test writes there. (Set before Ray starts: its workers inherit it.)"""
    home = tempfile.mkdtemp(prefix="govray-tests-home-")
    os.environ["GOVRAY_HOME"] = os.environ[TESTS_HOME] = home
    for name in OVERRIDES:
        os.environ.pop(name, None)
    init_platform_keys(Path(home))  # (`govray keys init`: nothing creates them on use)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's development signer stopped (the runs' launches started it), its home removed."""
    from govray.signer.local import stop_dev_signer

    stop_dev_signer()
    shutil.rmtree(os.environ.pop(TESTS_HOME, ""), ignore_errors=True)


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
    from govray.platform.search.placement_guard import (
        held_groups,
        kill_actor,
        live_controllers,
        orphaned_groups,
        remove_group,
    )

    deadline = time.monotonic() + 10.0  # a controller Tune stopped at the test's end is still dying
    while (any(g.creator_alive for g in held_groups()) or live_controllers()) and time.monotonic() < deadline:
        time.sleep(0.25)
    # A Train controller still alive now outlived its run: one waiting for CPUs would take them
    # from the next test's run and retry its worker group forever. Killed (no restart), and named.
    controllers = sorted(live_controllers())
    for actor in controllers:
        kill_actor(actor)
    if controllers:
        time.sleep(2.0)  # (a kill is asynchronous: its group is an orphan once it is dead)
    orphans = orphaned_groups()
    for group in orphans:
        remove_group(group)
    held = held_groups()
    holders = _cpus_left_held(timeout=30.0)
    assert not controllers and not orphans and not held and not holders, (
        request.node.nodeid,
        controllers,
        orphans,
        held,
        holders,
    )


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
    from tests.helpers.postgres import postgres_server

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


@pytest.fixture
def operator_settings() -> Iterator[Path]:
    """The operator's settings file (this session's GOVRAY_HOME has none), removed afterwards."""
    path = govray_home() / SETTINGS_FILE
    assert not path.exists()
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture
def example_copy(tmp_path: Path) -> Path:
    """A copy of the digits example (data, policy, trust) whose storage lies in ``tmp_path``."""
    root = tmp_path / "example"
    return save_experiment(root, copy_example(root))


# --- golden runs: a few real Ray Train runs that many tests read ---------------------------------
# (built by jobs/examples/digits/golden.py, which the golden digest uses too)


@pytest.fixture(scope="session")
def golden_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return golden_example_at(
        tmp_path_factory.mktemp("golden"), workers=2, max_length={"batches": GOLDEN_STEPS}
    )


@pytest.fixture(scope="session")
def golden_run(ray_session: None, golden_example: Path) -> GoldenRun:
    """2 Ray Train workers, 30 governed steps of the digits example, weights every 10 steps."""
    return golden_run_at(golden_example)


@pytest.fixture(scope="module")
def signing_spec(golden_run: GoldenRun, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The golden run's spec, its checkpoints in a directory of the test module's own (a module
    that trains from it in a gloo group, sealing through the platform's signer
    (``tests.helpers.signing``), and reads the checkpoints back: FSDP's, HSDP's)."""
    from tests.helpers.engine import run_spec  # imports torch: only for the modules that ask

    root = tmp_path_factory.mktemp("fsdp-checkpoints")
    return run_spec(golden_run).model_copy(update={"run_dir": str(root / "run")})


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
    path = golden_example_at(
        tmp_path_factory.mktemp("local"),
        workers=1,
        max_length={"epochs": 1},
        hparams=hparams,
        keep_checkpoints=None,  # Determined's default GC: the trial's best and latest
        lr_schedule=False,
    )
    return golden_run_at(path)


@pytest.fixture(scope="session")
def registered_pair(golden_local_epoch: GoldenRun) -> RegisteredPair:
    from govray.platform.registry.register import register, remove_adapter
    from govray.train.checkpoints.files import find_checkpoints

    store = golden_local_epoch.store
    final = find_checkpoints(golden_local_epoch.outcome.run_dir)[-1]
    version = register(store, "digits-where-users-look", final, description="one epoch")
    return RegisteredPair(store, version, remove_adapter(store, version.ref, REMOVED_ADAPTER))
