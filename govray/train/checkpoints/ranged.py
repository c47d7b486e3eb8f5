"""Verified byte-range reads of a checkpoint's safetensors files.

A rank that resumes on another world size (or strategy) needs a few rows of each tensor, which
lie in byte ranges of one or more files. ``VerifiedFile`` reads a range by reading the blocks that
cover it, checking each against the file's signed block digests (``train.blocks``) and slicing;
a block is hashed once however many ranges it serves. A file without block digests (the frozen
base a checkpoint refers to by its sha256: ``train.checkpoints.base_file``) is verified whole
against the manifest's sha256 on first use, then read by ranges. Every byte handed out has been
verified; ``bytes_read`` counts what was read from storage.

Example::

    files = verified_files(directory, manifest.files)       # manifest: already signature-checked
    rows = files["model.safetensors"].rows("base.embed.weight", 16, 32)
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from govray.core.canonical import file_sha256
from govray.train.checkpoints.blocks import BlockDigests, blocks_name
from govray.train.checkpoints.files import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {  # a safetensors header's dtype names
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header


class VerifiedFile:
    """One safetensors file of a checkpoint, read by verified ranges (see the module)."""

    def __init__(self, path: Path, sha256: str, blocks: BlockDigests | None) -> None:
        self.path, self.sha256, self.blocks = path, sha256, blocks
        self.bytes_read = 0
        self._verified: dict[int, bytes] = {}  # block index → its verified bytes (the last few)
        self._whole_checked = False
        self._header: tuple[int, dict[str, Any]] | None = None

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the file, every one verified."""
        out = bytearray(stop - start)
        self.read_into(start, memoryview(out))
        return bytes(out)

    def read_into(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``start``, every one verified, a block at a
        time: nothing but ``out`` and one block is held."""
        stop = start + len(out)
        if self.blocks is None:
            self._read_whole_checked(start, out)
            return
        size = self.blocks.block_size
        if not 0 <= start <= stop <= self.blocks.size:
            raise CheckpointError(f"{self.path}: bytes {start}..{stop} lie outside the file (tampered)")
        for index in range(start // size, (stop + size - 1) // size):
            block, first = self._block(index), index * size
            begin, end = max(start, first), min(stop, first + len(block))
            out[begin - start : end - start] = block[begin - first : end - first]

    def _block(self, index: int) -> bytes:
        cached = self._verified.get(index)
        if cached is not None:
            return cached
        assert self.blocks is not None
        size = self.blocks.block_size
        with open(self.path, "rb") as handle:
            handle.seek(index * size)
            data = handle.read(size)
        self.bytes_read += len(data)
        if index >= len(self.blocks.blocks) or hashlib.sha256(data).hexdigest() != self.blocks.blocks[index]:
            raise CheckpointError(
                f"{self.path}: block {index} does not match its signed block digest (tampered)"
            )
        if len(self._verified) >= 4:  # ranges are read in file order: keep only the latest blocks
            self._verified.pop(next(iter(self._verified)))
        self._verified[index] = data
        return data

    def _read_whole_checked(self, start: int, out: memoryview) -> None:
        if not self._whole_checked:
            self.bytes_read += self.path.stat().st_size
            if file_sha256(self.path) != self.sha256:
                raise CheckpointError(f"{self.path}: sha256 does not match the signed manifest (tampered)")
            self._whole_checked = True
        with open(self.path, "rb") as handle:
            handle.seek(start)
            if handle.readinto(out) != len(out):
                raise CheckpointError(f"{self.path}: ends before byte {start + len(out)} (truncated)")
        self.bytes_read += len(out)

    def header(self) -> tuple[int, dict[str, Any]]:
        """(where the tensor data begins, the safetensors header), verified."""
        if self._header is None:
            signed = self.blocks.header if self.blocks is not None else None
            read = self._read_signed_header if signed is not None else self.read
            (length,) = struct.unpack("<Q", read(0, 8))
            if length > _HEADER_LIMIT:
                raise CheckpointError(f"{self.path}: a header of {length} bytes (not a safetensors file)")
            try:
                header = json.loads(read(8, 8 + length))
            except ValueError:
                raise CheckpointError(f"{self.path}: unreadable safetensors header") from None
            self._header = (8 + length, header)
        return self._header

    def _read_signed_header(self, start: int, stop: int) -> bytes:
        """Bytes of the header (``[0, 8)``: its length, then ``[8, 8 + length)``), checked
        against its own signed digest as a whole: a rank reads no block only for a header."""
        with open(self.path, "rb") as handle:
            prefix = handle.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
            data = prefix + handle.read(min(length, _HEADER_LIMIT))
        self.bytes_read += len(data)
        assert self.blocks is not None
        if hashlib.sha256(data).hexdigest() != self.blocks.header:
            raise CheckpointError(f"{self.path}: its header does not match its signed digest (tampered)")
        return data[start:stop]

    def metadata(self) -> dict[str, str]:
        """The file's ``__metadata__`` (its writer's notes: a shard's placement)."""
        return dict(self.header()[1].get("__metadata__") or {})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape in this file, by name."""
        _, header = self.header()
        return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (along dim 0) of tensor ``name`` of this file; a 0-d tensor whole."""
        data_start, header = self.header()
        entry = header.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}: holds no tensor {name!r}")
        dtype, shape = SAFETENSORS_DTYPES.get(entry["dtype"]), tuple(entry["shape"])
        if dtype is None:
            raise CheckpointError(f"{self.path}: {name} has dtype {entry['dtype']}, not one govray writes")
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        if shape:
            if not 0 <= start <= stop <= shape[0]:
                raise CheckpointError(f"{self.path}: {name} has {shape[0]} rows, not {start}..{stop}")
            row = (end - begin) // max(shape[0], 1)
            begin, end, shape = begin + start * row, begin + stop * row, (stop - start, *shape[1:])
        value = torch.empty(shape, dtype=dtype)
        if value.nbytes != end - begin:
            raise CheckpointError(f"{self.path}: {name}'s bytes do not fit its shape and dtype")
        if value.nbytes:  # read straight into the tensor's memory
            self.read_into(begin, value.view(-1).view(torch.uint8).numpy().data)
        return value


def verified_file(
    directory: Path, name: str, files: Mapping[str, str], blocks: Mapping[str, BlockDigests] | None = None
) -> VerifiedFile:
    """File ``name`` of a checkpoint whose signed manifest lists ``files`` (name → sha256) and
    ``blocks`` (the block digests it signed), read through its block digests when the manifest has
    them (or lists a side file ``NAME.blocks.json`` holding them, checked whole here: a seed
    file's), else verified whole on first read."""
    if name not in files:
        raise CheckpointError(f"{directory / name}: not listed in the signed manifest")
    if blocks and name in blocks:
        return VerifiedFile(directory / name, files[name], blocks[name])
    side = blocks_name(name)
    if side not in files:
        return VerifiedFile(directory / name, files[name], None)
    path = directory / side
    try:
        payload = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: listed in the signed manifest but missing") from None
    if hashlib.sha256(payload).hexdigest() != files[side]:
        raise CheckpointError(f"{path}: sha256 does not match the signed manifest (tampered)")
    try:
        digests = BlockDigests.model_validate_json(payload)
    except ValidationError:
        raise CheckpointError(f"{path}: signed but unreadable") from None
    return VerifiedFile(directory / name, files[name], digests)
