"""A worker's context that seals through the platform's signer, as a run's launch would open it:
what a test that builds a trial's state itself (in-process, or in a gloo group) and saves
checkpoints needs. The channel is opened by rank 0 (opening a run again revokes the last
capability) and handed to the group's other ranks, as a launch hands it to every worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from govray.signer.local import open_channel
from govray.train.checkpoints.signer import ChannelSigner, SignerChannel
from govray.train.context import WorkerContext
from govray.train.parallel.worker import Worker
from govray.train.runspec import RunSpec


def channel_for(spec: RunSpec, worker: Worker | None = None) -> SignerChannel:
    """A channel for the run of ``spec`` (in ``spec.run_dir``, bound to the spec): opened by rank 0
    (this process without a group), broadcast to the group's other ranks."""
    import torch.distributed as dist

    rank = worker.rank if worker is not None else 0
    found: list[Any] = [open_channel(Path(spec.run_dir), spec) if rank == 0 else None]
    if dist.is_initialized() and worker is not None and worker.world_size > 1:
        dist.broadcast_object_list(found, src=0)
    return found[0]


def sealing_context(spec: RunSpec, worker: Worker) -> WorkerContext:
    """``WorkerContext.of(spec, worker)`` whose checkpoints (in ``spec.run_dir``) are sealed."""
    return WorkerContext.of(spec, worker, signer=ChannelSigner(channel_for(spec, worker)))


def dev_signer_record(state_dir: Path) -> Path:
    """``state_dir`` holding a copy of this session's development signer's record (what it
    sealed): a signer a test serves itself attests only what its record says it sealed."""
    import shutil

    from govray.core.keys import govray_home

    shutil.copytree(govray_home() / "signer-dev" / "state", state_dir, dirs_exist_ok=True)
    return state_dir


def training_state(folder: Path, run_dir: Path | str, step: int) -> Path:
    """``folder`` made to hold the ``state.json`` and ``run.json`` of the checkpoint at ``step`` in
    ``run_dir`` (a golden run's): a training state whose ledger the signer recomputes before it
    seals (a step's bare ``{"step": N}`` it refuses)."""
    import shutil

    source = Path(run_dir) / f"checkpoint_{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("state.json", "run.json"):
        shutil.copy(source / name, folder / name)
    return folder


def run_spec_at(run_dir: Path | str, step: int) -> RunSpec:
    """The run spec of the checkpoint at ``step`` in ``run_dir`` (a golden run's): what a launch
    binds the channel of a run sealing that training state (``training_state``) to."""
    from govray.train.runspec import RUN_SPEC_FILE, read_run_spec

    return read_run_spec(Path(run_dir) / f"checkpoint_{step:08d}" / RUN_SPEC_FILE)


def sealed_into(signer: ChannelSigner, folder: Path, step: int) -> Path:
    """``folder`` sealed at ``step`` through ``signer``, its manifest and envelope written there
    (what rank 0 does after the signer answers)."""
    from govray.train.checkpoints.manifest import MANIFEST_FILE, SIGNATURE_FILE

    sealed = signer.seal(folder, step, {})
    (folder / MANIFEST_FILE).write_bytes(sealed.manifest)
    (folder / SIGNATURE_FILE).write_text(sealed.envelope.to_json())
    return folder
