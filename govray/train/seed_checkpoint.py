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
4. checks the seed file's sha256 against the digest rank 0 broadcast, then fills its shards
   from it (:func:`read_slices`: plain reads of this rank's byte ranges, no mapping of the file).

Memory: rank 0 holds the whole model once, on the host, while it writes the seed (as every rank
did before); every other rank holds its shards and one slice at a time (measured by
``jobs.benchmarks.init_memory``: 1.17 times its shard, against 4.2 when every rank built the
whole model, 4 ranks). Checking the sha256 reads the whole file on every rank (time and I/O,
not memory) until the verified byte-range reader, with a digest per block, takes
:func:`read_slices`'s place. A resume builds the same seed again (rank 0, same bytes) and the
checkpoint's weights then replace the seed's.

A trial whose structure cannot be built on meta, or whose meta structure does not match its
full build (names, shapes), takes the path of old: every rank builds the whole model and FSDP
shards it (the seed file is then not read); so does a run with no run directory.

Example::

    seed = SeedCheckpoint.agree(spec, worker, trial)   # rank 0 writes, every rank has the digest
    base = seed.skeleton()                             # on meta (or the whole model: fallback)
    ...                                                # adapters, fully_shard
    seed.fill(model, device)                           # to_empty + this rank's shards, verified
"""

from __future__ import annotations

import gc
import json
import math
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from govray.core.canonical import file_sha256
from govray.core.storage import open_storage
from govray.data.schedule import derive_seed
from govray.governance.adapter_files import save_base_tensors
from govray.governance.adapters import GovernedModel
from govray.train.checkpoint import CheckpointError
from govray.train.runspec import RunSpec
from govray.train.sharding import is_sharded, local
from govray.train.trial import Trial
from govray.train.worker import Worker

SEED_STORE = "seed"  # RUN_DIR/seed/SHA256.safetensors

Box = tuple[slice, ...] | None  # a slice of a tensor (None: the whole tensor)

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


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


def write_seed(base: nn.Module, run_dir: Path) -> str:
    """Write ``base``'s seed into the run's seed store; returns its sha256 (its name)."""
    store = run_dir / SEED_STORE
    store.mkdir(parents=True, exist_ok=True)
    staged = store / f".{uuid.uuid4().hex}.safetensors"  # hidden until complete
    try:
        digest = save_base_tensors(seed_state(base), staged)
        os.replace(staged, seed_file(run_dir, digest))
    finally:
        staged.unlink(missing_ok=True)
    return digest


def read_slices(path: Path, boxes: Mapping[str, Box]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each named tensor's rows ``box[0]`` (``None``: the whole tensor) of a verified safetensors
    file, one tensor at a time, read with plain reads into a fresh tensor: only those bytes leave
    the file, and no page of it is mapped into the process. FSDP2 shards along dim 0, so a rank's
    part of a tensor is a run of whole rows: one contiguous byte range. The one reader of seed
    bytes (a verified byte-range reader takes its place without another change)."""
    start, header = _header(path)
    with open(path, "rb") as file:
        for name, box in boxes.items():
            shape, dtype = header[name]
            begin, rows = start[name], list(shape)
            if box is not None:
                if any(
                    (part.start, part.stop) != (0, size)
                    for part, size in zip(box[1:], shape[1:], strict=True)
                ):
                    raise CheckpointError(f"{path}: {name}: a part of a tensor is read as whole rows only")
                begin += box[0].start * dtype.itemsize * math.prod(shape[1:])
                rows[0] = box[0].stop - box[0].start
            value = torch.empty(rows, dtype=dtype)
            file.seek(begin)
            if file.readinto(value.view(-1).view(torch.uint8).numpy().data) != value.nbytes:
                raise CheckpointError(f"{path}: {name} ends before its last byte")
            yield name, value


Header = dict[str, tuple[tuple[int, ...], torch.dtype]]  # a safetensors file's tensors: shape, dtype


def _header(path: Path) -> tuple[dict[str, int], Header]:
    """Where each tensor of a safetensors file begins, and its shape and dtype."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        entries = json.loads(file.read(length))
    entries.pop("__metadata__", None)
    starts = {name: 8 + length + entry["data_offsets"][0] for name, entry in entries.items()}
    return starts, {name: (tuple(entry["shape"]), _DTYPES[entry["dtype"]]) for name, entry in entries.items()}


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

    def __init__(self, spec: RunSpec, trial: Trial, path: Path | None, digest: str | None) -> None:
        self.spec, self.trial, self.path, self.digest = spec, trial, path, digest

    @classmethod
    def agree(cls, spec: RunSpec, worker: Worker, trial: Trial) -> SeedCheckpoint:
        """Rank 0 writes the seed while the others wait (a restart writes the same bytes); every
        rank gets its digest. A failure of rank 0 is raised on every rank."""
        if not spec.run_dir or not worker.distributed:
            return cls(spec, trial, None, None)
        run_dir = Path(spec.run_dir)
        storage = open_storage(spec.storage) if spec.storage else None
        said: list[str | None] = [None]
        if worker.rank == 0:
            try:
                base = initial_model(spec, trial)
                written = write_seed(base, run_dir)
                del base
                gc.collect()  # the whole model leaves before this rank builds its shards
                if storage is not None and run_dir.is_relative_to(storage.root):
                    storage.upload(seed_file(run_dir, written))
                said[0] = f"sha256:{written}"
            except Exception as error:
                said[0] = f"{type(error).__name__}: {error}"
                dist.broadcast_object_list(said, src=0, group=worker.host_group)
                raise
        dist.broadcast_object_list(said, src=0, group=worker.host_group)
        message = said[0] or ""
        if not message.startswith("sha256:"):
            raise CheckpointError(f"rank 0 could not write the seed checkpoint: {message}")
        digest = message.removeprefix("sha256:")
        path = seed_file(run_dir, digest)
        if storage is not None and run_dir.is_relative_to(storage.root):
            storage.fetch(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: the seed checkpoint rank 0 wrote is not on this node")
        return cls(spec, trial, path, digest)

    def skeleton(self) -> nn.Module:
        """The model to shard: its structure on meta (the seed's dtypes) where the trial allows
        it and it matches the seed; else the whole model, built as before."""
        if self.path is not None:
            model = _meta_structure(self.trial)
            if model is not None and _take_dtypes(model, _header(self.path)[1]):
                return model
        return initial_model(self.spec, self.trial)

    def fill(self, model: GovernedModel, device: torch.device) -> None:
        """After sharding a meta skeleton: allocate this rank's shards on ``device``, give the
        adapters their initial factors and copy each base tensor's slice in from the seed. A
        model built whole is left as it is."""
        if self.path is None or not any(parameter.is_meta for parameter in model.parameters()):
            return
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        model.to_empty(device=device)
        model.initialise_adapters()
        targets = model.base_state()
        for name, buffer in model.base.named_buffers():
            targets.setdefault(model.user_name(name), buffer)
        boxes: dict[str, Box] = {}
        for name, target in targets.items():
            if is_sharded(target):
                shape, offset = compute_local_shape_and_global_offset(
                    target.shape, target.device_mesh, target.placements
                )
                boxes[name] = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            else:
                boxes[name] = None
        if file_sha256(self.path) != self.digest:  # verified before a byte of it is used
            raise CheckpointError(f"{self.path}: its sha256 is not the {self.digest} rank 0 wrote")
        with torch.no_grad():
            for name, value in read_slices(self.path, boxes):
                mine = local(targets[name])
                if tuple(mine.shape) != tuple(value.shape):
                    found, expected = tuple(value.shape), tuple(mine.shape)
                    raise CheckpointError(f"{self.path}: {name} is {found}, this rank's part {expected}")
                mine.copy_(value)
