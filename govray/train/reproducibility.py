"""The reproducibility record: what a trial needs to be re-run months later, byte for byte.

It holds the seed, the resolved config and its digest, a snapshot of the trial's code (stored
with the experiment, like Determined's model definition), the software and hardware environment,
and a content-addressed snapshot of every corpus. Under the experiment's storage::

    code/<code digest>/jobs/examples/digits/trial.py      the trial's package, importable as recorded
    corpora/<fingerprint>/public.parquet                  a corpus, in the layout its fingerprint uses

A corpus too large to copy is recorded by its immutable URI and fingerprint instead;
:func:`verify_corpus_snapshot` tells whether the bytes there are still the recorded ones.

>>> record = build_record(config, Path(config.storage_path), config_digest=d, threads=4)  # doctest: +SKIP
>>> for corpus in record.corpora: verify_corpus_snapshot(corpus)                           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import os
import platform
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy
import ray
import torch
from pydantic import BaseModel, ConfigDict

from govray.config.data import CorpusSpec
from govray.config.experiment import ExperimentConfig
from govray.config.training import Precision, TrainingSettings
from govray.core.canonical import canonical_json, file_sha256, sha256_hex
from govray.core.errors import ConfigError, GovrayError, IngestError
from govray.core.storage import Storage
from govray.data.fingerprint import corpus_files, directory_digest, fingerprint_files
from govray.train.trial import Trial, import_code_from, load_trial_class

DEFAULT_MAX_COPY_BYTES = 2 * 1024**3
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


class ReproducibilityError(GovrayError):
    """A trial's code or a corpus cannot be snapshotted, or a snapshot no longer matches its bytes."""

    exit_code = 12


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


# --- trial code -------------------------------------------------------------------------------


class CodeSnapshot(BaseModel):
    """The trial's source files, by path relative to the import root, with their sha256."""

    model_config = _RECORD

    module: str  # the trial's module, importable from the snapshot directory
    files: dict[str, str]  # relative POSIX path → sha256
    digest: str  # see code_digest


def code_digest(files: dict[str, str]) -> str:
    """sha256 of the canonical JSON of {relative path: file sha256} (sorted by path)."""
    return sha256_hex(canonical_json(dict(sorted(files.items()))))


def snapshot_trial_code(trial_path: str, destination: Path) -> CodeSnapshot:
    """Copy the code of trial ``"package.module:Class"`` into ``destination`` and digest it.

    The trial's module file is copied and, when it lives in a package, every ``.py`` file of that
    package's directory (not its subdirectories) and the ``__init__.py`` of each enclosing
    package, all at their import paths, so ``destination`` on ``sys.path`` imports the trial as
    recorded. A module without a Python source file (compiled, built in) is refused.
    """
    load_trial_class(trial_path)  # imports it exactly as a run would, and checks it is a Trial
    module_name = trial_path.partition(":")[0]
    sources = _module_sources(trial_path, module_name)
    destination.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    for relative, source in sources:
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        files[relative] = file_sha256(target)
    files = dict(sorted(files.items()))
    return CodeSnapshot(module=module_name, files=files, digest=code_digest(files))


def _module_sources(trial_path: str, module_name: str) -> list[tuple[str, Path]]:
    """(path relative to the import root, source file) of the files a code snapshot holds."""
    module = sys.modules[module_name]
    try:
        found = inspect.getsourcefile(module)
    except TypeError:  # built-in modules
        found = None
    if found is None or not found.endswith(".py"):
        raise ReproducibilityError(
            f"trial '{trial_path}': module '{module_name}' has no Python source file to snapshot"
        )
    source = Path(found).resolve()
    package = module.__package__ or ""
    if not package:
        return [(source.name, source)]
    package_dir = source.parent
    depth = package.count(".")  # enclosing packages above the trial's own
    root = package_dir.parents[depth]
    files = [file for file in package_dir.glob("*.py") if file.is_file()]
    enclosing = (package_dir.parents[level] / "__init__.py" for level in range(depth))
    files += [init for init in enclosing if init.is_file()]
    return sorted((file.relative_to(root).as_posix(), file) for file in files)


def verify_code(directory: Path, snapshot: CodeSnapshot) -> None:
    """Raise ReproducibilityError, naming the file, unless ``directory`` holds exactly the bytes
    ``snapshot`` recorded."""
    where = f"code snapshot {snapshot.digest[:16]}… ({directory})"
    if code_digest(snapshot.files) != snapshot.digest:
        raise ReproducibilityError(f"{where}: the recorded file digests do not add up to its digest")
    for relative, digest in snapshot.files.items():
        path = directory / relative
        if not path.is_file():
            raise ReproducibilityError(f"{where}: {relative} is missing")
        found = file_sha256(path)
        if found != digest:
            raise ReproducibilityError(
                f"{where}: {path} changed since it was recorded (sha256 {digest[:16]}…, now "
                f"{found[:16]}…): refusing to run other code than the recorded trial's"
            )


def use_recorded_code(snapshot: CodeSnapshot, directory: Path, storage: Storage | None = None) -> Path:
    """Import the trial from its recorded code snapshot at ``directory`` (``STORAGE/code/DIGEST``,
    fetched from object ``storage`` when this node lacks it), verified first; returns it.

    What a replay or a resume runs is then the recorded code, in the driver and in every worker,
    whatever the working directory and whatever changed in the project since.
    """
    if storage is not None:
        storage.fetch(directory, verify=lambda staged: verify_code(staged, snapshot))
    if not directory.is_dir():
        raise ReproducibilityError(f"code snapshot {snapshot.digest[:16]}…: {directory} is missing")
    verify_code(directory, snapshot)
    import_code_from(directory, snapshot.files)
    return directory


def _code_matches(directory: Path, snapshot: CodeSnapshot) -> bool:
    try:
        verify_code(directory, snapshot)
    except ReproducibilityError:
        return False
    return True


# --- corpora ----------------------------------------------------------------------------------


class CorpusSnapshot(BaseModel):
    """Where a corpus's exact bytes can be found again, and the fingerprint they must have."""

    model_config = _RECORD

    corpus_id: str
    fingerprint: str
    format: str  # selects a directory corpus's files, as the fingerprint does
    uri: str  # file:// URI of the snapshot (copied) or of the original corpus (too large to copy)
    copied: bool
    bytes: int


def snapshot_corpus(
    spec: CorpusSpec, storage: Path, *, max_copy_bytes: int = DEFAULT_MAX_COPY_BYTES
) -> CorpusSnapshot:
    """Keep the corpus's bytes under ``STORAGE/corpora/<fingerprint>/`` (copied once).

    The files keep the relative layout the fingerprint uses, so the snapshot has the same
    fingerprint as the original. An existing snapshot is reused when its bytes still match;
    a new one is written to a temporary directory and renamed into place. A corpus larger than
    ``max_copy_bytes`` is not copied: its original location is recorded with its fingerprint.
    """
    format_name = spec.resolved_format.value
    files = corpus_files(spec.path, format_name, corpus_id=spec.id)
    fingerprint = fingerprint_files(files)
    size = sum(file.stat().st_size for _, file in files)

    def record(location: Path, copied: bool) -> CorpusSnapshot:
        return CorpusSnapshot(
            corpus_id=spec.id,
            fingerprint=fingerprint,
            format=format_name,
            uri=location.resolve().as_uri(),
            copied=copied,
            bytes=size,
        )

    if size > max_copy_bytes:
        return record(spec.path, copied=False)

    def location_in(directory: Path) -> Path:  # a single-file corpus stays a file
        return directory / spec.path.name if spec.path.is_file() else directory

    def holds_corpus(directory: Path) -> bool:
        try:
            return _fingerprint_at(location_in(directory), format_name, spec.id) == fingerprint
        except IngestError:
            return False

    final = storage / "corpora" / fingerprint
    if not holds_corpus(final):
        with _staging(final.parent) as staging:
            for relative, file in files:
                (staging / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(file, staging / relative)
            if not holds_corpus(staging):
                raise ReproducibilityError(
                    f"corpus '{spec.id}': {spec.path} changed while it was being copied"
                )
            _publish(staging, final, holds_corpus)
    return record(location_in(final), copied=True)


def verify_corpus_snapshot(snapshot: CorpusSnapshot) -> None:
    """Raise ReproducibilityError, naming the corpus, unless the bytes at its URI still match."""
    where = f"corpus '{snapshot.corpus_id}'"
    parsed = urlparse(snapshot.uri)
    if parsed.scheme != "file":
        raise ReproducibilityError(f"{where}: cannot read {snapshot.uri} (only file:// URIs are supported)")
    try:
        found = _fingerprint_at(Path(url2pathname(parsed.path)), snapshot.format, snapshot.corpus_id)
    except IngestError as error:
        raise ReproducibilityError(
            f"{where}: the recorded bytes at {snapshot.uri} are gone: {error}"
        ) from None
    if found != snapshot.fingerprint:
        raise ReproducibilityError(
            f"{where}: the bytes at {snapshot.uri} changed since they were recorded "
            f"(fingerprint {snapshot.fingerprint}, now {found})"
        )


def _fingerprint_at(path: Path, format_name: str, corpus_id: str) -> str:
    return fingerprint_files(corpus_files(path, format_name, corpus_id=corpus_id))


# --- other directories a trial reads -----------------------------------------------------------


def input_digests(trial: Trial) -> dict[str, str]:
    """The digest of each directory ``trial`` reads besides its rows (``Trial.input_directories``,
    e.g. its tokenizer's), by the hyperparameter naming it: what a run records of them."""
    digests = {}
    for name, directory in sorted(trial.input_directories().items()):
        if not directory.is_dir():
            raise ConfigError(f"hyperparameter '{name}': {directory} is not a directory")
        digests[name] = directory_digest(directory)
    return digests


def verify_input_digests(recorded: Mapping[str, str] | None, trial: Trial, *, run: str) -> None:
    """Raise ReproducibilityError, naming the directory and both digests, unless every directory
    ``trial`` reads besides its rows still holds the files ``run`` recorded (``recorded``: its
    ``RunSpec.input_digests``; None, a run recorded before them: nothing to compare)."""
    if recorded is None:
        return
    directories = trial.input_directories()
    for name in sorted(set(recorded) | set(directories)):
        directory = directories.get(name)
        before = recorded.get(name, "none recorded")
        now = directory_digest(directory) if directory is not None and directory.is_dir() else "gone"
        if now != before:
            where = directory if directory is not None else "(the trial names none now)"
            raise ReproducibilityError(
                f"{run} read the {name} directory {where} with digest {before}; it now has "
                f"{now}: refusing to run on other files than the recorded run's"
            )


# --- content-addressed directories ------------------------------------------------------------


@contextlib.contextmanager
def _staging(parent: Path) -> Iterator[Path]:
    """A fresh hidden directory beside the final one (so the rename stays on one file system),
    removed on exit unless it was published."""
    staging = parent / f".staging-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, final: Path, is_intact: Callable[[Path], bool]) -> None:
    """Rename ``staging`` to ``final`` unless an intact ``final`` exists (a damaged one is replaced)."""
    if final.exists():
        if is_intact(final):
            return
        shutil.rmtree(final)
    try:
        staging.rename(final)
    except OSError:
        if not (final.exists() and is_intact(final)):  # else a concurrent writer got there first
            raise


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

    seed: int
    config: dict[str, Any]  # the resolved experiment config (JSON form)
    config_digest: str
    code: CodeSnapshot
    environment: EnvironmentRecord
    corpora: list[CorpusSnapshot]
    threads: int  # torch intra-op threads per worker
    # The engine's settings that decide whether a replay is bit-exact (defaults: a record written
    # before they were recorded, when every run was fp32 on CPU).
    device: str = "cpu"  # "cuda": the workers trained on GPUs
    precision: Precision = Precision.FP32
    deterministic: bool = False  # training.deterministic: see use_deterministic_mode

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
    torch.use_deterministic_algorithms(deterministic)
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
        code_root = storage / "code"
        with _staging(code_root) as staging:
            code = snapshot_trial_code(config.trial, staging)
            recorded = code
            _publish(staging, code_root / code.digest, lambda directory: _code_matches(directory, recorded))
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
