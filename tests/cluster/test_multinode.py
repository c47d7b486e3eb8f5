"""Governed training whose workers land on different Ray nodes gives bit-identical results to the
single-node run (CPU gloo, same world size and threads). A 2-node cluster on this machine:
`python -m pytest -m cluster tests/cluster/test_multinode.py`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.governed_job import MODEL_FILES, digits_experiment, finished_run
from tests.helpers.local_ray import LocalRayCluster

pytestmark = pytest.mark.cluster

STEPS = 10


@pytest.fixture
def cluster() -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == []


def test_workers_on_two_nodes_train_bit_identically_to_one_node(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    # The single-node reference: the head alone, both workers on it (the default PACK).
    cluster.start_head(num_cpus=2)
    (head,) = cluster.wait_for_nodes(1)
    single = digits_experiment(tmp_path / "single", steps=STEPS)
    started = time.monotonic()
    job = cluster.govray("run", str(single))
    assert job.returncode == 0, job.stdout + job.stderr
    single_seconds = time.monotonic() - started

    # A second node joins; STRICT_SPREAD puts one worker on each.
    cluster.add_node(num_cpus=1)
    nodes = cluster.wait_for_nodes(2)
    spread = digits_experiment(tmp_path / "spread", steps=STEPS, placement="STRICT_SPREAD")
    started = time.monotonic()
    job = cluster.govray("run", str(spread))
    assert job.returncode == 0, job.stdout + job.stderr
    spread_seconds = time.monotonic() - started

    reference, multinode = finished_run(single), finished_run(spread)
    assert reference.worker_nodes == {0: head.node_id, 1: head.node_id}
    assert set(multinode.worker_nodes) == {0, 1}
    assert len(set(multinode.worker_nodes.values())) == 2, multinode.worker_nodes
    assert set(multinode.worker_nodes.values()) == {node.node_id for node in nodes}
    for run in (reference, multinode):
        assert run.trial.state == "completed"
        assert run.final_checkpoint.name and (run.final_checkpoint / "model.safetensors").exists()
    for name in MODEL_FILES:
        assert (reference.final_checkpoint / name).read_bytes() == (
            multinode.final_checkpoint / name
        ).read_bytes(), name
    losses = [
        [(m.step, m.value) for m in run.store.metrics(run.trial.id, "training_loss")]  # type: ignore[arg-type]
        for run in (reference, multinode)
    ]
    assert losses[0] == losses[1] and [step for step, _ in losses[0]] == [5, 10]
    print(f"single node {single_seconds:.1f} s, two nodes {spread_seconds:.1f} s")
