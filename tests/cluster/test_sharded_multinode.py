"""Governed FSDP and HSDP runs whose workers span two Ray nodes on this machine (CPU gloo): FSDP
with one worker per node, HSDP with a shard group per node (2 x 2). Each run completes, every rank
wrote its own shards into each signed checkpoint, and the last one verifies and holds the whole
model put together from them; an FSDP run killed on 4 workers resumes on 2 (`govray resume
--workers 2`) and continues its schedule:
`python -m pytest -m cluster tests/cluster/test_sharded_multinode.py`.
(That HSDP's update equals FSDP's and keeps every exactness promise is ``tests/test_hsdp.py``.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from govray.core.keys import platform_key, platform_trust
from govray.train.checkpoints.files import MODEL_FILE, STATE_FILE, shard_owner, verify_checkpoint
from govray.train.checkpoints.whole_file import whole_tensors
from tests.helpers.governed_job import digits_experiment, finished_run, kill_driver_when, query_one
from tests.helpers.local_ray import LocalRayCluster

pytestmark = pytest.mark.cluster

STEPS = 10


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[LocalRayCluster]:
    """A head and a second node of 2 CPUs each: 2 workers fit on each."""
    cluster = LocalRayCluster()
    try:
        cluster.start_head(num_cpus=2)
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes(2)
        yield cluster
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == []


@pytest.mark.parametrize(
    ("workers", "placement", "sharding", "groups"),
    [
        (2, "STRICT_SPREAD", {"strategy": "fsdp"}, [[0], [1]]),
        (4, "SPREAD", {"strategy": "hsdp", "shard_group": 2}, [[0, 1], [2, 3]]),
    ],
    ids=["fsdp", "hsdp"],
)
def test_a_sharded_run_across_two_nodes_completes_with_every_ranks_shards_signed(
    two_nodes: LocalRayCluster,
    tmp_path: Path,
    workers: int,
    placement: str,
    sharding: dict[str, Any],
    groups: list[list[int]],
) -> None:
    experiment = digits_experiment(
        tmp_path, steps=STEPS, placement=placement, workers=workers, sharding=sharding
    )
    job = two_nodes.govray("run", str(experiment))
    assert job.returncode == 0, job.stdout + job.stderr
    run = finished_run(experiment)
    assert run.trial.state == "completed"
    assert set(run.worker_nodes) == set(range(workers))
    on_node = [{run.worker_nodes[rank] for rank in ranks} for ranks in groups]
    assert all(len(nodes) == 1 for nodes in on_node), run.worker_nodes  # a group within a node
    assert len(set().union(*on_node)) == 2, "the workers span both nodes"
    folder = run.final_checkpoint
    assert {shard_owner(path.name) for path in folder.iterdir()} == {None, *range(workers)}
    assert not (folder / MODEL_FILE).exists(), "no whole model through one process"
    sharded = json.loads((folder / STATE_FILE).read_text())["sharding"]
    assert sharded == {"world_size": workers, **({"shard_group": 2} if "shard_group" in sharding else {})}
    trust = platform_trust(platform_key())
    verify_checkpoint(folder, trust)  # every file, every rank's shards
    # The whole model, streamed from the verified shards, holds every tensor of the trial's model.
    whole = dict(whole_tensors(folder, trust))
    assert whole and all(tensor.numel() for tensor in whole.values())


def test_a_sharded_run_killed_on_four_workers_resumes_on_two_continuing_its_schedule(
    two_nodes: LocalRayCluster, tmp_path: Path
) -> None:
    """FSDP on 4 workers across the two nodes, its driver killed after the step-5 checkpoint, then
    ``govray resume --workers 2``: each of the 2 ranks runs 2 of each step's 4 slots. The run
    completes with the uninterrupted 4-worker run's ledger exactly, weights within the fp32
    summation order of it, its shards over 2 ranks and its world-size history signed."""
    steps = 15
    setup = {"steps": steps, "placement": "SPREAD", "workers": 4, "sharding": {"strategy": "fsdp"}}
    reference = digits_experiment(tmp_path / "reference", **setup)  # type: ignore[arg-type]
    job = two_nodes.govray("run", str(reference))
    assert job.returncode == 0, job.stdout + job.stderr
    uninterrupted = finished_run(reference)
    experiment = digits_experiment(tmp_path / "killed", **setup)  # type: ignore[arg-type]
    database = experiment.parent / "storage" / "govray.db"
    first = "SELECT trial_id FROM checkpoints WHERE step = 5"
    trial_id = kill_driver_when(two_nodes, "train.py", experiment, lambda: query_one(database, first))
    time.sleep(3)  # the job's Ray Train controller and workers die with their driver
    job = two_nodes.govray(
        "resume", "digits-governed", "--database", f"sqlite:///{database}", "--workers", "2"
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert "on 2 workers (configured: 4;" in job.stdout, job.stdout
    run = finished_run(experiment)
    assert run.trial.id == trial_id and run.trial.state == "completed"
    states = [json.loads((r.final_checkpoint / STATE_FILE).read_text()) for r in (uninterrupted, run)]
    assert states[1]["sharding"] == {"world_size": 2}
    (_, four), (resumed_at, two) = states[1]["world_history"]  # (the orphaned workers may add step 10)
    assert (four, two) == (4, 2) and resumed_at in (5, 10), states[1]["world_history"]
    assert states[1]["ledger"] == states[0]["ledger"]
    trust = platform_trust(platform_key())
    expected, found = (
        dict(whole_tensors(uninterrupted.final_checkpoint, trust)),
        dict(whole_tensors(run.final_checkpoint, trust)),
    )
    assert expected.keys() == found.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(found[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
