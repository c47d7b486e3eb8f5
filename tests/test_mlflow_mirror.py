"""The MLflow mirror (``tracking.mlflow``): a real ``mlflow server`` (SQLite backend) finds, through
MLflow's own client, each governed trial as a run with the same metrics at the same steps, and
each registered version with its attestation digests as tags; with the server down the run still
completes, and the mirror catches up once it is back."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from govray.cli import main
from govray.platform.registry.versions import envelope_sha256, resolve, version_attestations
from govray.provenance.statement_types import COVERAGE_TYPE, PROVENANCE_TYPE, statement_type
from govray.train.checkpoints.files import find_checkpoints
from jobs.examples.digits.golden import GOLDEN_HPARAMS
from jobs.examples.digits.golden import golden_example as golden_example_at
from tests.helpers.golden import GoldenRun, golden_run_at
from tests.helpers.mlflow_server import mlflow_server
from tests.helpers.ports import free_port

PREFIX = "mirror-test/"


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def mirrored_run(root: Path, uri: str) -> GoldenRun:
    """A short governed run (one in-process worker, 20 steps, a checkpoint every 10) mirrored to ``uri``."""
    path = golden_example_at(
        root,
        workers=1,
        max_length={"batches": 20},
        hparams={**GOLDEN_HPARAMS, "lr": 0.01},
        lr_schedule=False,
        name=f"mirrored-{root.name}",
        tracking={"mlflow": {"uri": uri, "experiment_prefix": PREFIX}},
    )
    return golden_run_at(path)


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def run_while_down(ray_session: None, tmp_path_factory: pytest.TempPathFactory, port: int) -> Any:
    """A run whose MLflow server is not there (nothing listens on ``port``), and its warnings."""
    caught = Warnings()
    logger = logging.getLogger("govray.platform.mlflow_mirror")
    logger.addHandler(caught)
    try:
        run = mirrored_run(tmp_path_factory.mktemp("down"), f"http://127.0.0.1:{port}")
    finally:
        logger.removeHandler(caught)
    return run, caught.messages


@pytest.fixture(scope="module")
def server(run_while_down: Any, tmp_path_factory: pytest.TempPathFactory, port: int) -> Iterator[str]:
    """The server, started (after the run that found it down) and stopped by this module."""
    with mlflow_server(tmp_path_factory.mktemp("mlflow"), port) as uri:
        yield uri


def mlflow_run(client: MlflowClient, golden: GoldenRun) -> Any:
    experiment = client.get_experiment_by_name(f"{PREFIX}{golden.config.name}")
    assert experiment is not None
    trial = golden.outcome.trial_id
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`govray.trial_id` = '{trial}'")
    assert len(runs) == 1
    return runs[0]


def assert_same_metrics(client: MlflowClient, golden: GoldenRun) -> None:
    """Every metric govray stored for the trial, at the same steps with the same values."""
    run = mlflow_run(client, golden)
    stored = golden.store.metrics(golden.outcome.trial_id)
    names = {m.name for m in stored}
    assert names and names == set(run.data.metrics)
    for name in names:
        ours = sorted((m.step, m.value) for m in stored if m.name == name)
        theirs = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert theirs == ours, name
    assert run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.01" and run.data.params["seed"] == str(golden.config.seed)
    assert run.data.params["trial_seed"] == str(golden.store.get_trial(golden.outcome.trial_id).seed)


def test_with_mlflow_down_the_run_completes_and_warns(run_while_down: Any) -> None:
    golden, warnings = run_while_down
    assert golden.outcome.state == "completed" and golden.outcome.steps_done == 20
    assert golden.store.metrics(golden.outcome.trial_id)  # govray's own store lost nothing
    assert any("MLflow mirror at" in message and "catches up" in message for message in warnings)
    assert len(warnings) <= 2  # one per outage (the background thread's, the run end's), not per sync


def test_the_mirror_catches_up_once_mlflow_is_back(run_while_down: Any, server: str) -> None:
    golden, _ = run_while_down
    experiment = golden.store.get_trial(golden.outcome.trial_id).experiment_id
    assert main(["experiment", "mlflow-sync", str(experiment), "--database", golden.store.url]) == 0
    assert_same_metrics(MlflowClient(server), golden)


def test_a_run_and_its_registration_are_mirrored_while_mlflow_is_up(
    server: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    golden = mirrored_run(tmp_path_factory.mktemp("up"), server)
    client = MlflowClient(server)
    assert_same_metrics(client, golden)  # mirrored by the run itself, no sync asked for
    final = find_checkpoints(golden.outcome.run_dir)[-1]
    name = f"mirrored-{golden.outcome.trial_id}"
    assert main(["model", "register", name, str(final), "--database", golden.store.url]) == 0
    version = resolve(golden.store, f"{name}:1")
    records = version_attestations(golden.store, version)
    digests = {statement_type(r.envelope_json): envelope_sha256(r) for r in records}
    [mirrored] = client.search_model_versions(f"name = '{name}'")
    assert mirrored.tags["govray.version"] == "1"
    assert mirrored.run_id == mlflow_run(client, golden).info.run_id
    assert mirrored.tags["govray.provenance_envelope_sha256"] == digests[PROVENANCE_TYPE]
    assert mirrored.tags["govray.coverage_envelope_sha256"] == digests[COVERAGE_TYPE]
    folder = f"govray-models/{name}/1"
    listed = {Path(a.path).name for a in client.list_artifacts(mirrored.run_id, folder)}
    assert {"coverage-matrix.json", "policy.yaml", "provenance.dsse.json", "coverage.dsse.json"} <= listed
