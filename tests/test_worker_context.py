"""A worker's context: what it may ask sealed (its own run's checkpoints, by the platform's signer
over the channel its launch opened; it holds no key), storage that is never absent (a local twin
and an object-store twin behind one interface), and the worker-side code that opens storage or
builds the parallelism twin in one place only."""

from __future__ import annotations

import ast
import json
import shutil
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from threading import Thread

import pyarrow.fs as pafs
import pytest

from govray.config.training import TrainingSettings
from govray.core.dsse import read_envelope, verify_envelope
from govray.core.errors import ConfigError, SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig
from govray.core.storage import IN_PLACE, LocalStorage, ObjectStorage, StorageError, open_storage
from govray.signer.server import SignerServer
from govray.signer.service import Signer
from govray.train.checkpoints.manifest import MANIFEST_TYPE, Manifest
from govray.train.checkpoints.signer import ChannelSigner, KeySigner, NoSigner, SignerChannel, SignerClient
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


@pytest.fixture
def platform(tmp_path: Path) -> Iterator[tuple[Path, TrustConfig]]:
    """The platform's signer on a socket (served in a thread here; the socket's path is short);
    yields the socket and the trust its seals verify under."""
    key = SigningKey.generate(KeyRole.PLATFORM)
    short = Path(tempfile.mkdtemp(prefix="gw-", dir="/tmp"))
    server = SignerServer(Signer(key, tmp_path / "signer-state", check_ledgers=False), short / "s.sock")
    Thread(target=server.serve_forever, daemon=True).start()
    yield server.path, TrustConfig(keys=[key.public_key])
    server.shutdown()
    server.server_close()
    shutil.rmtree(short, ignore_errors=True)


def _channel(socket_path: Path, run_dir: Path) -> SignerChannel:
    capability, _ = SignerClient(socket_path).open_run(str(run_dir))  # what the run's launch does
    return SignerChannel(socket=str(socket_path), capability=capability, run_dir=str(run_dir))


def _folder(run_dir: Path, step: int) -> Path:
    folder = run_dir / f"checkpoint_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": step}))
    return folder


def test_a_worker_has_its_own_runs_checkpoints_sealed_holding_no_key(
    tmp_path: Path, platform: tuple[Path, TrustConfig]
) -> None:
    socket_path, trust = platform
    run_dir = tmp_path / "runs" / "run-1"
    signer = ChannelSigner(_channel(socket_path, run_dir))
    signer.reach()
    folder = _folder(run_dir, 3)
    sealed = signer.seal(folder, 3, {})
    path = tmp_path / "manifest.sig"
    path.write_text(sealed.envelope.to_json())
    verified, keyid = verify_envelope(
        read_envelope(path), trust, KeyRole.PLATFORM, expected_type=MANIFEST_TYPE, what="manifest"
    )
    manifest = Manifest.model_validate_json(verified)
    assert verified == sealed.manifest and keyid == trust.keys[0].keyid and signer.signs
    assert manifest.run == "run-1" and manifest.step == 3 and set(manifest.files) == {"state.json"}
    assert "capability" not in repr(signer.channel) and signer.channel.capability not in str(signer.channel)


@pytest.mark.parametrize(
    "folder",
    [
        "runs/run-2/checkpoint_00000003",  # another run's checkpoint
        "runs/run-1/checkpoint_00000003/inner",  # below a checkpoint of its own
        "runs/run-1/base",  # its own run directory, not a checkpoint folder
        "elsewhere/checkpoint_00000003",
    ],
)
def test_a_worker_cannot_have_another_folder_sealed(
    tmp_path: Path, platform: tuple[Path, TrustConfig], folder: str
) -> None:
    """What trial code in the worker's process would try: point its channel at a checkpoint of
    another run (to launder its weights) or at any folder but its own run's checkpoints; refused
    by its channel, and by the signer when asked over the socket directly."""
    socket_path, _ = platform
    channel = _channel(socket_path, tmp_path / "runs" / "run-1")
    target = tmp_path / folder
    target.mkdir(parents=True)
    (target / "state.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(SignatureError, match="seals its own run's checkpoints only"):
        ChannelSigner(channel).seal(target, 3, {})
    with pytest.raises(SignatureError, match="the signer refused: .*not"):
        SignerClient(socket_path).seal(channel.capability, str(target), 3)


def test_a_worker_outside_any_run_seals_nothing_and_no_other_role_seals_checkpoints(tmp_path: Path) -> None:
    unsigned = NoSigner()
    assert not unsigned.signs
    with pytest.raises(SignatureError, match="no channel to the platform's signer"):
        unsigned.seal(tmp_path / "checkpoint_00000001", 1, {})
    authority = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
    with pytest.raises(SignatureError, match="policy-authority key; checkpoints need the platform key"):
        KeySigner(authority)


def test_a_run_whose_signer_is_not_there_stops_before_its_first_step(
    golden_run: GoldenRun, tmp_path: Path
) -> None:
    """``WorkerContext.open`` reaches the signer on the rank that seals: a run whose signer is
    gone stops before its first step, not at its first checkpoint."""
    spec = run_spec(golden_run).model_copy(
        update={"run_dir": str(tmp_path / "run"), "log_dir": "", "control_file": ""}
    )
    gone = SignerChannel(socket=str(tmp_path / "gone.sock"), capability="x", run_dir=str(tmp_path / "run"))
    reports: list[StepReport] = []
    with pytest.raises(SignatureError, match="no signer at .*gone.sock"):
        train_worker(
            Attempt.of(spec, signer=gone).model_dump(mode="json"),
            session=partial(LocalSession, deliver=reports.append),
        )
    assert reports == [] and not (tmp_path / "run").exists()


def test_a_channel_opened_for_another_directory_than_the_workers_is_refused(
    golden_run: GoldenRun, tmp_path: Path, platform: tuple[Path, TrustConfig]
) -> None:
    spec = run_spec(golden_run).model_copy(
        update={"run_dir": str(tmp_path / "run"), "log_dir": "", "control_file": ""}
    )
    elsewhere = _channel(platform[0], tmp_path / "another-run")
    with pytest.raises(SignatureError, match="opened the signer for .*another-run"):
        train_worker(
            Attempt.of(spec, signer=elsewhere).model_dump(mode="json"),
            session=partial(LocalSession, deliver=lambda _: None),
        )


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


def test_the_worker_opens_its_storage_builds_its_twin_in_one_place_and_loads_no_key() -> None:
    """Below the worker context nothing opens the storage, builds a parallelism twin or tests for
    absent storage again (what ``WorkerContext`` exists to end), and nothing a worker runs loads a
    signing key: its checkpoints are sealed by the platform's signer."""
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
        found += [
            f"{relative}:{line} {name}"
            for name in ("load", "platform_key")
            for line in _calls(path, name)
            if name != "load" or "SigningKey.load" in source.splitlines()[line - 1]
        ]
        for number, line in enumerate(source.splitlines(), 1):
            if "storage is None" in line or "storage is not None" in line or "is_remote" in line:
                found.append(f"{relative}:{number} {line.strip()}")
    assert found == []
