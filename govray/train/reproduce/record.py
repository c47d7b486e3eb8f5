"""The reproducibility record: what a trial needs to be re-run months later, byte for byte.

It holds the seed, the resolved config and its digest, the snapshots of the trial's code and of
every corpus (:mod:`govray.train.reproduce.snapshots`), the software and hardware environment, and the
engine's settings that decide whether a replay is bit-exact; and the kernel modes
(deterministic algorithms, TensorFloat-32) a worker runs under.

>>> record = build_record(config, Path(config.storage_path), config_digest=d, threads=4)  # doctest: +SKIP
>>> record.replay_equivalence().exact                                                      # doctest: +SKIP
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy
import ray
import torch
from pydantic import BaseModel, ConfigDict, field_validator

from govray.config.experiment import ExperimentConfig
from govray.config.training import Precision, TrainingSettings
from govray.core.formats import REPRODUCIBILITY_FORMAT, known_format
from govray.train.reproduce.snapshots import CodeSnapshot, CorpusSnapshot, snapshot_corpus, store_trial_code

# What training.deterministic sets in every worker process. cuBLAS reads its workspace setting
# at its first call and NCCL its algorithm and protocol when a communicator is created, which Ray
# Train does (init_process_group) before the training function runs: so these reach the workers
# through their Ray runtime environment (deterministic_worker_env), at process start.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
# The variables that change thread counts or kernel choices, hence the bits of a result.
DETERMINISM_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED", *DETERMINISTIC_ENV)
# Replay of a run that is not bit-exact (GPU kernels without deterministic mode, NCCL's reduction
# order): the stated bound on |replayed - original| per weight, as torch.allclose(rtol, atol) reads it.
GPU_REPLAY_TOLERANCE = {
    Precision.FP32: (1e-3, 1e-4),
    Precision.BF16: (2e-2, 2e-3),
    Precision.FP16: (2e-2, 2e-3),
}

_RECORD = ConfigDict(extra="forbid", frozen=True)


# --- environment ------------------------------------------------------------------------------


class EnvironmentRecord(BaseModel):
    """The software and hardware a trial ran on."""

    model_config = _RECORD

    python: str
    platform: str
    machine: str
    cpu_count: int
    torch: str
    ray: str
    numpy: str
    torch_threads: int
    cuda: str | None  # the CUDA version torch was built with; None for a CPU build
    gpus: list[str]
    packages: dict[str, str]  # every installed distribution → version, by name
    env: dict[str, str]  # the DETERMINISM_VARIABLES that are set


def capture_environment() -> EnvironmentRecord:
    """Describe this process's interpreter, libraries, hardware and thread settings."""
    gpus = (
        [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    return EnvironmentRecord(
        python=platform.python_version(),
        platform=platform.platform(),
        machine=platform.machine(),
        cpu_count=os.cpu_count() or 1,
        torch=str(torch.__version__),
        ray=ray.__version__,
        numpy=numpy.__version__,
        torch_threads=torch.get_num_threads(),
        cuda=torch.version.cuda,
        gpus=gpus,
        packages=installed_packages(),
        env={name: os.environ[name] for name in DETERMINISM_VARIABLES if name in os.environ},
    )


def installed_packages() -> dict[str, str]:
    """Distribution name → version, sorted; where a name is installed twice, the one imported wins."""
    found: dict[str, str] = {}
    for distribution in importlib.metadata.distributions():  # in sys.path order
        name = distribution.metadata["Name"]
        if name:
            found.setdefault(name, distribution.version)
    return dict(sorted(found.items()))


# --- the record -------------------------------------------------------------------------------


class ReplayTolerance(BaseModel):
    """|replayed - original| <= atol + rtol * |original|, per weight (``torch.allclose``)."""

    model_config = _RECORD

    rtol: float
    atol: float


class ReplayEquivalence(BaseModel):
    """What an attestation promises about a replay: exact (bit-identical weights), or equal within
    ``tolerance``; ``basis`` says why."""

    model_config = _RECORD

    exact: bool
    tolerance: ReplayTolerance
    basis: str


class ReproducibilityRecord(BaseModel):
    """Everything needed to re-run a trial: stored in the tracking store and in each checkpoint."""

    model_config = _RECORD

    format: str = REPRODUCIBILITY_FORMAT
    seed: int
    config: dict[str, Any]  # the resolved experiment config (JSON form)
    config_digest: str
    code: CodeSnapshot
    environment: EnvironmentRecord
    corpora: list[CorpusSnapshot]
    threads: int  # torch intra-op threads per worker
    # The engine's settings that decide whether a replay is bit-exact.
    device: str  # "cpu", or "cuda": the workers trained on GPUs
    precision: Precision
    deterministic: bool  # training.deterministic: see use_deterministic_mode

    @field_validator("format")
    @classmethod
    def _known_format(cls, found: str) -> str:
        return known_format(found, REPRODUCIBILITY_FORMAT, "the reproducibility record")

    def replay_equivalence(self) -> ReplayEquivalence:
        """How closely a replay of this run (same world size, backend, threads, hardware class)
        reproduces its weights: bit for bit on CPU or in deterministic mode, else within the
        stated tolerance of the run's precision (ARCHITECTURE.md, "Scope of bit-exactness")."""
        if self.device == "cpu" or self.deterministic:
            basis = "CPU kernels and gloo" if self.device == "cpu" else "deterministic mode"
            return ReplayEquivalence(exact=True, tolerance=ReplayTolerance(rtol=0.0, atol=0.0), basis=basis)
        rtol, atol = GPU_REPLAY_TOLERANCE[self.precision]
        return ReplayEquivalence(
            exact=False,
            tolerance=ReplayTolerance(rtol=rtol, atol=atol),
            basis=f"{self.precision.value} on GPUs, not deterministic (NCCL and kernel reduction order)",
        )


def deterministic_worker_env(settings: TrainingSettings) -> dict[str, str]:
    """The environment variables every worker process starts with for ``settings`` (set before
    its process group exists; none unless deterministic)."""
    return dict(DETERMINISTIC_ENV) if settings.deterministic else {}


def use_deterministic_mode(settings: TrainingSettings | None, device: torch.device | None = None) -> None:
    """In a worker, before its model is built: torch's deterministic algorithms on (an operation
    without one raises) with cuBLAS's fixed workspace when ``settings.deterministic``, else off
    (a worker in the driver's process must not inherit a previous run's mode). Such a worker
    (local mode) gets the variables here; NCCL's only matter to a process group, which it lacks.

    Deterministic mode does not fill new tensors with NaN (torch's ``fill_uninitialized_memory``,
    which it turns on: a memset on every ``torch.empty``, and govray reads no uninitialized
    memory) and keeps TensorFloat-32 off; otherwise ``settings.tf32`` decides, by default on for
    a run on a GPU (``device``) and off on the CPU (``use_tf32``)."""
    deterministic = settings is not None and settings.deterministic
    if deterministic:
        for name, value in DETERMINISTIC_ENV.items():
            os.environ.setdefault(name, value)  # a worker's runtime environment set them already
    _set_deterministic_algorithms(deterministic)
    # (torch's settings below are module attributes its stubs do not declare)
    torch.utils.deterministic.fill_uninitialized_memory = not deterministic  # type: ignore[attr-defined]
    tf32 = settings.tf32 if settings is not None else None
    use_tf32(
        not deterministic and (tf32 if tf32 is not None else (device is not None and device.type == "cuda"))
    )


def use_tf32(on: bool) -> None:
    """TensorFloat-32 for float32 matmuls (cuBLAS) and convolutions (cuDNN), or IEEE float32.
    (torch's per-backend precision settings; CPU kernels are not affected.)"""
    precision = "tf32" if on else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision  # type: ignore[attr-defined]
    torch.backends.cudnn.rnn.fp32_precision = precision  # type: ignore[attr-defined]


def build_record(
    config: ExperimentConfig,
    storage: Path,
    *,
    config_digest: str,
    threads: int,
    code: CodeSnapshot | None = None,
) -> ReproducibilityRecord:
    """Snapshot the trial's code into ``STORAGE/code/<digest>/`` (unless it runs the recorded
    ``code`` of another trial: a replay) and every corpus, and capture the environment."""
    if code is None:
        code = store_trial_code(config.trial, storage)
    return ReproducibilityRecord(
        seed=config.seed,
        config=config.model_dump(mode="json"),
        config_digest=config_digest,
        code=code,
        environment=capture_environment(),
        corpora=[snapshot_corpus(spec, storage) for spec in config.data.corpora],
        threads=threads,
        device="cuda" if config.resources.use_gpu else "cpu",
        precision=config.training.precision,
        deterministic=config.training.deterministic,
    )


def _set_deterministic_algorithms(deterministic: bool) -> None:
    """``torch.use_deterministic_algorithms(deterministic)`` without importing Inductor when
    nothing has: torch's function imports ``torch._inductor.config`` (and with it Dynamo, seconds
    of a fresh trial process) to set its ``deterministic`` flag. govray compiles nothing; a later
    Inductor import reads the flag from ``TORCHINDUCTOR_DETERMINISTIC``, set here to match."""
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(deterministic)
        return
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if deterministic else "0"
    torch._C._set_deterministic_algorithms(deterministic, warn_only=False)
