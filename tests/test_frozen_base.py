"""The frozen base by reference: a LoRA-only run (every rule of its policy routes to an adapter, so
no base tensor trains) writes its base once, into the run's base store, and every checkpoint's
signed manifest refers to that file by its sha256 instead of rewriting it. Loading verifies the
referenced file and refuses a changed or missing one, naming it; resuming from a referencing
checkpoint is bit-identical to the uninterrupted run; GC keeps a base file while a checkpoint
refers to it; the registry, remove-adapter, the PEFT export and attestations (checked with
securesystemslib) follow the reference.

One in-process run of the digits trial (one worker, 30 steps, a checkpoint every 10, on the
stored run's shards: no Ray) serves every test here."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from securesystemslib.dsse import Envelope as SslibEnvelope
from securesystemslib.signer import SSlibKey

from govray.config.experiment import load_experiment
from govray.core.canonical import file_sha256
from govray.core.dsse import signing_time
from govray.core.keys import TrustConfig, platform_key, platform_trust
from govray.core.storage import open_storage
from govray.governance.adapter_files import save_base
from govray.governance.policy import DepthPolicy
from govray.platform.gc import remove_checkpoint_directory
from govray.platform.registry.peft_export import export_peft_adapter
from govray.platform.registry.register import register, remove_adapter
from govray.provenance.verify import verify_attestation
from govray.signer.attesting import attest
from govray.tracking.lineage import record_checkpoint
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.base_file import FrozenBase
from govray.train.checkpoints.files import (
    BASE_STORE,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_TENSORS,
    CheckpointError,
    Manifest,
    checkpoint_step,
    find_checkpoints,
    load_checkpoint,
    model_file,
)
from govray.train.reproduce.record import build_record
from govray.train.run.loop import train_worker
from govray.train.run.reports import StepReport
from govray.train.run.session import LocalSession
from govray.train.runspec import RUN_SPEC_FILE, Attempt, RunSpec
from govray.train.trial import make_trial, resolve_trial_routes
from jobs.examples.digits.golden import golden_example
from tests.helpers.builders import governed_step
from tests.helpers.engine import run_spec
from tests.helpers.golden import GoldenRun
from tests.helpers.signing import channel_for

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = ("licensed-lora", "pii-lora", "public-lora")
LORA_ONLY = {  # the digits policy with every rule routed to an adapter: no base tensor trains
    "name": "digits-lora-only",
    "version": 1,
    "adapters": {
        "public-lora": {"kind": "lora", "targets": ["embed", "hidden", "head"], "rank": 4, "alpha": 8},
        "licensed-lora": {"kind": "lora", "targets": ["hidden", "head"], "rank": 4, "alpha": 8},
        "pii-lora": {"kind": "lora", "targets": ["hidden"], "rank": 4, "alpha": 8},
    },
    "rules": [
        {
            "name": "public",
            "match": {"license_class": ["public-domain", "permissive"]},
            "route": {"adapter": "public-lora"},
        },
        {
            "name": "licensed",
            "match": {"license_class": "licensed", "sensitivity": ["public", "internal", "confidential"]},
            "route": {"adapter": "licensed-lora"},
        },
        {
            "name": "pii",
            "match": {"sensitivity": ["pii", "special-category"]},
            "route": {"adapter": "pii-lora"},
        },
    ],
}


@dataclass(frozen=True)
class LoraOnlyRun:
    store: TrackingStore  # where the run's checkpoints are recorded (what the registry needs)
    run_dir: Path  # STORAGE/ray/RUN
    trust: TrustConfig  # the platform's, for checkpoints

    @property
    def checkpoints(self) -> list[Path]:
        return find_checkpoints(self.run_dir)


@pytest.fixture(scope="module")
def lora_only(tmp_path_factory: pytest.TempPathFactory, golden_local_epoch: GoldenRun) -> LoraOnlyRun:
    """The one-worker golden run's spec and shards under the LoRA-only policy, 30 steps
    in-process, signed by this machine's platform key; its checkpoints recorded in a tracking store
    of its own."""
    root = tmp_path_factory.mktemp("lora-only")
    stored = run_spec(golden_local_epoch)
    policy = DepthPolicy.model_validate(LORA_ONLY)
    routing = resolve_trial_routes(policy, make_trial(stored.trial, stored.hparams, stored.settings))
    key = platform_key()
    run_dir = root / "storage" / "ray" / "lora-only"
    # What an attestation states about the run's code, environment and corpora: the digits example's.
    config = load_experiment(golden_example(root / "example", workers=1, max_length={"batches": 30}))
    record = build_record(
        config, root / "storage", config_digest=stored.config_digest, threads=stored.threads
    )
    spec = stored.model_copy(
        update={
            "policy": policy,
            "routing": routing,
            "max_steps": 30,
            "run_dir": str(run_dir),
            "run_name": "lora-only",
            "code_dir": str(REPO),
            "reproducibility": record.model_dump(mode="json"),
        }
    )
    train_worker(
        Attempt.of(spec, signer=channel_for(spec)).model_dump(mode="json"),
        session=partial(LocalSession, deliver=lambda _: None),
    )
    store = TrackingStore.open(f"sqlite:///{root / 'govray.db'}")
    experiment = store.create_experiment("lora-only", "{}", spec.config_digest, str(root / "storage"))
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, json.dumps(spec.hparams), seed=spec.trial_seed)
    assert trial.id is not None
    for folder in find_checkpoints(run_dir):
        record_checkpoint(store, trial.id, str(folder), checkpoint_step(folder))
    return LoraOnlyRun(store, run_dir, platform_trust(key))


def manifest(directory: Path) -> Manifest:
    return Manifest.model_validate_json((directory / MANIFEST_FILE).read_bytes())


def copied_run(run: LoraOnlyRun, tmp_path: Path) -> Path:
    """The run directory copied (its checkpoints and base store), for tests that change it: under
    the run's own name (a checkpoint's signed manifest names its run; a resume takes only those)."""
    copy = tmp_path / run.run_dir.name
    shutil.copytree(run.run_dir, copy)
    return copy


def test_a_lora_only_runs_checkpoints_refer_to_one_base_file_written_once(lora_only: LoraOnlyRun) -> None:
    folders = lora_only.checkpoints
    assert [checkpoint_step(folder) for folder in folders] == [10, 20, 30]
    digests = set()
    for folder in folders:
        assert not (folder / MODEL_FILE).exists(), folder  # no copy of the base in the folder
        listed = manifest(folder)
        assert listed.referenced == [MODEL_FILE]
        digests.add(listed.files[MODEL_FILE])
        assert sorted(load_checkpoint(folder, lora_only.trust).state.adapters) == list(ADAPTERS)
    (digest,) = digests  # every checkpoint refers to the same base
    store = lora_only.run_dir / BASE_STORE
    (base,) = store.iterdir()  # and the run wrote exactly one base file
    assert base.name == f"{digest}.safetensors" and file_sha256(base) == digest
    assert model_file(folders[-1]) == base
    # Written for the first checkpoint and never again (a rewrite would be a newer file).
    assert base.stat().st_mtime_ns <= (folders[0] / MANIFEST_FILE).stat().st_mtime_ns


def test_later_checkpoints_write_no_base_bytes(
    lora_only: LoraOnlyRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FrozenBase writes once per run; the same file (inode) serves every later checkpoint, and a
    folder outside the run directory (a Tune trial's) or a base that trains gets its own copy."""
    import govray.train.checkpoints.base_file as base_file
    from govray.train.parallel.worker import Worker

    spec = RunSpec.model_validate_json((lora_only.checkpoints[0] / RUN_SPEC_FILE).read_text())
    model = governed_step(spec, Worker.detect()).model
    written: list[Path] = []

    def counted(model: Any, path: Path) -> str:
        written.append(path)
        return save_base(model, path)

    monkeypatch.setattr(base_file, "save_base", counted)
    frozen = FrozenBase(str(tmp_path))
    first = frozen.save(model, tmp_path / "checkpoint_00000010")
    inode = model_file_of(tmp_path, first).stat().st_ino
    for step in (20, 30):
        assert frozen.save(model, tmp_path / f"checkpoint_{step:08d}") == first
    assert model_file_of(tmp_path, first).stat().st_ino == inode
    assert len(written) == 1  # the base was written once, for the first checkpoint
    elsewhere = tmp_path / "tune" / "checkpoint_00000040"
    elsewhere.mkdir(parents=True)
    assert frozen.save(model, elsewhere) == {} and (elsewhere / MODEL_FILE).is_file()
    next(model.base.parameters()).requires_grad_(True)  # a base that trains: a file per checkpoint
    (tmp_path / "checkpoint_00000050").mkdir()
    assert frozen.save(model, tmp_path / "checkpoint_00000050") == {}
    assert (tmp_path / "checkpoint_00000050" / MODEL_FILE).is_file()


def model_file_of(run_dir: Path, referenced: dict[str, str]) -> Path:
    return run_dir / BASE_STORE / f"{referenced[MODEL_FILE]}.safetensors"


def test_a_changed_or_missing_base_file_is_refused_naming_it(lora_only: LoraOnlyRun, tmp_path: Path) -> None:
    run_dir = copied_run(lora_only, tmp_path)
    folder = find_checkpoints(run_dir)[-1]
    base = model_file(folder)
    data = bytearray(base.read_bytes())
    data[-1] ^= 0xFF
    base.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{base}: sha256 does not match the signed manifest"):
        load_checkpoint(folder, lora_only.trust)
    base.unlink()
    with pytest.raises(CheckpointError, match=f"{base}: listed in the signed manifest but missing"):
        load_checkpoint(folder, lora_only.trust)


def test_a_reference_to_anything_but_the_base_by_its_sha256_is_no_manifest() -> None:
    with pytest.raises(ValueError, match="only model.safetensors"):
        Manifest(
            run="r",
            step=1,
            files={MODEL_FILE: "../../etc/passwd"},
            referenced=[MODEL_FILE],
            signed_at=signing_time(),
        )
    with pytest.raises(ValueError, match="only model.safetensors"):
        Manifest(
            run="r",
            step=1,
            files={"state.json": "0" * 64},
            referenced=["state.json"],
            signed_at=signing_time(),
        )


def test_resuming_from_a_referencing_checkpoint_is_bit_identical_to_the_uninterrupted_run(
    lora_only: LoraOnlyRun, tmp_path: Path
) -> None:
    run_dir = copied_run(lora_only, tmp_path)
    for folder in find_checkpoints(run_dir):
        if checkpoint_step(folder) > 10:
            shutil.rmtree(folder)
    (base,) = (run_dir / BASE_STORE).iterdir()
    inode = base.stat().st_ino
    resumed_from = (run_dir / "checkpoint_00000010" / MANIFEST_FILE).read_bytes()
    spec = RunSpec.model_validate_json((find_checkpoints(run_dir)[-1] / RUN_SPEC_FILE).read_text())
    spec = spec.model_copy(update={"run_dir": str(run_dir), "log_dir": "", "control_file": ""})
    reports: list[StepReport] = []
    train_worker(
        Attempt.of(spec, signer=channel_for(spec)).model_dump(mode="json"),
        session=partial(LocalSession, deliver=reports.append),
    )
    assert [report.step for report in reports] == [20, 30]
    assert (run_dir / "checkpoint_00000010" / MANIFEST_FILE).read_bytes() == resumed_from  # not rewritten
    resumed, uninterrupted = find_checkpoints(run_dir)[-1], lora_only.checkpoints[-1]
    assert checkpoint_step(resumed) == checkpoint_step(uninterrupted) == 30
    for name in [OPTIMIZER_TENSORS, *(f"adapter-{adapter}.safetensors" for adapter in ADAPTERS)]:
        assert (resumed / name).read_bytes() == (uninterrupted / name).read_bytes(), name
    assert model_file(resumed).read_bytes() == model_file(uninterrupted).read_bytes()
    assert manifest(resumed).files[MODEL_FILE] == manifest(uninterrupted).files[MODEL_FILE]
    assert [path.name for path in (run_dir / BASE_STORE).iterdir()] == [base.name]
    assert base.stat().st_ino == inode  # the resumed run referred to the base file, never rewrote it


def test_gc_keeps_a_base_file_while_a_checkpoint_refers_to_it(lora_only: LoraOnlyRun, tmp_path: Path) -> None:
    run_dir = copied_run(lora_only, tmp_path)
    storage = open_storage(tmp_path)
    first, second, last = find_checkpoints(run_dir)
    (base,) = (run_dir / BASE_STORE).iterdir()
    for folder in (first, second):
        remove_checkpoint_directory(storage, str(folder))
    assert not first.exists() and base.is_file()  # the last checkpoint still refers to it
    load_checkpoint(last, lora_only.trust)
    remove_checkpoint_directory(storage, str(last))
    assert not base.exists()  # no checkpoint left refers to it


def test_registry_remove_adapter_export_and_attestations_follow_the_reference(
    lora_only: LoraOnlyRun, tmp_path: Path
) -> None:
    middle, final = lora_only.checkpoints[1], lora_only.checkpoints[-1]
    digest = manifest(final).files[MODEL_FILE]
    # An attestation of a referencing checkpoint names the base by the referenced file's digest,
    # and verifies against the folder (the reference followed) and with securesystemslib.
    written = attest(middle, destination=tmp_path / "attested" / "middle")
    assert written.subjects[MODEL_FILE] == digest and not (middle / MODEL_FILE).exists()
    key = platform_key()
    sslib_key = SSlibKey.from_dict(key.keyid, key.public_key.sslib_dict())
    for path in (written.provenance, written.coverage):
        assert key.keyid in SslibEnvelope.from_dict(json.loads(path.read_text())).verify([sslib_key], 1)
        verify_attestation(path, model_dir=middle, trust=lora_only.trust)
    # The PEFT export reads the adapter of a referencing checkpoint.
    out = export_peft_adapter(middle, "pii-lora", tmp_path / "peft", lora_only.trust)
    assert (out / "adapter_model.safetensors").is_file()
    # A registered version stands alone: the base file linked into its folder (no bytes copied).
    version = register(lora_only.store, "lora-only", final, description="LoRA only")
    assert (final / MODEL_FILE).stat().st_ino == model_file_of(
        lora_only.run_dir, {MODEL_FILE: digest}
    ).stat().st_ino
    assert load_checkpoint(final, lora_only.trust).state.step == 30
    derived = remove_adapter(lora_only.store, version.ref, "pii-lora")
    assert file_sha256(derived.directory / MODEL_FILE) == digest
    assert not (derived.directory / "adapter-pii-lora.safetensors").exists()
    assert sorted(load_checkpoint(derived.directory, lora_only.trust).state.adapters) == [
        "licensed-lora",
        "public-lora",
    ]
