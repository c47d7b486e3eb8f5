"""A checkpoint's manifest and state, read without torch: ``state.json``'s schema, the manifest's,
the signed manifest, and the state checked against the digest the tracking store recorded.

What reads a checkpoint's record without its tensors (``govray lineage row``, attestations of
recorded checkpoints) imports this module, not :mod:`govray.train.checkpoints.files` (which writes and
loads tensors, and imports torch); that module re-exports every name here.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from govray.core.canonical import file_sha256
from govray.core.dsse import read_envelope, verify_envelope
from govray.core.errors import GovrayError, SignatureError, describe_validation_error
from govray.core.formats import known_format
from govray.core.keys import KeyRole, TrustConfig
from govray.train.checkpoints.blocks import BlockDigests

CHECKPOINT_FORMAT = "govray-checkpoint-v1"
REPORT_FILE = "report.json"
CHECKPOINT_PREFIX = "checkpoint_"  # Ray Train's checkpoint folders, and local mode's
MANIFEST_TYPE = "application/vnd.govray.checkpoint-manifest+json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
BASE_STORE = "base"  # RUN_DIR/base/SHA256.safetensors: the frozen base a run's checkpoints refer to
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(GovrayError):
    """A checkpoint is missing, unsigned, tampered with, or does not fit the run."""

    exit_code = 10


class TrainedUnder(BaseModel):
    """From step ``from_step`` on, run ``run`` trained the state under ``hparams``: an entry of a
    checkpoint's ``hparams_history``. A PBT exploit continues a donor's state under the clone's
    own hyperparameters, so a clone's history holds its donor's entries, then its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    from_step: int = Field(ge=0)
    run: str
    hparams: dict[str, Any]


class CheckpointState(BaseModel):
    """``state.json``: everything besides tensors that a resume or replay needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = CHECKPOINT_FORMAT
    step: int = Field(ge=0)  # global steps completed
    epoch: int = Field(ge=0)
    seed: int
    trial_seed: int
    schedule: dict[str, Any]  # ScheduleSpec.to_json(): every input of the schedule
    schedule_digest: str
    policy_digest: str
    config_digest: str
    ledger: dict[str, Any]  # Ledger.to_json()
    adapters: list[str] = Field(default_factory=list)
    reproducibility: dict[str, Any] = Field(default_factory=dict)
    plateau: dict[str, Any] = Field(default_factory=dict)  # PlateauState: LR decisions so far
    early_stopping: dict[str, Any] = Field(default_factory=dict)  # EarlyStopState
    gates: list[dict[str, Any]] = Field(default_factory=list)  # GateDecisions: schedule events
    rollbacks: list[dict[str, Any]] = Field(default_factory=list)  # RollbackDecisions: schedule events
    clean_step: int | None = None  # the step of the last clean state (a rollback's target)
    preemptions: list[dict[str, Any]] = Field(default_factory=list)  # PreemptedDecisions: no effect
    # FSDP: {"world_size": N}; the model and optimizer are in per-rank shard files. Empty: whole.
    sharding: dict[str, Any] = Field(default_factory=dict)
    loss_scaling: dict[str, Any] = Field(default_factory=dict)  # fp16: LossScalingState
    clean_ledgers: dict[str, dict[str, Any]] = Field(default_factory=dict)  # step → ledger of clean-STEP-*
    memorization: dict[str, Any] = Field(default_factory=dict)  # the last MemorizationReport
    source: dict[str, Any] = Field(default_factory=dict)  # the checkpoint a forked run started from
    run: str = ""  # the Ray run that wrote it (a PBT clone restores its donor's)
    # [from_step, workers]: from step 0, and each time the world size changed (resumed on another).
    world_history: list[tuple[int, int]] = Field(min_length=1)
    # Who trained the state under which hyperparameters, from which step (``continued_lineage``).
    hparams_history: list[TrainedUnder] = Field(min_length=1)

    @field_validator("format")
    @classmethod
    def _known_format(cls, found: str) -> str:
        return known_format(found, CHECKPOINT_FORMAT, "state.json")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = CHECKPOINT_FORMAT
    # Whose state this is: the name of the run directory the checkpoint was sealed in (the signer
    # writes it, from the run its capability opened). A resume takes only its own run's.
    run: str = Field(min_length=1)
    step: int
    files: dict[str, str]  # file name → sha256
    signed_at: dt.datetime
    # files (of ``files``) kept in the run's base store by their sha256, not in the folder
    referenced: list[str] | None = None
    # The block digests of each tensor file a rank may read by byte ranges (``train.ranged``),
    # computed by the sealer in the same pass as the file's sha256.
    blocks: dict[str, BlockDigests] | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, found: str) -> str:
        return known_format(found, CHECKPOINT_FORMAT, "manifest.json")

    @model_validator(mode="after")
    def _blocks_of_listed_files(self) -> Manifest:
        for name in self.blocks or {}:
            if name not in self.files or name in (self.referenced or ()):
                raise ValueError(f"block digests of {name!r}, which the checkpoint does not hold")
        return self

    @model_validator(mode="after")
    def _only_the_base_by_digest(self) -> Manifest:
        for name in self.referenced or ():
            if name != MODEL_FILE or not _SHA256.match(self.files.get(name, "")):
                raise ValueError(f"only {MODEL_FILE}, listed by its sha256, may be referenced (not {name!r})")
        return self

    def to_bytes(self) -> bytes:
        document = self.model_dump(mode="json", exclude_none=True)
        return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def signed_manifest(directory: Path, trust: TrustConfig) -> tuple[Manifest, str]:
    """A checkpoint's manifest, checked against its signature (a trusted, unrevoked platform key;
    the payload byte for byte), without reading the files it lists; returns (manifest, signer)."""
    if not (directory / MANIFEST_FILE).is_file():
        raise CheckpointError(f"{directory}: not a govray checkpoint ({MANIFEST_FILE} missing)")
    signature = directory / SIGNATURE_FILE
    if not signature.is_file():
        raise CheckpointError(f"{signature}: missing; an unsigned checkpoint is refused")
    try:
        payload, signer = verify_envelope(
            read_envelope(signature),
            trust,
            KeyRole.PLATFORM,
            expected_type=MANIFEST_TYPE,
            what=f"checkpoint signature {signature}",
        )
    except SignatureError as error:
        raise CheckpointError(str(error)) from None
    if payload != (directory / MANIFEST_FILE).read_bytes():
        raise CheckpointError(f"{directory / MANIFEST_FILE} differs from the manifest its signature covers")
    try:
        manifest = Manifest.model_validate_json(payload)
    except ValidationError as error:
        raise CheckpointError(f"{directory / MANIFEST_FILE}: {describe_validation_error(error)}") from None
    return manifest, signer


def recorded_state(
    directory: Path, manifest_digest: str, trust: TrustConfig | None = None
) -> CheckpointState:
    """A checkpoint's state, checked against the manifest digest the tracking store recorded for
    it: the store vouches for the manifest, the manifest for ``state.json``; with ``trust`` the
    manifest's signature is checked too (still without reading the weight files). Raises
    ``CheckpointError`` when either changed since the checkpoint was recorded."""
    content = recorded_file(directory, STATE_FILE, manifest_digest, trust)
    try:
        return CheckpointState.model_validate_json(content)
    except ValidationError as error:
        raise CheckpointError(f"{directory}: unreadable: {describe_validation_error(error)}") from None


def recorded_file(
    directory: Path, name: str, manifest_digest: str, trust: TrustConfig | None = None
) -> bytes:
    """File ``name`` of a recorded checkpoint, read once, checked against the manifest whose
    sha256 the tracking store recorded when it was sealed (with ``trust``, its signature too)."""
    return listed_bytes(directory, recorded_manifest(directory, manifest_digest, trust), name)


def recorded_manifest(directory: Path, manifest_digest: str, trust: TrustConfig | None = None) -> Manifest:
    """A recorded checkpoint's manifest, refused unless its sha256 is the one the tracking store
    recorded when it was sealed (with ``trust``, unless its signature verifies too)."""
    try:
        refuse_unrecorded_manifest(directory, manifest_digest)
        if trust is not None:
            return signed_manifest(directory, trust)[0]
        return Manifest.model_validate_json((directory / MANIFEST_FILE).read_bytes())
    except ValidationError as error:
        raise CheckpointError(f"{directory}: unreadable: {describe_validation_error(error)}") from None


def listed_bytes(directory: Path, manifest: Manifest, name: str) -> bytes:
    """File ``name`` of a checkpoint whose (verified) manifest is ``manifest``, read once and
    refused unless its sha256 is the one the manifest lists."""
    path = directory / name
    try:
        content = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: {name} is missing") from None
    if name not in manifest.files or hashlib.sha256(content).hexdigest() != manifest.files[name]:
        raise CheckpointError(f"{path}: sha256 does not match its manifest (tampered)")
    return content


def refuse_unrecorded_manifest(directory: Path, manifest_digest: str) -> None:
    """``CheckpointError`` unless the checkpoint's ``manifest.json`` is the one whose sha256 the
    tracking store recorded when it was sealed (a manifest re-signed or put in its place since:
    refused, even when the signature on it verifies)."""
    try:
        found = file_sha256(directory / MANIFEST_FILE)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: {MANIFEST_FILE} is missing") from None
    if found != manifest_digest:
        raise CheckpointError(
            f"{directory}: its manifest (sha256 {found}) is not the one the tracking store recorded when "
            f"it was sealed ({manifest_digest}): changed since"
        )


def continued_history(history: list[tuple[int, int]], step: int, world: int) -> list[tuple[int, int]]:
    """A world-size history ((from step, workers), ...) continued on ``world`` workers from
    ``step``: an entry that began at ``step`` or later trained nothing and gives way (a run resumed
    on another world size from its step-0 checkpoint trained every step on the second world), and
    a world the same as the one before it continues that one."""
    kept = [(start, workers) for start, workers in history if start < step]
    if not kept or kept[-1][1] != world:
        kept.append((step, world))
    return kept


def continued_lineage(history: list[TrainedUnder], step: int, entry: TrainedUnder) -> list[TrainedUnder]:
    """A state's ``hparams_history`` continued by ``entry`` from ``step``: entries that began at
    ``step`` or later trained nothing of it and give way, and ``entry`` is added unless the run
    and hyperparameters before it are its own (a resume continues its own entry)."""
    kept = [earlier for earlier in history if earlier.from_step < step]
    if not kept or (kept[-1].run, kept[-1].hparams) != (entry.run, entry.hparams):
        kept.append(entry.model_copy(update={"from_step": step}))
    return kept
