"""Deterministic mode (``training.deterministic: true``): every worker trains with torch's
deterministic algorithms and a fixed cuBLAS workspace, and starts with NCCL's algorithm and
protocol fixed (in its Ray runtime environment: NCCL reads them when the process group is made,
before any training code runs); the run's record says so; the attestation states what a replay
promises — bit-identical on CPU or in deterministic mode, within a stated tolerance otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from govray.config.experiment import ExperimentConfig
from govray.config.training import Precision
from govray.core.storage import open_storage
from govray.platform.run.plan import plan_run
from govray.platform.run.runner import governed_trainer, run_trial
from govray.signer.attesting import attest
from govray.train.checkpoints.files import find_checkpoints
from govray.train.reproduce.record import (
    DETERMINISTIC_ENV,
    GPU_REPLAY_TOLERANCE,
    ReproducibilityRecord,
    build_record,
    deterministic_worker_env,
)
from govray.train.runspec import Attempt, RunSpec
from jobs.examples.digits.golden import GOLDEN_HPARAMS, golden_example, opened
from tests.helpers.attest import statement_of
from tests.helpers.probe_trial import builds

STEPS = 4


def final_checkpoint(run_dir: Path) -> Path:
    return find_checkpoints(run_dir)[-1]


def deterministic_example(root: Path, probes: Path) -> Path:
    """The digits example on 2 workers, deterministic mode on, its trial recording how it was built."""
    return golden_example(
        root,
        workers=2,
        max_length={"batches": STEPS},
        hparams={**GOLDEN_HPARAMS, "probe_dir": str(probes)},
        lr_schedule=False,
        trial="tests.helpers.probe_trial:ProbedDigitsTrial",
        training={"deterministic": True},
    )


@pytest.fixture(scope="module")
def deterministic_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """Two Ray Train workers, deterministic mode on, with a trial that records how it was built."""
    root = tmp_path_factory.mktemp("deterministic")
    probes = root / "builds"
    probes.mkdir()
    config, store, checked, experiment, ingested = opened(deterministic_example(root, probes))
    outcome = run_trial(config, checked, experiment, ingested.root, store)
    return outcome, probes, root / "experiment.yaml"


@pytest.fixture(scope="module")
def deterministic_plan(
    ray_session: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ExperimentConfig, RunSpec]:
    """The same run ingested (Ray Data) and planned as the driver plans it, with the driver's
    reproducibility record, and not trained: the spec its workers would get, which is all the
    tests below read."""
    root = tmp_path_factory.mktemp("deterministic-plan")
    probes = root / "builds"
    probes.mkdir()
    config, _, checked, _, ingested = opened(deterministic_example(root, probes))
    plan = plan_run(config, checked, ingested.root)
    record = build_record(
        config, plan.storage.root, config_digest=plan.spec.config_digest, threads=plan.spec.threads
    )
    return config, plan.named("deterministic-plan", record.model_dump(mode="json"))


@pytest.mark.cluster  # a 2-worker run of its own (~40 s): the second tier
def test_workers_train_with_deterministic_algorithms_and_start_with_the_fixed_nccl_and_cublas_settings(
    deterministic_run: tuple[Any, Path, Path],
) -> None:
    _, probes, _ = deterministic_run
    recorded = builds(probes)
    workers = [build for build in recorded if build["device"] != "meta"]
    assert len({build["pid"] for build in workers}) == 2  # one real model per worker process
    for build in workers:
        assert build["pid"] != os.getpid()
        assert build["deterministic_algorithms"] is True
        assert build["env"] == DETERMINISTIC_ENV
    # The driver built the model only on the meta device (routing), and stays as it was.
    assert recorded and all(b["pid"] == os.getpid() for b in recorded if b["device"] == "meta")
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.cluster  # a 2-worker run of its own (~40 s): the second tier
def test_the_record_and_the_attestation_say_deterministic_mode_was_on_and_replay_is_exact(
    deterministic_run: tuple[Any, Path, Path], tmp_path: Path
) -> None:
    outcome, _, _ = deterministic_run
    checkpoint = final_checkpoint(outcome.run_dir)
    spec = RunSpec.model_validate_json((checkpoint / "run.json").read_text())
    record = ReproducibilityRecord.model_validate(spec.reproducibility)
    assert record.deterministic and record.device == "cpu"
    written = attest(checkpoint, destination=tmp_path / "attested")
    internal = statement_of(written.provenance)["predicate"]["buildDefinition"]["internalParameters"]
    assert internal["reproducibility"]["deterministic"] is True
    assert internal["replay_equivalence"]["exact"] is True
    assert internal["replay_equivalence"]["tolerance"] == {"rtol": 0.0, "atol": 0.0}


def test_the_variables_go_into_the_workers_runtime_environment_only_in_deterministic_mode(
    deterministic_plan: tuple[ExperimentConfig, RunSpec],
) -> None:
    config, spec = deterministic_plan
    trainer = governed_trainer(config, Attempt.of(spec), open_storage(config.storage_path))
    assert trainer.run_config.worker_runtime_env == {"env_vars": DETERMINISTIC_ENV}
    assert spec.settings is not None
    assert deterministic_worker_env(spec.settings.model_copy(update={"deterministic": False})) == {}


@pytest.mark.parametrize(
    ("device", "precision", "deterministic", "exact"),
    [
        ("cpu", Precision.FP32, False, True),
        ("cpu", Precision.BF16, False, True),
        ("cuda", Precision.BF16, True, True),
        ("cuda", Precision.BF16, False, False),
        ("cuda", Precision.FP32, False, False),
    ],
)
def test_replay_is_promised_exact_on_cpu_or_in_deterministic_mode_else_within_a_stated_tolerance(
    deterministic_plan: tuple[ExperimentConfig, RunSpec],
    device: str,
    precision: Precision,
    deterministic: bool,
    exact: bool,
) -> None:
    _, spec = deterministic_plan
    record = ReproducibilityRecord.model_validate(spec.reproducibility).model_copy(
        update={"device": device, "precision": precision, "deterministic": deterministic}
    )
    promise = record.replay_equivalence()
    assert promise.exact is exact
    tolerance = (promise.tolerance.rtol, promise.tolerance.atol)
    assert tolerance == ((0.0, 0.0) if exact else GPU_REPLAY_TOLERANCE[precision])
