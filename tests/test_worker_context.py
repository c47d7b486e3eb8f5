"""A worker's context: what it may ask signed (its own run's checkpoint manifests, nothing else),
storage that is never absent (a local twin and an object-store twin behind one interface), and the
worker-side code that opens storage, builds the parallelism twin or loads a key in one place only."""

from __future__ import annotations

import ast
import json
from functools import partial
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from govray.config.training import TrainingSettings
from govray.core.dsse import read_envelope, signing_time, verify_envelope
from govray.core.errors import ConfigError, SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig
from govray.core.storage import IN_PLACE, LocalStorage, ObjectStorage, StorageError, open_storage
from govray.train.checkpoints.manifest import MANIFEST_TYPE, Manifest
from govray.train.checkpoints.signer import KeySigner, RunSigner
from govray.train.context import WorkerContext
from govray.train.parallel.strategies import Single
from govray.train.parallel.worker import Worker
from govray.train.run.loop import train_worker
from govray.train.run.reports import StepReport
from govray.train.run.session import LocalSession
from govray.train.runspec import Attempt, RunSpec
from tests.helpers.engine import run_spec
from tests.helpers.golden import GoldenRun

REPO = Path(__file__).resolve().parents[1]


def _manifest() -> bytes:
    return Manifest(run="run", step=3, files={"state.json": "0" * 64}, signed_at=signing_time()).to_bytes()


@pytest.fixture
def platform(tmp_path: Path) -> tuple[Path, TrustConfig]:
    key = SigningKey.generate(KeyRole.PLATFORM)
    private, _ = key.save(tmp_path / "keys" / "platform")
    return private, TrustConfig(keys=[key.public_key])


def test_a_worker_signs_its_own_runs_checkpoint_manifests(
    tmp_path: Path, platform: tuple[Path, TrustConfig]
) -> None:
    private, trust = platform
    run_dir = tmp_path / "runs" / "run-1"
    signer = RunSigner(private, run_dir)
    payload = _manifest()
    envelope = signer.sign_manifest(run_dir / "checkpoint_00000003", payload, signing_time())
    path = tmp_path / "manifest.sig"
    path.write_text(envelope.to_json())
    verified, keyid = verify_envelope(
        read_envelope(path), trust, KeyRole.PLATFORM, expected_type=MANIFEST_TYPE, what="manifest"
    )
    assert verified == payload and keyid == trust.keys[0].keyid and signer.signs


@pytest.mark.parametrize(
    "folder",
    [
        "runs/run-2/checkpoint_00000003",  # another run's checkpoint
        "runs/run-1/checkpoint_00000003/inner",  # below a checkpoint of its own
        "runs/run-1/base",  # its own run directory, not a checkpoint folder
        "elsewhere/checkpoint_00000003",
    ],
)
def test_a_worker_cannot_have_another_folder_signed(
    tmp_path: Path, platform: tuple[Path, TrustConfig], folder: str
) -> None:
    """What trial code in the worker's process would try: point the signer at a checkpoint of
    another run (to launder its weights) or at any folder but its own run's checkpoints."""
    signer = RunSigner(platform[0], tmp_path / "runs" / "run-1")
    with pytest.raises(SignatureError, match="signs its own run's checkpoints only"):
        signer.sign_manifest(tmp_path / folder, _manifest(), signing_time())


@pytest.mark.parametrize(
    "payload",
    [
        json.dumps({"_type": "https://in-toto.io/Statement/v1", "subject": []}).encode(),  # an attestation
        b"name: digits\nversion: 9\n",  # a policy
        json.dumps({"step": 3, "files": {}, "extra": "field"}).encode(),  # not a manifest either
    ],
)
def test_a_worker_cannot_have_anything_but_a_manifest_signed(
    tmp_path: Path, platform: tuple[Path, TrustConfig], payload: bytes
) -> None:
    run_dir = tmp_path / "runs" / "run-1"
    signer = RunSigner(platform[0], run_dir)
    with pytest.raises(SignatureError, match="no checkpoint manifest"):
        signer.sign_manifest(run_dir / "checkpoint_00000003", payload, signing_time())


def test_a_run_without_the_platform_key_signs_nothing_and_no_other_role_signs_checkpoints(
    tmp_path: Path,
) -> None:
    unsigned = RunSigner(None, tmp_path)
    assert not unsigned.signs
    with pytest.raises(SignatureError, match="signs no checkpoint"):
        unsigned.sign_manifest(tmp_path / "checkpoint_00000001", _manifest(), signing_time())
    authority = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
    with pytest.raises(SignatureError, match="policy-authority key; checkpoints need the platform key"):
        KeySigner(authority)
    private, _ = authority.save(tmp_path / "authority")
    with pytest.raises(SignatureError, match="checkpoints need the platform key"):
        RunSigner(private, tmp_path).sign_manifest(
            tmp_path / "checkpoint_00000001", _manifest(), signing_time()
        )


def test_the_rank_that_seals_refuses_a_missing_key_when_it_starts(tmp_path: Path) -> None:
    """``WorkerContext.open`` loads the key on the rank that seals: a run whose key file is gone
    stops before its first step, not at its first checkpoint."""
    with pytest.raises(SignatureError, match="cannot read private key .*missing.key"):
        RunSigner(tmp_path / "missing.key", tmp_path).load()


def test_a_run_whose_platform_key_is_gone_stops_before_its_first_step(
    golden_run: GoldenRun, tmp_path: Path
) -> None:
    spec = run_spec(golden_run).model_copy(
        update={
            "platform_key": str(tmp_path / "gone.key"),
            "run_dir": str(tmp_path / "run"),
            "log_dir": "",
            "control_file": "",
        }
    )
    reports: list[StepReport] = []
    with pytest.raises(SignatureError, match="cannot read private key"):
        train_worker(
            Attempt.of(spec).model_dump(mode="json"), session=partial(LocalSession, deliver=reports.append)
        )
    assert reports == [] and not (tmp_path / "run").exists()


def test_storage_is_never_absent_and_the_local_twin_leaves_files_where_they_lie(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="no storage_path"):
        open_storage("")
    storage = open_storage(tmp_path)
    assert isinstance(storage, LocalStorage) and not storage.is_remote and storage.root == tmp_path
    file = tmp_path / "runs" / "a.json"
    file.parent.mkdir()
    file.write_text("{}")
    storage.upload(file)  # nothing to copy to
    assert storage.fetch(file, verify=lambda staged: pytest.fail("a local file is never staged"))
    assert not storage.fetch(tmp_path / "missing")
    assert storage.subdirectories(tmp_path, "ru") == ["runs"] and storage.list_files(tmp_path / "runs") == []
    assert storage.ray_path(file) == str(file) == storage.uri_of(file) and storage.cached(str(file)) == file
    storage.delete_directory(tmp_path / "runs")
    assert not file.exists() and IN_PLACE.fetch(tmp_path) and IN_PLACE.subdirectories(tmp_path, "") == []


def test_the_object_store_twin_copies_what_lies_below_its_cache_and_nothing_else(tmp_path: Path) -> None:
    """The object-store twin over a real pyarrow filesystem (a local directory standing in for the
    bucket; the cluster tier runs a real S3 server): uploads copy the cache's files, fetches stage
    and verify before a file appears, and a path outside the cache is this node's own: never sent,
    never fetched."""
    bucket, cache = tmp_path / "bucket", tmp_path / "cache"
    (bucket / "runs" / "checkpoint_00000001").mkdir(parents=True)  # (S3 needs no folders: a directory does)
    storage = ObjectStorage("s3://bucket", cache, pafs.LocalFileSystem(), str(bucket))
    folder = cache / "runs" / "checkpoint_00000001"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    outside = tmp_path / "scratch.txt"
    outside.write_text("mine")
    storage.upload(folder, outside)
    assert sorted(p.name for p in (bucket / "runs" / "checkpoint_00000001").iterdir()) == [
        "manifest.json",
        "model.safetensors",
    ]
    assert not (bucket / "scratch.txt").exists()
    other = ObjectStorage("s3://bucket", tmp_path / "other-node", pafs.LocalFileSystem(), str(bucket))
    refused = other.root / "runs" / "checkpoint_00000001"

    def refuse(staged: Path) -> None:
        raise StorageError(f"{staged.name}: refused")

    with pytest.raises(StorageError, match="refused"):
        other.fetch(refused, verify=refuse)
    assert not refused.exists()  # a refused download never appears
    assert (
        other.fetch(refused, verify=lambda staged: None)
        and (refused / "model.safetensors").read_bytes() == b"weights"
    )
    assert other.subdirectories(other.root / "runs", "checkpoint_") == ["checkpoint_00000001"]
    assert not other.fetch(tmp_path / "not-below-the-cache")


def test_the_context_builds_the_twin_once_and_refuses_what_cannot_run(tmp_path: Path) -> None:
    spec = RunSpec.model_construct(
        storage=str(tmp_path),
        strategy="fsdp",
        shard_group=None,
        run_dir=str(tmp_path / "run"),
        platform_key="",
    )
    spec = spec.model_copy(update={"settings": TrainingSettings()})
    with pytest.raises(ConfigError, match="needs workers >= 2"):
        WorkerContext.of(spec, Worker(0, 1))
    context = WorkerContext.of(spec.model_copy(update={"strategy": "ddp"}), Worker(0, 1))
    assert type(context.parallel) is Single and isinstance(context.storage, LocalStorage)
    assert not context.signer.signs and not context.writes and context.session is None
    with pytest.raises(RuntimeError, match="outside a session"):
        _ = context.opened


def _calls(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name)
    ]


def test_the_worker_opens_its_storage_builds_its_twin_and_loads_its_key_in_one_place() -> None:
    """Below the worker context nothing opens the storage, builds a parallelism twin, loads a
    signing key or tests for absent storage again (what ``WorkerContext`` exists to end)."""
    found = []
    for path in sorted(
        [*(REPO / "govray" / "train").rglob("*.py"), *(REPO / "govray" / "data").rglob("*.py")]
    ):
        relative = path.relative_to(REPO).as_posix()
        if relative == "govray/data/ingest.py":  # the driver's, before any worker exists
            continue
        source = path.read_text()
        if relative != "govray/train/context.py":
            found += [f"{relative}:{line} open_storage" for line in _calls(path, "open_storage")]
            found += [f"{relative}:{line} parallelism" for line in _calls(path, "parallelism")]
        if relative != "govray/train/checkpoints/signer.py":
            found += [
                f"{relative}:{line} SigningKey.load"
                for line in _calls(path, "load")
                if "SigningKey.load" in source.splitlines()[line - 1]
            ]
        for number, line in enumerate(source.splitlines(), 1):
            if "storage is None" in line or "storage is not None" in line or "is_remote" in line:
                found.append(f"{relative}:{number} {line.strip()}")
    assert found == []
