"""Block digests: what lets a rank verify a byte range of a checkpoint file without reading the
whole file.

A file's sha256 in the signed manifest verifies the file only when every byte of it is read. A
rank that resumes on another world size reads a few byte ranges of many files (``train.ranged``),
so for each tensor file a checkpoint's ranks may read by ranges (model and optimizer, whole or
sharded) the signed manifest also lists the sha256 of each ``block_size`` block of it
(``Manifest.blocks``), computed by the sealer in the pass that hashes the file
(``train.checkpoints.sealing``): a block read and hashed is as trusted as the whole file. A seed
checkpoint's file keeps them in a side file ``NAME.blocks.json`` its own manifest lists
(``write_blocks``). A frozen base a checkpoint refers to by digest has none: its readers verify it
whole.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

BLOCK_SIZE = 1 << 20  # 1 MiB: a ranged read costs at most one more block at each end
BLOCKS_SUFFIX = ".blocks.json"


class BlockDigests(BaseModel):
    """``NAME.blocks.json``: the sha256 of every ``block_size`` block of file NAME, in order
    (the last block may be shorter), and the file's size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(gt=0)
    size: int = Field(ge=0)
    blocks: list[str]
    # sha256 of the safetensors header (its 8-byte length and the JSON): a rank that needs only
    # the header (which tensors a file holds, where) reads it, not a whole block
    header: str | None = None


def blocks_name(name: str) -> str:
    """The side file holding the block digests of file ``name``."""
    return name + BLOCKS_SUFFIX


def file_digests(path: Path, block_size: int | None = None) -> tuple[str, BlockDigests]:
    """A file's sha256 and its block digests (``block_size``, by default ``BLOCK_SIZE``), in one
    pass over it."""
    block_size = block_size or BLOCK_SIZE
    whole = hashlib.sha256()
    blocks: list[str] = []
    size = 0
    with open(path, "rb") as handle:
        while block := handle.read(block_size):
            whole.update(block)
            blocks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    return whole.hexdigest(), BlockDigests(
        block_size=block_size, size=size, blocks=blocks, header=_header_digest(path, size)
    )


def _header_digest(path: Path, size: int) -> str | None:
    """sha256 of a safetensors file's header (None: not one)."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else size
        if 8 + length > size:
            return None
        return hashlib.sha256(prefix + handle.read(length)).hexdigest()


def write_blocks(path: Path, block_size: int | None = None) -> dict[str, str]:
    """Hash ``path`` and write its block digests beside it; returns the sha256 of both files by
    name (what the signed manifest lists)."""
    digest, blocks = file_digests(path, block_size)
    side = path.with_name(blocks_name(path.name))
    side.unlink(missing_ok=True)  # (a killed attempt's, maybe a hard link): never write through it
    payload = json.dumps(blocks.model_dump(), separators=(",", ":")).encode()
    side.write_bytes(payload)
    return {path.name: digest, side.name: hashlib.sha256(payload).hexdigest()}
