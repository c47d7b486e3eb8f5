"""An elastic run (``resources.workers: {min: 2, max: 3}``) on a head and two more Ray nodes of one
CPU each: every process of a worker node SIGKILLed at once mid-run, then a node started again
(``jobs/benchmarks/elastic_kill.py`` runs the scenario):
`python -m pytest -m cluster tests/cluster/test_elastic.py`."""

from __future__ import annotations

import base64
import functools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from govray.core.keys import platform_key, platform_trust
from govray.platform.lifecycle import request_kill
from govray.provenance.recompute import check_attested_ledger
from govray.signer.attesting import attest
from govray.train.checkpoints.files import STATE_FILE, checkpoint_step, find_checkpoints
from govray.train.checkpoints.manifest import CheckpointState
from govray.train.runspec import RUN_SPEC_FILE
from jobs.benchmarks.elastic_kill import FAST_FAILURE_DETECTION, PERIOD, REPO, attempts, kill_and_regrow
from tests.helpers.gloo_group import persistent_group, rank_main
from tests.helpers.local_ray import LocalRayCluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def three_nodes() -> Iterator[LocalRayCluster]:
    """A head and two more nodes of one CPU each: one worker on each."""
    cluster = LocalRayCluster()
    try:
        cluster.start_head(num_cpus=1, env=FAST_FAILURE_DETECTION)
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes(3)
        yield cluster
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == []


def segment(rank: int, world: int, start: str, end: str) -> tuple[str, Any]:
    """On a fixed world: from checkpoint ``start`` (its run's spec; "" with ``end``'s spec: from
    scratch) train to ``end``'s step, then compare with ``end``'s state: the parameters and the
    optimizer's state tensor by tensor, bit for bit, and the ledger."""
    import torch

    from govray.train.context import WorkerContext
    from govray.train.parallel.worker import Worker
    from govray.train.run.state import TrialRun
    from govray.train.runspec import RunSpec

    spec = RunSpec.model_validate_json((Path(end) / RUN_SPEC_FILE).read_text())
    worker = Worker.detect()
    trained, recorded = (
        TrialRun.open(WorkerContext.of(spec, worker)),
        TrialRun.open(WorkerContext.of(spec, worker)),
    )
    first = trained.restore(Path(start)) if start else 0
    last = recorded.restore(Path(end))
    for step in range(first, last):
        trained.governed.step(step)
    ours = dict(trained.governed.model.named_parameters())
    differing = [
        name
        for name, tensor in recorded.governed.model.named_parameters()
        if not torch.equal(tensor.detach(), ours[name].detach())
    ]
    mine, theirs = (run.governed.optimizer.state_dict() for run in (trained, recorded))
    if mine["param_groups"] != theirs["param_groups"] or mine["state"].keys() != theirs["state"].keys():
        differing.append("optimizer: param groups or state keys")
    for index, state in theirs["state"].items():
        for key, value in state.items():
            other = mine["state"][index].get(key)
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                differing.append(f"optimizer state {index}.{key}")
    if trained.governed.ledger != recorded.governed.ledger:
        differing.append("ledger")
    return "ok", (first, last, differing)


@pytest.mark.timeout(1500)  # a few minutes on a quiet machine; over 15 under a load average of 50
def test_an_elastic_run_continues_on_two_workers_when_a_node_dies_and_grows_back_to_three(
    three_nodes: LocalRayCluster, tmp_path: Path
) -> None:
    """Killed without notice, the 3-worker world loses at most a checkpoint period: the 2 workers
    left resume from the newest verified checkpoint; a node back, the run grows to 3 workers from
    the newest checkpoint again. The trial's record and its signed checkpoints hold the world-size
    history (3 from step 0, 2 from the first resume, 3 from the second); the start and each
    world's whole stretch, trained again on a fixed world of its size from the checkpoint the run
    resized at (the first from scratch), reaches the checkpoint of the next resize (the last: the
    final one) with the same parameters, optimizer state and ledger, bit for bit: the run is the
    fixed-size runs of its history, continued across the resizes as ``govray resume --workers``
    continues one; the ledger is exactly the one the schedule gives (every slot counted once); and
    the run, paused, stops at a checkpoint; activated, it continues on 3 workers, and a kill
    request stops it."""
    seen = kill_and_regrow(three_nodes, tmp_path)
    assert seen.state == "paused"
    shrunk, grown = seen.shrunk.resumed_from, seen.grown.resumed_from
    assert shrunk >= PERIOD and shrunk % PERIOD == 0 and grown > shrunk and grown % PERIOD == 0
    # Killed half a period past a checkpoint; 0 only when the step in flight as the node died was
    # the checkpoint's own (the scenario polls the log).
    assert 0 <= seen.steps_lost <= PERIOD
    history = [(0, 3), (shrunk, 2), (grown, 3)]

    storage = seen.experiment.parent / "storage"
    from govray.tracking.store import TrackingStore

    url = f"sqlite:///{storage / 'govray.db'}"
    store = TrackingStore.open(url)
    (recorded,) = store.list_experiments()
    assert recorded.id is not None
    (trial,) = store.list_trials(recorded.id)
    assert trial.world_history == history
    assert trial.ray_run_name is not None
    by_step: dict[int, Path] = {}
    for folder in find_checkpoints(storage / "ray" / trial.ray_run_name):  # the newest of a step wins
        if (
            checkpoint_step(folder) not in by_step
            or folder.stat().st_mtime > by_step[checkpoint_step(folder)].stat().st_mtime
        ):
            by_step[checkpoint_step(folder)] = folder
    final = by_step[max(by_step)]
    state = CheckpointState.model_validate_json((final / STATE_FILE).read_text())
    assert [tuple(entry) for entry in state.world_history] == history
    assert state.step == trial.last_step and state.step > grown

    trust = platform_trust(platform_key())
    written = attest(final)
    coverage = json.loads(base64.b64decode(json.loads(written.coverage.read_text())["payload"]))
    assert check_attested_ledger(coverage, final, trust) > 0  # recomputed from the schedule: equal
    provenance = json.loads(base64.b64decode(json.loads(written.provenance.read_text())["payload"]))
    internal = provenance["predicate"]["buildDefinition"]["internalParameters"]
    assert internal["world_history"] == [list(entry) for entry in history]

    # Each world's stretch of the history, trained again on a fixed world from the checkpoint it
    # began at, ends at the state the run handed to the next world.
    segments = [
        (3, "", by_step[shrunk]),
        (2, by_step[shrunk], by_step[grown]),
        (3, by_step[grown], final),
    ]
    for world, start, end in segments:
        directory = tmp_path / f"gloo-to-{checkpoint_step(end)}"
        directory.mkdir()
        with persistent_group(functools.partial(rank_main, world=world), directory, world, 300) as run:
            answers = run((segment, str(start), str(end)))
        assert all(status == "ok" for status, _ in answers.values()), answers
        first, last, differing = answers[0][1]
        assert (differing, last) == ([], checkpoint_step(end)), (world, first, last)

    # Paused, the elastic run continues (`govray experiment activate`: on Ray Train's elastic
    # scaling again, 3 workers) and a kill request stops it at a step boundary.
    log = next(storage.glob("logs/*/rank-0.log"))
    activated_at = time.time()
    with open(tmp_path / "activate.log", "wb") as output:
        driver = subprocess.Popen(
            [sys.executable, "-m", "govray", "experiment", "activate", str(recorded.id), "--database", url],
            env=three_nodes.environment(RAY_ADDRESS=three_nodes.address),
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    said = tmp_path / "activate.log"
    try:
        deadline = time.monotonic() + 300
        while not ((newest := attempts(log)[-1]).started > activated_at and newest.last_step > state.step):
            assert driver.poll() is None and time.monotonic() < deadline, said.read_text()
            time.sleep(0.2)
        assert newest.workers == 3 and newest.resumed_from == state.step
        request_kill(store, recorded.id)
        assert driver.wait(timeout=300) == 0, said.read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert trial.id is not None and store.get_trial(trial.id).state == "killed"
    assert store.get_experiment(recorded.id).state == "killed"
