"""Resharding loads: a rank's part of a checkpoint written by another layout (unsharded, sharded
over another world size, or in other HSDP shard groups), read by verified byte ranges
(``train.ranged``).

FSDP2 shards dim 0: a rank's shard of a tensor is a run of rows, which lies in one or more of the
old files (the shards of a sharded checkpoint, in rank order, each at its offset; or the one
whole file of an unsharded checkpoint). A rank reads exactly the bytes of those rows, plus at most
one block at each end of each range and each file's header block, every block checked against its
signed digest. A whole (unsharded) target reads every row: that is FSDP -> DDP.

Example (the seed checkpoint a meta-device build loads, one verified tensor file)::

    read = load_model_part(model, directory, manifest)   # manifest: signature-checked
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from govray.core.canonical import file_sha256
from govray.core.keys import TrustConfig
from govray.governance.adapters import GovernedModel
from govray.train.checkpoints.files import (
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    STATE_FILE,
    CheckpointError,
    CheckpointState,
    LoadedCheckpoint,
    Manifest,
    shard_file,
    sharding_layout,
    verify_checkpoint,
)
from govray.train.checkpoints.ranged import VerifiedFile, verified_file
from govray.train.parallel.fsdp import SHARDS_KEY, copy_in, is_sharded, local


class CheckpointTensors:
    """The tensors of one kind (``model`` or ``optimizer``) of a checkpoint: one whole file, or
    the shard files of a sharded checkpoint, read by verified ranges: those of its ``world``
    ranks, or of an HSDP checkpoint's first ``shard_group`` ranks (its first replica: every row
    once; the other replicas' files are copies of them)."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        kind: str,
        world: int | None,
        shard_group: int | None = None,
    ) -> None:
        whole = {"model": MODEL_FILE, "optimizer": OPTIMIZER_TENSORS}[kind]
        ranks = range(shard_group or world or 0)
        names = [whole] if world is None else [shard_file(kind, rank, world) for rank in ranks]
        self.files: list[VerifiedFile] = [
            verified_file(directory, name, manifest.files, manifest.blocks) for name in names
        ]

    @property
    def bytes_read(self) -> int:
        """Bytes read from storage so far, over every file (each verified)."""
        return sum(file.bytes_read for file in self.files)

    def names(self) -> set[str]:
        """Every tensor name the files hold."""
        return {name for file in self.files for name in file.shapes()}

    def part(self, name: str, shape: Sequence[int], start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` of global ``shape`` (a 0-d tensor whole)."""
        pieces = self._pieces(name, tuple(shape))
        if not shape:
            file, _, _ = pieces[0]
            return file.rows(name, 0, 0)
        parts = [
            file.rows(name, max(start, offset) - offset, min(stop, offset + rows) - offset)
            for file, offset, rows in pieces
            if max(start, offset) < min(stop, offset + rows)
        ]
        if not parts:
            file, _, _ = pieces[0]
            return file.rows(name, 0, 0).new_empty((0, *shape[1:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _pieces(self, name: str, shape: tuple[int, ...]) -> list[tuple[VerifiedFile, int, int]]:
        """(file, first row, rows) of each file's piece of ``name``; a tensor every file holds
        whole is one piece of the first file."""
        held = [(file, file.shapes()[name]) for file in self.files if name in file.shapes()]
        if not held:
            raise CheckpointError(f"{self.files[0].path.parent}: no file holds {name}")
        if not shape or all(found == shape for _, found in held) or len(held) == 1:
            file, found = held[0]
            if found != shape:
                raise CheckpointError(f"{file.path}: {name} has shape {found}, the model's is {shape}")
            return [(file, 0, shape[0] if shape else 0)]
        pieces, offset = [], 0
        for file, found in held:
            placed = json.loads(file.metadata().get(SHARDS_KEY, "{}")).get(name)
            start = int(placed[1][0]) if placed else offset  # (optimizer shards: in rank order)
            if found[1:] != shape[1:] or (placed and any(placed[1][1:])):
                raise CheckpointError(f"{file.path}: {name} is not sharded along dim 0 of {shape}")
            pieces.append((file, start, found[0]))
            offset = start + found[0]
        if (
            sorted((start, start + rows) for _, start, rows in pieces)[-1][1] != shape[0]
            or sum(rows for _, _, rows in pieces) != shape[0]
        ):
            raise CheckpointError(f"{self.files[0].path.parent}: the shards of {name} do not make {shape}")
        return pieces


def my_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """The rows of ``tensor`` (global) this rank holds: its FSDP shard's, or all of a whole one."""
    if not is_sharded(tensor):
        return 0, tensor.shape[0] if tensor.dim() else 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if any(offset[1:]) or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        raise CheckpointError(f"a shard of shape {tuple(shape)} at {tuple(offset)}: not a dim-0 shard")
    return int(offset[0]), int(offset[0]) + int(shape[0])


def load_model_part(
    model: GovernedModel,
    directory: Path,
    manifest: Manifest,
    world: int | None = None,
    shard_group: int | None = None,
) -> CheckpointTensors:
    """This rank's part of every base tensor of checkpoint ``directory`` (listed by its verified
    manifest; ``world``: the ranks it is sharded over, None: one whole
    ``model.safetensors``; ``shard_group``: an HSDP checkpoint's), read by verified ranges;
    returns the reader (its ``bytes_read``). What a meta-device build calls to load its shards of
    a seed checkpoint."""
    source = CheckpointTensors(directory, manifest, "model", world, shard_group)

    def part(name: str, target: torch.Tensor) -> torch.Tensor:
        return source.part(name, tuple(target.shape), *my_rows(target)).to(local(target).device)

    copy_in(model, source.names(), directory, part)
    return source


def optimizer_order(parameters: Sequence[nn.Parameter], whole: set[int], sharded: bool) -> list[nn.Parameter]:
    """The order a run's optimizer holds ``parameters`` in: as given, or under FSDP the sharded
    ones (all but ``whole``: adapter ids) first (``sharding.optimizer_groups``)."""
    base = [p for p in parameters if id(p) not in whole]
    kept = [p for p in parameters if id(p) in whole]
    return base + kept if sharded and base and kept else list(parameters)


def resharded_optimizer_state(
    directory: Path,
    manifest: Manifest,
    world: int | None,
    optimizer: torch.optim.Optimizer,
    written_order: Sequence[nn.Parameter],
    shard_group: int | None = None,
) -> tuple[dict[str, Any], CheckpointTensors]:
    """This rank's part of the optimizer state of a checkpoint written by another layout, as this
    run's ``optimizer.state_dict()`` holds it (``written_order``: the parameters in the order
    the writing run's optimizer held them); returns it and the reader."""
    source = CheckpointTensors(directory, manifest, "optimizer", world, shard_group)
    meta = json.loads((directory / OPTIMIZER_META).read_text())
    current = optimizer.state_dict()
    mine = [p for group in optimizer.param_groups for p in group["params"]]
    index_of = {id(p): index for index, p in enumerate(mine)}
    if len(written_order) != len(mine):
        raise CheckpointError(
            f"{directory}: optimizer state of {len(written_order)} tensors, this run trains {len(mine)}"
        )
    state: dict[int, dict[str, Any]] = {}
    for written, values in meta["state"].items():
        parameter = written_order[int(written)]
        state[index_of[id(parameter)]] = dict(values)
    for name in sorted(source.names()):
        _, written, key = name.split(".", 2)
        parameter = written_order[int(written)]
        if source.files[0].shapes().get(name, (None,)) == ():
            value = source.part(name, (), 0, 0)  # a scalar (``step``): whole in every file
        else:
            value = source.part(name, tuple(parameter.shape), *my_rows(parameter))
        state.setdefault(index_of[id(parameter)], {})[key] = value
    groups = [
        {**meta["param_groups"][0], **{k: v for k, v in group.items() if k == "params"}}
        for group in current["param_groups"]
    ]
    return {"state": state, "param_groups": groups}, source


def load_resharded(
    directory: Path,
    trust: TrustConfig,
    rank: int,
    model: GovernedModel,
    optimizer: torch.optim.Optimizer,
    parameters: Sequence[nn.Parameter],
    of_run: str | None = None,
) -> LoadedCheckpoint:
    """A checkpoint written by another layout (unsharded, or sharded over another world size),
    as ``load_checkpoint`` returns one: the signature and the shared files verified, this rank's
    part of the optimizer state read by verified ranges (``parameters``: the run's trainable
    tensors in the order it lists them). The weights are read by ``load_model_part``. ``of_run``:
    the run whose checkpoint it must be (``verify_checkpoint``)."""
    manifest, signer = verify_checkpoint(directory, trust, rank, ranged=True, of_run=of_run)
    try:
        state = CheckpointState.model_validate_json((directory / STATE_FILE).read_text())
        world, group = sharding_layout(state.sharding)
        whole = {id(p) for adapter in model.adapter_names() for p in model.adapter_parameters(adapter)}
        written_order = optimizer_order(parameters, whole, sharded=world is not None)
        optimizer_state, _ = resharded_optimizer_state(
            directory, manifest, world, optimizer, written_order, group
        )
    except (ValidationError, json.JSONDecodeError, KeyError, ValueError) as error:
        raise CheckpointError(f"{directory}: signed but unreadable: {error}") from None
    return LoadedCheckpoint(
        directory=directory,
        state=state,
        optimizer_state=optimizer_state,
        manifest_digest=file_sha256(directory / MANIFEST_FILE),
        signer=signer,
        manifest=manifest,
    )
