"""Checkpoint layouts, one per parallelism twin (``train.parallel``): who writes a trial's
checkpoint, what it holds, how it is read back and where a rollback's clean state comes from.

- ``WholeLayout`` (one worker, DDP): rank 0 writes every file — the whole base model, the
  adapters, the optimizer state — and the clean states a rollback may return to (kept in host
  memory too), then signs the manifest.
- ``ShardedLayout`` (FSDP): every rank writes and hashes its own shard files (model, optimizer),
  rank 0 the rest and one signed manifest over all of them, and every rank raises if any rank
  failed. No checkpoint holds the whole base model and no rank reads another's shards: a consumer
  that needs the whole model puts it together from the verified shards, streaming, when it needs
  it (``train.whole_file``). Clean states are not kept in memory: each checkpoint carries (hard
  links to) the earlier clean states' files, checked against the signed manifest they came from;
  each rank verifies and reads only its own.

``TrialRun`` (``train.run.state``) asks its layout and never tests the strategy. A layout takes
the narrow parts it works on (``Parts``: the model, optimizer, worker, storage, trust) and what
the run's controller holds (the earlier clean states, the last checkpoint), never the run.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from govray.core.canonical import file_sha256
from govray.core.keys import TrustConfig
from govray.core.storage import Storage, StorageError
from govray.governance.adapter_files import load_adapter
from govray.train.checkpoints.base_file import link_or_copy
from govray.train.checkpoints.clean_states import clean_name, load_clean_states, save_clean_state
from govray.train.checkpoints.files import (
    OPTIMIZER_META,
    CheckpointError,
    LoadedCheckpoint,
    checkpoint_sharding,
    load_checkpoint,
    optimizer_state_from_files,
    shard_file,
    sharding_layout,
    signed_manifest,
    verify_checkpoint,
)
from govray.train.checkpoints.folders import (
    checkpoint_candidates,
    fetch_part,
    fetch_referenced,
    ordered_checkpoints,
)
from govray.train.checkpoints.reshard import load_resharded
from govray.train.parallel.fsdp import load_shards, local_optimizer_state, write_shards
from govray.train.parallel.worker import Worker, agreed

if TYPE_CHECKING:
    from govray.governance.adapters import GovernedModel
    from govray.train.checkpoints.base_file import FrozenBase

Layout = tuple[int | None, int | None]  # how checkpoints are sharded: (world size, HSDP shard group)
Latest = tuple[Path, int] | None  # the last checkpoint the run wrote or resumed from: (folder, step)
# Rank 0 writes its files and has them all sealed (every rank's shard files by name; None: unsharded).
Seal = Callable[[Sequence[str] | None], None]


@dataclass(frozen=True)
class CleanState:
    """A clean state: what a rollback restores. ``WholeLayout`` keeps its weights and
    optimizer state in host memory; ``ShardedLayout`` does not (``on_storage``): they are the signed
    checkpoint of its step, carried on by every later checkpoint (``TrialRun``)."""

    step: int
    weights: dict[str, torch.Tensor]  # GovernedModel.state_dict(): base and adapters
    optimizer: dict[str, Any]
    ledger: dict[str, Any]
    on_storage: bool = False


def own_run(folder: Path, run_dir: Path) -> str | None:
    """The run a checkpoint folder to resume from must belong to: ``run_dir``'s, when the folder
    lies in it (its signed manifest names the run directory it was sealed in, so another run's
    checkpoint copied in after the resume rule chose the folder is refused); None for a folder
    handed over from elsewhere (a PBT clone's donor, a checkpoint Tune persisted or restored: a copy
    in a folder of Tune's naming, another run's state by design)."""
    return run_dir.resolve().name if folder.resolve().parent == run_dir.resolve() else None


@dataclass(frozen=True)
class Parts:
    """What a layout writes and reads a checkpoint with: the worker's pieces, never the run."""

    model: GovernedModel
    optimizer: torch.optim.Optimizer
    parameters: list[torch.nn.Parameter]  # the governor's (a resharding resume reads them by ranges)
    sharding: dict[str, Any]  # the twin's ``sharding()``: how this run's checkpoints are sharded
    worker: Worker
    storage: Storage
    trust: TrustConfig

    @property
    def own_layout(self) -> tuple[int | None, int | None]:
        """(world size, HSDP shard group) of this run's checkpoints, None where not sharded."""
        return sharding_layout(self.sharding)


class WholeLayout:
    """One worker or DDP: rank 0 writes the whole checkpoint; clean states live in host memory."""

    every_rank_writes = False  # read inside this package only: the questions below answer it

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` writes (part of) each checkpoint."""
        return rank == 0 or self.every_rank_writes

    def ready_to_write(self, worker: Worker) -> None:
        """Before a checkpoint's files are written: rank 0 alone writes them, nothing to wait for."""

    def newest_verified(
        self, run_dir: Path, trust: TrustConfig, storage: Storage, worker: Worker
    ) -> tuple[Path | None, list[str]]:
        """The resume rule (``checkpoints.folders``): the newest checkpoint of ``run_dir`` that
        verifies, rank 0 reading it whole (the others read what it broadcasts); returns it (None:
        none does) and why each newer one was passed over."""
        refusals: list[str] = []
        for directory, refusal in checkpoint_candidates(run_dir, trust, storage):
            if refusal is None:
                return directory, refusals
            refusals.append(refusal)
        return None, refusals

    def refuse_clean_elsewhere(self, directory: Path, written: Layout, own: Layout) -> None:
        """A resumed checkpoint that is itself a rollback target: its clean state is kept in
        memory here, whatever layout wrote it."""

    def save(
        self, parts: Parts, directory: Path, seal: Seal, earlier: list[tuple[int, CleanState]], latest: Latest
    ) -> None:
        """Write the checkpoint: ``seal(shard_names)`` writes rank 0's files and has them sealed
        (``earlier``: the clean states before this step, ``latest``: the last checkpoint)."""
        seal(None)

    def write_model(self, parts: Parts, base: FrozenBase, directory: Path) -> dict[str, str] | None:
        """Rank 0, while sealing: the base model file, or (a frozen base) a reference to the
        run's base file (``train.base_file``); returns what the manifest refers to."""
        return base.save(parts.model, directory)

    def write_clean_states(
        self, parts: Parts, directory: Path, earlier: list[tuple[int, CleanState]], latest: Latest
    ) -> None:
        """Rank 0, while sealing: the earlier clean states (rollback targets survive a resume)."""
        for step, clean in earlier:
            save_clean_state(directory, step, clean.weights, clean.optimizer)

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """What rank 0 stores of its ``optimizer.state_dict()``."""
        return state

    def load(self, parts: Parts, directory: Path, of_run: str | None = None) -> LoadedCheckpoint:
        """Verify and read a checkpoint to resume from (refusing a sharded one); a base file it
        refers to is fetched from object storage first. ``of_run``: the run it must be of
        (``own_run``)."""
        fetch_referenced(directory, parts.storage)
        if checkpoint_sharding(directory)[0] is None:  # (unverified: what is loaded is verified)
            return load_checkpoint(directory, parts.trust, of_run=of_run)
        agreed(lambda: self._written_by(parts, directory), parts.worker, CheckpointError)
        return self._load_other_layout(parts, directory, of_run)  # FSDP -> DDP: every rank reads its part

    def _written_by(self, parts: Parts, directory: Path) -> tuple[int | None, int | None]:
        """The world size a checkpoint is sharded over (None: unsharded) and its HSDP shard group
        (None: FSDP's one group), read unverified from its state: it only chooses how the
        checkpoint is read, and what is loaded is verified."""
        fetch_part(directory, parts.storage, parts.worker.rank)
        try:
            return checkpoint_sharding(directory)
        except (OSError, ValueError):
            return parts.own_layout  # unreadable: the verified load refuses it, naming the file

    def _load_other_layout(self, parts: Parts, directory: Path, of_run: str | None) -> LoadedCheckpoint:
        """A checkpoint of another layout (DDP <-> FSDP, another world size): each rank verifies
        the shared files and reads its part of the optimizer state by verified ranges (its
        weights follow in ``load_weights``); every rank refuses if any did. The run continues
        its schedule on this world (``train.rounds``)."""
        loaded = agreed(
            lambda: load_resharded(
                directory,
                parts.trust,
                parts.worker.rank,
                parts.model,
                parts.optimizer,
                parts.parameters,
                of_run=of_run,
            ),
            parts.worker,
            CheckpointError,
        )
        earlier = sorted(int(step) for step in loaded.state.clean_ledgers if int(step) != loaded.state.step)
        if earlier:
            raise CheckpointError(
                f"{directory}: carries the clean states of steps {earlier} in its own layout's files: "
                "a run under another strategy cannot roll back to them (resume it as it was written)"
            )
        return loaded

    def clean_states(self, loaded: LoadedCheckpoint) -> dict[int, CleanState]:
        """The clean states a resumed run may roll back to, as this layout keeps them."""
        return {
            step: CleanState(step, weights, optimizer, loaded.state.clean_ledgers[str(step)])
            for step, (weights, optimizer) in load_clean_states(loaded).items()
        }

    def roll_back(
        self, parts: Parts, clean: CleanState, latest: Latest, of_run: str | None = None
    ) -> dict[str, Any]:
        """Back to a clean state's weights (the copy kept in memory); returns its optimizer state
        (the caller loads it, with the clean state's ledger)."""
        parts.model.load_state_dict(clean.weights, strict=True)
        return copy.deepcopy(clean.optimizer)


def describe_layout(world: int | None, group: int | None) -> str:
    """A layout in words, for refusals: ``sharded over 4 workers in shard groups of 2``."""
    if world is None:
        return "unsharded (one whole file)"
    return f"sharded over {world} workers" + (f" in shard groups of {group}" if group else "")


class ShardedLayout(WholeLayout):
    """FSDP: every rank writes and reads its own shard files; clean states live in checkpoints."""

    every_rank_writes = True

    def ready_to_write(self, worker: Worker) -> None:
        """Every rank waits until rank 0 made the checkpoint's folder fresh."""
        dist.barrier(group=worker.host_group)

    def newest_verified(
        self, run_dir: Path, trust: TrustConfig, storage: Storage, worker: Worker
    ) -> tuple[Path | None, list[str]]:
        """The resume rule, applied by the ranks together: rank 0 lists the candidates (newest
        first) for all, each rank verifies what it reads of each, and they resume from the first
        that verifies on every rank (one that does not is passed over on every rank)."""
        rank, refusals = worker.rank, list[str]()
        listed: list[Any] = [[str(d) for d in ordered_checkpoints(run_dir, storage)] if rank == 0 else None]
        dist.broadcast_object_list(listed, src=0, group=worker.host_group)
        for name in listed[0]:
            directory = Path(name)
            try:
                fetch_part(directory, storage, rank)
                verify_checkpoint(directory, trust, rank, of_run=run_dir.name)
                refusal = None
            except (CheckpointError, StorageError, OSError) as error:
                refusal = str(error)
            said: list[Any] = [None] * worker.world_size
            dist.all_gather_object(said, refusal, group=worker.host_group)
            if not (reasons := [reason for reason in said if reason is not None]):
                return directory, refusals
            refusals.extend(reasons)
        return None, refusals

    def refuse_clean_elsewhere(self, directory: Path, written: Layout, own: Layout) -> None:
        """Under FSDP a clean state is the checkpoint's shard files, carried into every later
        checkpoint and read back by a rollback, each rank its own: those of another layout (a
        resume on another world size, in other HSDP shard groups, or from DDP) are not there to
        carry."""
        if written != own:
            raise CheckpointError(
                f"{directory}: a rollback target (a clean state) {describe_layout(*written)}; "
                f"this run ({describe_layout(*own)}) keeps its clean states in its own "
                "shard files: resume it on the world size and strategy that wrote it"
            )

    def save(
        self, parts: Parts, directory: Path, seal: Seal, earlier: list[tuple[int, CleanState]], latest: Latest
    ) -> None:
        names = self._save_shards(parts, directory, earlier, latest)
        agreed(lambda: seal(names), parts.worker, CheckpointError)

    def write_model(self, parts: Parts, base: FrozenBase, directory: Path) -> dict[str, str] | None:
        """Nothing: every rank wrote its model shard (``save``), the whole model is put together
        only by a consumer that needs it (``train.whole_file``), and shard files are never
        referenced (each checkpoint holds its own)."""
        return None

    def write_clean_states(
        self, parts: Parts, directory: Path, earlier: list[tuple[int, CleanState]], latest: Latest
    ) -> None:
        """The clean states' shared files (the shards are carried by their ranks)."""
        adapters = [f"adapter-{adapter}.safetensors" for adapter in parts.model.adapter_names()]
        self._carry_clean(parts, directory, earlier, latest, [OPTIMIZER_META, *adapters])

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return local_optimizer_state(state)  # rank 0's shards (every rank writes its own file)

    def load(self, parts: Parts, directory: Path, of_run: str | None = None) -> LoadedCheckpoint:
        """Each rank verifies and reads what it needs (the shared files, its own shards); every
        rank refuses if any rank did, naming the files. A checkpoint of another layout (DDP,
        sharded over another world size or in other HSDP shard groups) is read by verified ranges
        (``_load_other_layout``)."""
        worker = parts.worker
        written_by = agreed(lambda: self._written_by(parts, directory), worker, CheckpointError)
        if written_by != parts.own_layout:  # another world size or other HSDP shard groups
            return self._load_other_layout(parts, directory, of_run)
        loaded = agreed(
            lambda: load_checkpoint(directory, parts.trust, worker.rank, of_run=of_run),
            worker,
            CheckpointError,
        )
        verified = sharding_layout(loaded.state.sharding)
        if verified != written_by:  # (the unverified read chose the layout: it must be the signed one)
            raise CheckpointError(
                f"{directory}: its signed state is {describe_layout(*verified)}, "
                f"not {describe_layout(*written_by)}"
            )
        return loaded

    def clean_states(self, loaded: LoadedCheckpoint) -> dict[int, CleanState]:
        """The clean states stay on storage: this checkpoint carries them."""
        return {
            int(step): CleanState(int(step), {}, {}, ledger, on_storage=True)
            for step, ledger in loaded.state.clean_ledgers.items()
        }

    def roll_back(
        self, parts: Parts, clean: CleanState, latest: Latest, of_run: str | None = None
    ) -> dict[str, Any]:
        """Back to a clean state from storage (no copy of it was kept in memory): the last
        checkpoint's own state, or the copy of it that checkpoint carries; each rank verifies and
        reads its own shards, and every rank refuses if one does. Returns this rank's optimizer
        state (the caller loads it)."""
        if latest is None:
            raise CheckpointError(f"the clean state of step {clean.step} is in no checkpoint of this run")
        (folder, step), worker, model = latest, parts.worker, parts.model

        def verified() -> None:
            fetch_part(folder, parts.storage, worker.rank)
            verify_checkpoint(folder, parts.trust, worker.rank, of_run=of_run)

        agreed(verified, worker, CheckpointError)

        def path(name: str) -> Path:
            return folder / (name if step == clean.step else clean_name(clean.step, name))

        load_shards(model, path(shard_file("model", worker.rank, worker.world_size)))
        for adapter in model.adapter_names():
            load_adapter(model, adapter, path(f"adapter-{adapter}.safetensors"))
        return optimizer_state_from_files(
            load_file(str(path(shard_file("optimizer", worker.rank, worker.world_size)))),
            json.loads(path(OPTIMIZER_META).read_text()),
        )

    def _carry_clean(
        self,
        parts: Parts,
        directory: Path,
        earlier: list[tuple[int, CleanState]],
        latest: Latest,
        names: list[str],
    ) -> list[str]:
        """Into a new checkpoint, these files of every earlier clean state, hard-linked (or
        copied) from the last checkpoint, which holds each (its own, or carried), each checked
        against that checkpoint's signed manifest (a tampered file is never signed again);
        returns the copies' names."""
        carried: list[str] = []
        if not earlier:
            return carried
        if latest is None:
            raise CheckpointError(f"the clean state of step {earlier[0][0]} is in no checkpoint of this run")
        source, source_step = latest
        fetch_part(source, parts.storage, parts.worker.rank)
        signed = signed_manifest(source, parts.trust)[0].files
        for step, _ in earlier:
            for name in names:
                origin = source / (name if step == source_step else clean_name(step, name))
                target = directory / clean_name(step, name)
                target.unlink(missing_ok=True)  # (a killed attempt's): never write through a link
                link_or_copy(origin, target)
                carried.append(target.name)
                if file_sha256(target) != signed.get(origin.name):
                    raise CheckpointError(f"{origin}: sha256 does not match its signed manifest (tampered)")
        return carried

    def _save_shards(
        self, parts: Parts, directory: Path, earlier: list[tuple[int, CleanState]], latest: Latest
    ) -> list[str]:
        """Every rank's shard files written (and on object storage); returns every rank's file
        names (every rank raises if any failed). The signer hashes them when rank 0 seals."""
        worker = parts.worker

        def write() -> list[str]:
            rank, world = worker.rank, worker.world_size
            written = write_shards(directory, parts.model, parts.optimizer, rank, world)
            own = [shard_file(kind, rank, world) for kind in ("model", "optimizer")]
            written += self._carry_clean(parts, directory, earlier, latest, own)
            parts.storage.upload(*(directory / name for name in written))  # before rank 0 seals
            return written

        written = agreed(write, worker, CheckpointError)
        gathered: list[Any] = [None] * worker.world_size
        dist.all_gather_object(gathered, written, group=worker.host_group)
        return [name for part in gathered for name in part]
