"""Governance counters exported with ``ray.util.metrics`` appear on the node's Prometheus metrics
endpoint (what the Ray dashboard's metrics view reads): examples per corpus and route, the masked
fraction, the memorization score. `python -m pytest -m cluster tests/cluster/test_metrics.py`."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from govray.tracking.lineage import ledger_rows
from tests.helpers.builders import REPO
from tests.helpers.governed_job import digits_experiment, finished_run
from tests.helpers.local_ray import LocalRayCluster
from tests.helpers.ports import free_port

pytestmark = pytest.mark.cluster

SAMPLE = re.compile(r"^(ray_govray_\w+?)(?:_total)?\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')
# Workers push their metrics to the node's agent every 10 s by default: too slow for a short run.
FAST_METRICS = {"RAY_metrics_report_interval_ms": "200"}


@pytest.fixture
def cluster() -> Iterator[tuple[LocalRayCluster, int]]:
    cluster, port = LocalRayCluster(), free_port()
    try:
        cluster.start_head(num_cpus=2, metrics_export_port=port, env=FAST_METRICS)
        cluster.wait_for_nodes(1)
        yield cluster, port
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == []


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """The govray samples on the endpoint: (name, labels, value); [] while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return []
    return [(name, dict(LABEL.findall(labels)), float(value)) for name, labels, value in SAMPLE.findall(text)]


def test_governance_counters_appear_on_the_prometheus_endpoint(
    cluster: tuple[LocalRayCluster, int], tmp_path: Path
) -> None:
    ray_cluster, port = cluster
    experiment = digits_experiment(tmp_path / "job", steps=30)
    log = tmp_path / "driver.log"
    with open(log, "w") as output:
        driver = subprocess.Popen(
            [sys.executable, "-m", "govray", "run", str(experiment)],
            cwd=REPO,
            env=ray_cluster.environment(RAY_ADDRESS=ray_cluster.address),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    # Scraped while it trains and for 5 s after (the agent serves the last values it was sent).
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    deadline, ended_at = time.monotonic() + 600, None
    while time.monotonic() < deadline and (ended_at is None or time.monotonic() < ended_at + 5):
        for name, labels, value in scrape(port):
            seen[(name, tuple(sorted(labels.items())))] = value
        if ended_at is None and driver.poll() is not None:
            ended_at = time.monotonic()
        time.sleep(0.5)
    assert driver.wait(timeout=60) == 0, log.read_text()
    run = finished_run(experiment)
    names = {name for name, _ in seen}
    assert {"ray_govray_examples", "ray_govray_masked_fraction", "ray_govray_memorization_score"} <= names, (
        seen
    )

    examples: dict[str, float] = defaultdict(float)
    routes: dict[str, set[str]] = defaultdict(set)
    for (name, labels), value in seen.items():
        tags = dict(labels)
        assert tags["experiment"] == "digits-governed" and tags["trial"] == run.trial.ray_run_name, tags
        if name == "ray_govray_examples":
            examples[tags["corpus"]] += value
            routes[tags["corpus"]].add(tags["route"])
        elif name == "ray_govray_masked_fraction":
            assert 0.0 <= value < 1.0
    # The PII corpus is routed to the adapter, the others to the base model.
    assert routes == {"digits-public": {"public"}, "digits-licensed": {"licensed"}, "digits-writers": {"pii"}}
    # No step re-ran: the counter never exceeds what the ledger records as trained (the last pushes
    # before the workers exited may be missing).
    assert run.trial.id is not None
    trained: dict[str, int] = defaultdict(int)
    for row in ledger_rows(run.store, run.trial.id):
        trained[row.corpus_id] = max(trained[row.corpus_id], row.examples)
    for corpus, count in examples.items():
        assert 0 < count <= trained[corpus], (corpus, count, trained)
