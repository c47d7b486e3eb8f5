"""A spot node reclaimed with notice loses no step: its worker group seals a checkpoint at the
step boundary after the notice, records a ``preempted`` decision, trains nothing more, and Ray
Train's restart on the nodes left resumes from that checkpoint; the run completes with an exact
ledger. Head + 2 local Ray nodes, one drained for preemption and killed at its deadline:
`python -m pytest -m cluster tests/cluster/test_preemption.py`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from govray.data.schedule import ScheduleSpec
from govray.data.shard_reader import ShardReader
from govray.data.shards import ShardSet
from govray.provenance.locations import run_spec_of
from govray.train.checkpoints.files import STATE_FILE, checkpoint_step
from govray.train.parallel.worker import RouteRows
from govray.train.step.ledger import Ledger, recompute_ledger
from govray.train.trial import make_trial
from tests.helpers.governed_job import finished_run
from tests.helpers.local_ray import LocalRayCluster
from tests.helpers.spot_drain import run_reclaimed

pytestmark = pytest.mark.cluster

STEPS, PERIOD, DEADLINE_S = 80, 50, 15


@pytest.fixture
def cluster() -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster()
    try:
        yield cluster
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == []


def test_a_node_reclaimed_with_notice_costs_no_step_and_the_run_completes_with_an_exact_ledger(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    reclaimed = run_reclaimed(cluster, tmp_path, steps=STEPS, period=PERIOD, deadline_s=DEADLINE_S)
    assert reclaimed.returncode == 0, reclaimed.output
    run = finished_run(reclaimed.experiment)
    assert run.trial.id is not None and run.trial.state == "completed"

    # The decision, recorded by the driver: the boundary sealed, the node and its ranks, the deadline.
    (preempted,) = [d for d in run.store.decisions(run.trial.id) if d.kind == "preempted"]
    assert json.loads(preempted.payload_json) == {
        "deadline_ms": reclaimed.deadline_ms,
        "nodes": {reclaimed.node: reclaimed.ranks},
    }
    sealed = preempted.step
    assert sealed % 5 == 0 and sealed < PERIOD, (
        "sealed at a control-period boundary, before any periodic checkpoint"
    )
    checkpoints = {
        checkpoint_step(folder): folder for folder in run.final_checkpoint.parent.glob("checkpoint_*")
    }
    assert sealed in checkpoints

    # Zero steps lost: the first group trained up to the sealed step and no further; the restart
    # resumed there.
    assert reclaimed.first_group_last_step == sealed, reclaimed.log
    assert reclaimed.resumed_from == sealed
    assert reclaimed.steps_lost == 0
    assert "training no further step" in reclaimed.log and "training on" not in reclaimed.log
    assert reclaimed.node not in run.worker_nodes.values()  # the restarted group runs on the nodes left

    # The ledger counts each scheduled step once.
    state = json.loads((run.final_checkpoint / STATE_FILE).read_text())
    assert state["step"] == STEPS and state["preemptions"] == [
        {"seq": preempted.seq, "step": sealed, "kind": "preempted", **json.loads(preempted.payload_json)}
    ]
    spec = run_spec_of(run.final_checkpoint)
    tokens = RouteRows(ShardReader(ShardSet.open(Path(spec.shard_root)))).tokens(
        make_trial(spec.trial, spec.hparams, spec.settings)
    )
    expected = recompute_ledger(ScheduleSpec.from_json(state["schedule"]), spec.routing, STEPS, tokens)
    assert Ledger.from_json(state["ledger"]) == expected
    print(
        f"sealed at step {sealed}; resumed {reclaimed.restart_seconds:.1f} s later; "
        f"driver {reclaimed.seconds:.1f} s"
    )
