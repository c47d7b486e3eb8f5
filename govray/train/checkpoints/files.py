"""Governance-state checkpoints: weights, optimizer and governance state, signed.

A checkpoint is a directory::

    model.safetensors            the base model (its digest never depends on adapters)
    adapter-NAME.safetensors     one file per adapter
    optimizer.safetensors        optimizer tensors (``state.<param index>.<name>``)
    optimizer.json               the rest of the optimizer state and its param groups
    state.json                   step, epoch, schedule inputs, seeds, digests, ledger, recorded
                                 decisions, the checkpoint a forked run started from
    run.json                     the spec of the run that wrote it (trial, hyperparameters, policy,
                                 shards...): what an attestation of this checkpoint is built from
    report.json                  the report the checkpoint was reported with (step, losses,
                                 validation, decisions...): the tracking store recovers it from
                                 here when a worker died before Ray Train delivered the report
    clean-STEP-weights.safetensors, clean-STEP-optimizer.safetensors, clean-STEP-optimizer.json
                                 under a memorization rollback policy, the last clean state when
                                 it is an earlier step (what a rollback after a resume restores)
    manifest.json                sha256 of every file above, and of each 1 MiB block of every
                                 model and optimizer tensor file (whole or shard) and of its header
                                 (``train.blocks``): what a rank reading byte ranges verifies
    manifest.sig                 DSSE envelope over manifest.json, by the platform key: made by
                                 the platform's signer, which hashes every file itself
                                 (``govray.train.checkpoints.sealing``)

The frozen base by reference: while no base tensor of a run trains (a LoRA-only run), the base
never changes, so it is written once per run, into the run's base store
(``RUN_DIR/base/SHA256.safetensors``, ``govray.train.checkpoints.base_file``), and each checkpoint's signed
manifest lists ``model.safetensors`` with that sha256 under ``referenced`` instead of a copy in
its folder. Verification, loading and every reader (``model_file``) follow the reference: the
folder's own ``model.safetensors`` if it holds one (a registered version, a checkpoint handed to
Tune: the base file linked in), else the run's base file by its signed digest; a missing or
changed base file is refused, naming it.

Under ``resources.strategy: fsdp`` the base model and the optimizer tensors are sharded: instead
of ``model.safetensors`` and ``optimizer.safetensors`` each rank writes and hashes its own
``model-shard-RRRRR-of-WWWWW.safetensors`` and ``optimizer-shard-RRRRR-of-WWWWW.safetensors`` (its
shard of each tensor, with the tensor's global shape and offset in the file's metadata), and
rank 0 has the platform's signer seal one manifest, which hashes every rank's files. A rank that
resumes verifies the signature, the shared files and its own shards only
(``verify_checkpoint(..., rank=R)``).

No pickle anywhere. Loading verifies the signature (a trusted, unrevoked platform key), that the
envelope's payload is the manifest byte for byte, and every file's digest; any mismatch, missing
or extra file is refused, naming the file.

Example::

    save_base(model, directory / MODEL_FILE)           # weights first (governance/adapter_files.py)
    seal_checkpoint(directory, optimizer.state_dict(), state, context.signer)
    loaded = load_checkpoint(directory, trust)        # CheckpointError names the culprit
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from govray.core.canonical import file_sha256
from govray.core.keys import TrustConfig
from govray.core.storage import as_created
from govray.train.checkpoints.manifest import (
    BASE_STORE,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    SIGNATURE_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointState,
    Manifest,
    signed_manifest,
)

# Re-exported (``X as X``): what reads a checkpoint without its tensors imports them from there.
from govray.train.checkpoints.manifest import CHECKPOINT_FORMAT as CHECKPOINT_FORMAT
from govray.train.checkpoints.manifest import CHECKPOINT_PREFIX as CHECKPOINT_PREFIX
from govray.train.checkpoints.manifest import REPORT_FILE as REPORT_FILE
from govray.train.checkpoints.manifest import recorded_state as recorded_state
from govray.train.checkpoints.signer import ManifestSigner

_SHARD = re.compile(r"^(?:clean-\d{8}-)?(model|optimizer)-shard-(\d{5})-of-(\d{5})\.safetensors$")


def shard_file(kind: str, rank: int, world_size: int) -> str:
    """The name of a rank's shard file (``kind``: ``model`` or ``optimizer``)."""
    return f"{kind}-shard-{rank:05d}-of-{world_size:05d}.safetensors"


def shard_owner(name: str) -> int | None:
    """The rank whose shard file ``name`` is (its own, or a clean state's copy, ``clean-STEP-``);
    None for a file every rank may read."""
    match = _SHARD.match(name)
    return int(match.group(2)) if match else None


def split_optimizer_state(optimizer_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (safetensors) and plain JSON."""
    tensors: dict[str, torch.Tensor] = {}
    plain_state: dict[str, dict[str, Any]] = {}
    for index, values in optimizer_state["state"].items():
        plain_state[str(index)] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().contiguous()
            else:
                plain_state[str(index)][name] = value
    meta = {"state": plain_state, "param_groups": optimizer_state["param_groups"]}
    return tensors, meta


def optimizer_state_from_files(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of the split: a dict ``optimizer.load_state_dict`` accepts."""
    state: dict[int, dict[str, Any]] = {int(index): dict(values) for index, values in meta["state"].items()}
    for key, tensor in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = tensor
    return {"state": state, "param_groups": meta["param_groups"]}


def stage_checkpoint(
    directory: Path, optimizer_state: dict[str, Any], state: CheckpointState, sharded: bool = False
) -> None:
    """Write the optimizer state and ``state.json`` into a directory holding the weight files (no
    manifest: a stale one is removed), ready to be sealed; ``sharded``: only ``optimizer.json``."""
    optimizer_tensors, optimizer_meta = split_optimizer_state(optimizer_state)
    if not sharded:
        save_file(optimizer_tensors, str(directory / OPTIMIZER_TENSORS))
        as_created(directory / OPTIMIZER_TENSORS)  # (safetensors writes 0600)
    (directory / OPTIMIZER_META).write_text(json.dumps(optimizer_meta, indent=1, sort_keys=True))
    (directory / STATE_FILE).write_text(json.dumps(state.model_dump(mode="json"), indent=1, sort_keys=True))
    for stale in (MANIFEST_FILE, SIGNATURE_FILE):  # (a killed attempt's, maybe a hard link)
        (directory / stale).unlink(missing_ok=True)


def seal_checkpoint(
    directory: Path,
    optimizer_state: dict[str, Any],
    state: CheckpointState,
    signer: ManifestSigner,
    referenced: Mapping[str, str] | None = None,
    sharded: bool = False,
) -> str:
    """Add optimizer state and ``state.json`` to a directory holding the weight files, then have
    ``signer`` hash every file and sign their manifest (the block digests of the tensor files a
    resharding resume reads by ranges with it), and write both. Returns the manifest's sha256.
    ``referenced``: the base file of the run's base store the checkpoint refers to instead of
    holding it (``{MODEL_FILE: sha256}``, from ``govray.train.checkpoints.base_file.FrozenBase``).
    ``sharded``: the optimizer tensors are in every rank's shard files (already written): only
    ``optimizer.json`` is written here."""
    stage_checkpoint(directory, optimizer_state, state, sharded)
    sealed = signer.seal(directory, state.step, dict(referenced or {}))
    (directory / MANIFEST_FILE).write_bytes(sealed.manifest)
    (directory / SIGNATURE_FILE).write_text(sealed.envelope.to_json())
    return hashlib.sha256(sealed.manifest).hexdigest()


class LoadedCheckpoint(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    directory: Path
    state: CheckpointState
    optimizer_state: dict[str, Any]
    manifest_digest: str
    signer: str
    manifest: Manifest  # the verified manifest (its block digests: what a ranged read checks)


def base_store_file(run_dir: Path, digest: str) -> Path:
    """The base file of sha256 ``digest`` in a run's base store."""
    return run_dir / BASE_STORE / f"{digest}.safetensors"


def listed_file(directory: Path, manifest: Manifest, name: str, run_dir: Path | None = None) -> Path:
    """Where file ``name`` of a checkpoint's manifest lies: in the folder, or, for a file the
    manifest refers to by digest that the folder does not hold, in the base store of its run
    (``run_dir``, by default the folder's parent)."""
    own = directory / name
    if name in (manifest.referenced or ()) and not own.is_file():
        return base_store_file(run_dir or directory.parent, manifest.files[name])
    return own


def model_file(directory: Path) -> Path:
    """The base model file of a checkpoint folder or model version: its own ``model.safetensors``,
    or the run's base file its manifest refers to (the manifest read unverified: call it on a
    verified checkpoint, whose reference its signature covers)."""
    own = directory / MODEL_FILE
    try:
        manifest = Manifest.model_validate_json((directory / MANIFEST_FILE).read_bytes())
    except (OSError, ValidationError):
        return own  # no readable manifest: nothing refers elsewhere
    return listed_file(directory, manifest, MODEL_FILE)


def verify_checkpoint(
    directory: Path,
    trust: TrustConfig,
    rank: int | None = None,
    run_dir: Path | None = None,
    ranged: bool = False,
    of_run: str | None = None,
) -> tuple[Manifest, str]:
    """Check signature, manifest and every digest (a referenced base file's too); returns
    (manifest, signer keyid). With ``rank``, the shard files of other ranks are neither read nor
    looked for (each rank of a sharded run verifies what it reads: the shared files and its own
    shards). ``run_dir``: where the folder's run keeps its base store (by default the folder's
    parent; a folder staged for download is verified against the run it is fetched into).
    ``ranged``: the tensor files with block digests are not hashed here: their reader verifies
    each block it reads (``train.ranged``; a resume on another layout). ``of_run``: the run whose
    state it must be (its signed manifest names the run it was sealed in): a checkpoint of another
    run put in this run's directory is refused."""
    manifest, signer = signed_manifest(directory, trust)
    if of_run is not None and manifest.run != of_run:
        raise CheckpointError(
            f"{directory}: a checkpoint of run '{manifest.run}' (its signed manifest says), not of run "
            f"'{of_run}' whose directory holds it"
        )
    present = {path.name for path in directory.iterdir() if path.is_file()} - {MANIFEST_FILE, SIGNATURE_FILE}
    for extra in sorted(present - set(manifest.files)):
        raise CheckpointError(f"{directory / extra}: not listed in the signed manifest")
    sharded = any(shard_owner(name) is not None for name in manifest.files)
    for name, digest in sorted(manifest.files.items()):
        path = listed_file(directory, manifest, name, run_dir)
        if rank is not None and not rank_reads(name, rank, sharded):
            continue  # another rank's shard, or the whole model put together: not what this rank reads
        if ranged and name in (manifest.blocks or {}):
            continue  # read by verified ranges
        if not path.is_file():
            why = f" (the base model {directory} refers to by sha256)" if path.parent != directory else ""
            raise CheckpointError(f"{path}: listed in the signed manifest but missing{why}")
        if file_sha256(path) != digest:
            raise CheckpointError(f"{path}: sha256 does not match the signed manifest (tampered)")
    return manifest, signer


def rank_reads(name: str, rank: int, sharded: bool) -> bool:
    """Whether ``rank`` reads checkpoint file ``name`` (not another rank's shard, nor, of a
    sharded checkpoint, the whole model put together)."""
    return shard_owner(name) in (None, rank) and not (sharded and name == MODEL_FILE)


def load_checkpoint(
    directory: Path, trust: TrustConfig, rank: int | None = None, of_run: str | None = None
) -> LoadedCheckpoint:
    """Verify, then read a checkpoint (safetensors and JSON only). Of a sharded checkpoint, a
    ``rank`` verifies the shared files and its own shards, and its optimizer state is its shards';
    without a rank every file is verified (what reads all shards: a fork). ``of_run``: the run
    whose checkpoint it must be (``verify_checkpoint``)."""
    manifest, signer = verify_checkpoint(directory, trust, rank, of_run=of_run)
    try:
        state = CheckpointState.model_validate_json((directory / STATE_FILE).read_text())
        world = state.sharding.get("world_size")  # sharded: the rank's optimizer shard (rank 0's without one)
        tensors = OPTIMIZER_TENSORS if world is None else shard_file("optimizer", rank or 0, world)
        model = MODEL_FILE if world is None else shard_file("model", rank or 0, world)
        if model not in manifest.files or tensors not in manifest.files:
            raise CheckpointError(f"{directory}: the signed manifest lists no {model} and {tensors}")
        optimizer_state = optimizer_state_from_files(
            load_file(str(directory / tensors)),
            json.loads((directory / OPTIMIZER_META).read_text()),
        )
    except (ValidationError, SafetensorError, json.JSONDecodeError, ValueError) as error:
        raise CheckpointError(f"{directory}: signed but unreadable: {error}") from None
    return LoadedCheckpoint(
        directory=directory,
        state=state,
        optimizer_state=optimizer_state,
        manifest_digest=file_sha256(directory / MANIFEST_FILE),
        signer=signer,
        manifest=manifest,
    )


def checkpoint_step(directory: Path) -> int:
    """The step of a checkpoint, from its manifest (unverified: for listing only)."""
    return int(json.loads((directory / MANIFEST_FILE).read_text())["step"])


def checkpoint_sharding(directory: Path) -> tuple[int | None, int | None]:
    """A checkpoint's layout from its state (unverified: loading verifies it): ``sharding_layout``
    of its recorded sharding."""
    return sharding_layout(json.loads((directory / STATE_FILE).read_text()).get("sharding", {}))


def sharding_layout(sharding: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(world size, shard group) of a recorded sharding (``CheckpointState.sharding``, or a
    run's ``parallel.sharding()``): the ranks that wrote shard files (None: not sharded) and
    HSDP's shard group (None: FSDP, one group of every rank; HSDP's first ``shard_group`` files
    hold every row once, the others are copies)."""
    world, group = sharding.get("world_size"), sharding.get("shard_group")
    return (int(world) if world is not None else None), (int(group) if group is not None else None)


def find_checkpoints(root: Path) -> list[Path]:
    """Every checkpoint directory below ``root``, by step."""
    return sorted((path.parent for path in root.rglob(MANIFEST_FILE)), key=checkpoint_step)
