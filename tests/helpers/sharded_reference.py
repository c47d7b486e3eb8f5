"""The whole base model of a sharded checkpoint put together in memory: the reference the
streamed ``model.safetensors`` (``govray.train.checkpoints.whole_file``) is compared with, byte for byte.
govray itself never holds a whole model in one process (issue 32); tests do, on small models."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from govray.train.checkpoints.files import shard_file
from govray.train.parallel.fsdp import SHARDS_KEY


def consolidated(directory: Path, world_size: int) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded checkpoint ``directory`` put together from its shards at
    their offsets, all in memory."""
    whole: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        path = directory / shard_file("model", rank, world_size)
        with safe_open(str(path), framework="pt") as handle:
            placement = json.loads((handle.metadata() or {}).get(SHARDS_KEY, "{}"))
            for name in handle.keys():  # noqa: SIM118
                part = handle.get_tensor(name)
                if name not in placement:
                    whole.setdefault(name, part)  # a whole tensor, the same in every rank's file
                    continue
                shape, offset = placement[name]
                target = whole.setdefault(name, torch.empty(shape, dtype=part.dtype))
                index = tuple(
                    slice(start, start + size) for start, size in zip(offset, part.shape, strict=True)
                )
                target[index] = part
    return whole
