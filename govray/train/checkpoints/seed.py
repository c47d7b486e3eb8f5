"""The seed checkpoint: under FSDP no rank builds the whole model (torchtitan's
``create_seed_checkpoint``).

A model's initial weights must not depend on the world size or the device (a replay or a removal
compares runs that start from the same weights), and initialisation on the meta device cannot
reproduce them shard by shard. So ONE process — rank 0, before the other ranks go on — builds the
model exactly as every rank did before (:func:`initial_model`: the same seed, the same
``trial.build_model()``, on the CPU) and writes its tensors once into the run's seed store,
content-addressed (``RUN_DIR/seed/SHA256.safetensors``, the canonical bytes of a base file: a
restart rewrites the same bytes under the same name, and a replay's seed equals its run's).
Every rank then:

1. builds the model's structure on the ``meta`` device (``trial.build_meta_model``; its dtypes
   made the seed's, so a ``from_pretrained`` model keeps the dtypes it loads with);
2. is sharded (FSDP2 shards meta tensors without memory);
3. ``to_empty`` on its device allocates only its shards, adapters are initialised again (their
   own seeded generators: device-independent);
4. fills its shards from the seed by verified byte ranges (``train.ranged``): only the blocks
   holding its rows are read, each checked against the block digests rank 0 wrote beside the
   seed, whose own sha256 every rank received from rank 0 (no mapping of the file).

Memory: rank 0 holds the whole model once, on the host, while it writes the seed (as every rank
did before); every other rank holds its shards and one slice at a time (measured by
``jobs.benchmarks.init_memory``: 1.17 times its shard, against 4.2 when every rank built the
whole model, 4 ranks). A rank reads its share of the seed and at most a block more per
tensor. A resume builds the same seed again (rank 0, same bytes) and the
checkpoint's weights then replace the seed's.

A trial whose structure cannot be built on meta, or whose meta structure does not match its
full build (names, shapes), takes the path of old: every rank builds the whole model and FSDP
shards it (the seed file is then not read); so does a run with no run directory.

Example::

    seed = SeedCheckpoint.agree(spec, worker, storage, trial)   # rank 0 writes, every rank has the digest
    base = seed.skeleton()                             # on meta (or the whole model: fallback)
    ...                                                # adapters, fully_shard
    seed.fill(model, device)                           # to_empty + this rank's shards, verified
"""

from __future__ import annotations

import gc
import os
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from govray.core.storage import Storage
from govray.data.schedule import derive_seed
from govray.governance.adapter_files import save_base_tensors
from govray.governance.adapters import GovernedModel
from govray.train.checkpoints.blocks import write_blocks
from govray.train.checkpoints.files import CheckpointError
from govray.train.checkpoints.ranged import SAFETENSORS_DTYPES, VerifiedFile, verified_file
from govray.train.checkpoints.reshard import my_rows
from govray.train.parallel.fsdp import local
from govray.train.parallel.worker import Worker, agreed
from govray.train.runspec import RunSpec
from govray.train.trial import Trial

SEED_STORE = "seed"  # RUN_DIR/seed/SHA256.safetensors

Box = tuple[slice, ...] | None  # a slice of a tensor (None: the whole tensor)


def initial_model(spec: RunSpec, trial: Trial) -> nn.Module:
    """The trial's model with its initial weights: built on the CPU from the run's seeded
    generator (device- and world-size-independent). The one place initial weights come from."""
    torch.manual_seed(derive_seed(spec.seed, spec.trial_seed, "init"))
    return trial.build_model()


def seed_state(base: nn.Module) -> dict[str, torch.Tensor]:
    """What a seed holds: the state dict and the buffers it leaves out (non-persistent ones, such
    as rotary frequencies, are lost by ``to_empty`` too)."""
    state = dict(base.state_dict())
    for name, buffer in base.named_buffers():
        state.setdefault(name, buffer)
    return state


def seed_file(run_dir: Path, digest: str) -> Path:
    return run_dir / SEED_STORE / f"{digest}.safetensors"


def write_seed(base: nn.Module, run_dir: Path) -> dict[str, str]:
    """Write ``base``'s seed into the run's seed store, with its block digests beside it; returns
    the sha256 of both files by name (the seed's name is its own sha256)."""
    store = run_dir / SEED_STORE
    store.mkdir(parents=True, exist_ok=True)
    staged = store / f".{uuid.uuid4().hex}.safetensors"  # hidden until complete
    try:
        digest = save_base_tensors(seed_state(base), staged)
        os.replace(staged, seed_file(run_dir, digest))
    finally:
        staged.unlink(missing_ok=True)
    return write_blocks(seed_file(run_dir, digest))


Header = dict[str, tuple[tuple[int, ...], torch.dtype]]  # a safetensors file's tensors: shape, dtype


def _header(seed: VerifiedFile) -> Header:
    """The seed's tensors (its verified header): shape and dtype of each."""
    _, entries = seed.header()
    return {
        name: (tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]])
        for name, entry in entries.items()
        if name != "__metadata__"
    }


def _meta_structure(trial: Trial) -> nn.Module | None:
    """The trial's model on meta, or None where it cannot be built there."""
    try:
        model = trial.build_meta_model()
    except Exception:  # any failure means: build it whole, as before
        return None
    on_meta = all(tensor.is_meta for tensor in seed_state(model).values())
    return model if on_meta else None


def _take_dtypes(model: nn.Module, header: Header) -> bool:
    """Give ``model``'s meta tensors the seed's dtypes; False where names or shapes differ."""
    state = seed_state(model)
    if state.keys() != header.keys():
        return False
    if any(tuple(tensor.shape) != header[name][0] for name, tensor in state.items()):
        return False
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        dtype = header[name][1]
        if tensor.dtype != dtype:
            tensor.data = torch.empty(tensor.shape, dtype=dtype, device="meta")
    return True


class SeedCheckpoint:
    """A run's seed file and the digest every rank checks it against (``path`` None: the run
    builds the whole model on every rank, as before)."""

    def __init__(
        self,
        spec: RunSpec,
        trial: Trial,
        path: Path | None,
        files: dict[str, str],
        worker: Worker | None = None,
    ) -> None:
        self.spec, self.trial, self.path, self.files = spec, trial, path, files  # files: name → sha256
        self.worker = worker  # whose ranks all refuse if one reads a tampered block

    def _verified(self) -> VerifiedFile:
        assert self.path is not None
        return verified_file(self.path.parent, self.path.name, self.files)

    @classmethod
    def agree(cls, spec: RunSpec, worker: Worker, storage: Storage, trial: Trial) -> SeedCheckpoint:
        """Rank 0 writes the seed (uploading it to ``storage``) while the others wait (a restart
        writes the same bytes); every rank gets its digest and fetches the seed when its node
        lacks it. A failure of rank 0 is raised on every rank."""
        if not spec.run_dir or not worker.distributed:
            return cls(spec, trial, None, {})
        run_dir = Path(spec.run_dir)
        said: list[dict[str, str] | str | None] = [None]
        if worker.rank == 0:
            try:
                base = initial_model(spec, trial)
                written = write_seed(base, run_dir)
                del base
                gc.collect()  # the whole model leaves before this rank builds its shards
                storage.upload(*(run_dir / SEED_STORE / name for name in written))
                said[0] = written
            except Exception as error:
                said[0] = f"{type(error).__name__}: {error}"
                dist.broadcast_object_list(said, src=0, group=worker.host_group)
                raise
        dist.broadcast_object_list(said, src=0, group=worker.host_group)
        files = said[0]
        if not isinstance(files, dict):
            raise CheckpointError(f"rank 0 could not write the seed checkpoint: {files}")
        paths = [run_dir / SEED_STORE / name for name in files]
        for path in paths:
            storage.fetch(path)
        missing = [str(path) for path in paths if not path.is_file()]
        if missing:
            raise CheckpointError(f"{missing[0]}: the seed checkpoint rank 0 wrote is not on this node")
        seed = next(path for path in paths if path.suffix == ".safetensors")
        return cls(spec, trial, seed, files, worker)

    def skeleton(self) -> nn.Module:
        """The model to shard: its structure on meta (the seed's dtypes) where the trial allows
        it and it matches the seed; else the whole model, built as before."""
        if self.path is not None:
            model = _meta_structure(self.trial)
            if model is not None and _take_dtypes(model, _header(self._verified())):
                return model
        return initial_model(self.spec, self.trial)

    def fill(self, model: GovernedModel, device: torch.device) -> None:
        """After sharding a meta skeleton: allocate this rank's shards on ``device``, give the
        adapters their initial factors and copy each base tensor's slice in from the seed. A
        model built whole is left as it is."""
        if self.path is None or not any(parameter.is_meta for parameter in model.parameters()):
            return
        model.to_empty(device=device)
        model.initialise_adapters()
        targets = model.base_state()
        for name, buffer in model.base.named_buffers():
            targets.setdefault(model.user_name(name), buffer)
        agreed(lambda: self._fill(targets), self.worker, CheckpointError)

    def _fill(self, targets: dict[str, torch.Tensor]) -> None:
        """Copy this rank's rows of each tensor in from the seed, every byte read checked against
        rank 0's block digests."""
        seed = self._verified()
        with torch.no_grad():
            for name, target in targets.items():
                start, stop = my_rows(target)
                value = seed.rows(name, start, stop) if target.dim() else seed.rows(name, 0, 0)
                mine = local(target)
                if tuple(mine.shape) != tuple(value.shape):
                    found, expected = tuple(value.shape), tuple(mine.shape)
                    raise CheckpointError(f"{self.path}: {name} is {found}, this rank's part {expected}")
                mine.copy_(value)
