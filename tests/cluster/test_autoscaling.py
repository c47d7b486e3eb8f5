"""A governed job that needs more workers than the cluster has makes the autoscaler add nodes, and
finishes. Ray's fake multi-node provider starts the nodes on this machine, from a config written
here and a head started with `ray start --head --autoscaling-config=FILE`
(`ray.cluster_utils.AutoscalingCluster` cannot be used: the wheel lacks its example.yaml, and its
`start()` runs `ray stop --force`, which would kill every Ray on the machine).
`python -m pytest -m cluster tests/cluster/test_autoscaling.py`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.autoscaler._private.util import validate_config

from tests.helpers.governed_job import digits_experiment, finished_run
from tests.helpers.local_ray import LocalRayCluster, RayNodeView

pytestmark = pytest.mark.cluster

WORKER_TYPE = "ray.worker.cpu"
# The monitor polls every second (default 5 s); RAY_FAKE_CLUSTER unlocks the fake provider.
FAKE_CLUSTER_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}


def fake_multinode_config(gcs_address: str) -> dict[str, Any]:
    """A head without CPUs and up to two 1-CPU worker nodes, which the fake provider starts as
    Ray nodes on this machine joining ``gcs_address`` (its default is port 6379: someone else's)."""
    return {
        "cluster_name": "govray-fake",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,  # no node goes away between ingest and training
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": {"CPU": 1, "object_store_memory": 256 * 1024**2},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class NodeWatch:
    """Samples the cluster's live nodes every half second; remembers when each was first seen."""

    def __init__(self, cluster: LocalRayCluster) -> None:
        self.cluster = cluster
        self.first_seen: dict[str, tuple[float, RayNodeView]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> NodeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for node in self.cluster.alive_nodes():
                self.first_seen.setdefault(node.node_id, (time.monotonic(), node))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster()
    config = fake_multinode_config(cluster.address)
    validate_config(config)  # the monitor's own check (prepare_config would need example.yaml)
    path = tmp_path / "fake-multinode.yaml"
    path.write_text(yaml.safe_dump(config))
    try:
        cluster.start_head(num_cpus=0, autoscaling_config=path, env=FAKE_CLUSTER_ENV)
        yield cluster
    finally:
        cluster.stop()  # also the nodes the autoscaler started: they joined the head's temp dir
        assert cluster.leftover_processes() == []


def test_a_job_larger_than_the_cluster_gets_nodes_from_the_autoscaler_and_finishes(
    cluster: LocalRayCluster, tmp_path: Path
) -> None:
    (head,) = cluster.wait_for_nodes(1)
    assert head.resources.get("CPU", 0) == 0  # room for no worker at all
    experiment = digits_experiment(tmp_path / "job", steps=10)  # 2 workers x 1 CPU
    with NodeWatch(cluster) as watch:
        submitted = time.monotonic()
        job = cluster.govray("run", str(experiment))
        finished = time.monotonic()
    assert job.returncode == 0, job.stdout + job.stderr
    added = {node_id: (seen, node) for node_id, (seen, node) in watch.first_seen.items() if not node.is_head}
    assert len(added) == 2, watch.first_seen
    assert {node.node_type for _, node in added.values()} == {WORKER_TYPE}
    run = finished_run(experiment)
    assert run.trial.state == "completed"
    assert sorted(run.worker_nodes.values()) == sorted(added), (run.worker_nodes, added)  # one per node
    assert "completed 10 steps" in job.stdout
    latencies = sorted(seen - submitted for seen, _ in added.values())
    print(
        f"nodes added {', '.join(f'{s:.1f}' for s in latencies)} s after submission; "
        f"job finished after {finished - submitted:.1f} s"
    )
