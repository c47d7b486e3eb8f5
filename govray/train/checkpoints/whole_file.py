"""The whole base model of a sharded checkpoint, put together only where a consumer needs it, and
streaming: no process ever holds the whole model.

A sharded (``resources.strategy: fsdp``) checkpoint holds each rank's model shard file and the
signed manifest, never ``model.safetensors``. A consumer that needs the whole model — the digest an
attestation or the registry records, a model version's own file, a replay's comparison — gets it
from here, read from the shards' byte ranges after each shard file is checked against the signed
manifest (a changed shard is refused, naming it). The file this writes is byte for byte what
``save_base_tensors`` writes for the same tensors (so its sha256 is the one a whole checkpoint of
the same weights records): the safetensors header is built from the shard files' headers first,
then each tensor's bytes are copied from the shards in order, ``CHUNK`` bytes at a time.

Example::

    digest = whole_model_sha256(checkpoint, trust)                 # nothing written
    write_whole_model(checkpoint, trust, version / MODEL_FILE)     # the same sha256
    for name, tensor in whole_tensors(checkpoint, trust): ...      # one tensor at a time
    for name, tensor in base_tensors(checkpoint, trust): ...       # any checkpoint's base
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import save

from govray.core.canonical import file_sha256
from govray.core.keys import TrustConfig
from govray.train.checkpoints.files import CheckpointError, model_file, signed_manifest
from govray.train.checkpoints.ranged import SAFETENSORS_DTYPES
from govray.train.parallel.fsdp import SHARDS_KEY

CHUNK = 8 << 20  # bytes copied at a time: the buffer a consumer holds besides (at most) one tensor
_MODEL_SHARD = re.compile(r"^model-shard-(\d{5})-of-(\d{5})\.safetensors$")  # a checkpoint's own, not clean-*


@dataclass(frozen=True)
class Piece:
    """A byte range of a shard file: one shard of a tensor (or a whole tensor)."""

    path: Path
    start: int
    length: int


@dataclass(frozen=True)
class WholeTensor:
    """A tensor of the whole model and the shard byte ranges that, in order, are its bytes."""

    name: str
    dtype: str  # safetensors' name: F32, BF16...
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(piece.length for piece in self.pieces)


def shards_only(directory: Path) -> bool:
    """Whether ``directory`` is a sharded checkpoint: model shard files, no whole model file."""
    shards = any(_MODEL_SHARD.match(path.name) for path in directory.iterdir())
    return shards and not model_file(directory).is_file()


def base_sha256(directory: Path, trust: TrustConfig) -> str:
    """The sha256 of a checkpoint's base model file: its own (or the run's base file it refers
    to), or, of a sharded checkpoint, the file its shards put together would be (nothing written)."""
    if shards_only(directory):
        return whole_model_sha256(directory, trust)
    return file_sha256(model_file(directory))


def whole_model_sha256(directory: Path, trust: TrustConfig) -> str:
    """The sha256 of ``model.safetensors`` as the verified shards of ``directory`` put it together."""
    digest = hashlib.sha256()
    _stream(verified_layout(directory, trust), digest.update)
    return digest.hexdigest()


def write_whole_model(directory: Path, trust: TrustConfig, path: Path) -> str:
    """Write ``model.safetensors`` from the verified shards of ``directory`` to ``path``, streaming;
    returns its sha256."""
    tensors, digest = verified_layout(directory, trust), hashlib.sha256()  # (nothing written if refused)
    with open(path, "wb") as out:

        def write(data: bytes | memoryview) -> None:
            out.write(data)
            digest.update(data)

        _stream(tensors, write)
    return digest.hexdigest()


def whole_tensors(directory: Path, trust: TrustConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Each base tensor of the verified shards of ``directory``, whole, one at a time (name order)."""
    for tensor in sorted(verified_layout(directory, trust), key=lambda t: t.name):
        data = bytearray(tensor.nbytes)
        view, at = memoryview(data), 0
        for piece in tensor.pieces:
            with open(piece.path, "rb") as handle:
                handle.seek(piece.start)
                _read_exactly(handle, view[at : at + piece.length], piece.path)
            at += piece.length
        dtype = _torch_dtype(tensor)
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        yield tensor.name, flat.reshape(tensor.shape)


def base_tensors(directory: Path, trust: TrustConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Each base tensor of a checkpoint, one at a time in name order: from its base file (its own
    or the one it refers to; verified by the caller), or from its verified shards."""
    if shards_only(directory):
        yield from whole_tensors(directory, trust)
        return
    yield from file_tensors(model_file(directory))


def file_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file, one at a time in name order."""
    with safe_open(str(path), framework="pt") as handle:
        for name in sorted(handle.keys()):
            yield name, handle.get_tensor(name)


def verified_layout(directory: Path, trust: TrustConfig) -> list[WholeTensor]:
    """The whole model's tensors as byte ranges of the shard files, each shard file first checked
    against the signed manifest (refused, naming it, when changed or missing)."""
    signed = signed_manifest(directory, trust)[0].files
    shards = sorted(name for name in signed if _MODEL_SHARD.match(name))
    if not shards:
        raise CheckpointError(f"{directory}: the signed manifest lists no model shard files")
    for name in shards:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the signed manifest but missing")
        if file_sha256(path) != signed[name]:
            raise CheckpointError(f"{path}: sha256 does not match the signed manifest (tampered)")
    return shard_layout([directory / name for name in shards])


def shard_layout(paths: list[Path]) -> list[WholeTensor]:
    """Where each whole tensor's bytes lie in these shard files (read from their headers only).
    Shards split a tensor along its first dimension (FSDP's ``Shard(0)``): its rows, in offset
    order, are the whole tensor's bytes; a shard seen twice (a replicated group's copy) is read
    once; a tensor without a placement is whole in every file and read from the first."""
    rows: dict[str, dict[int, tuple[int, Piece]]] = {}  # name → first row → (rows, bytes)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}  # name → (dtype, whole shape)
    for path in paths:
        header, data_start = _header(path)
        placement = json.loads(header.get("__metadata__", {}).get(SHARDS_KEY, "{}"))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            local = tuple(info["shape"])
            shape, offset = placement.get(name, [local, [0] * len(local)])
            if any(offset[1:]) or tuple(shape[1:]) != local[1:]:
                raise CheckpointError(f"{path}: {name} is not sharded along its first dimension")
            if found.setdefault(name, (info["dtype"], tuple(shape))) != (info["dtype"], tuple(shape)):
                raise CheckpointError(f"{path}: {name} has another dtype or shape than in the other shards")
            if not local or local[0] or name not in placement:  # (an empty shard adds nothing)
                first = offset[0] if local else 0
                piece = Piece(path, data_start + begin, end - begin)
                rows.setdefault(name, {}).setdefault(first, (local[0] if local else 1, piece))
    return [_whole(name, dtype, shape, rows.get(name, {})) for name, (dtype, shape) in found.items()]


def _whole(
    name: str, dtype: str, shape: tuple[int, ...], shards: Mapping[int, tuple[int, Piece]]
) -> WholeTensor:
    """The tensor from its shards (first row → (rows, bytes)), refused unless they tile it."""
    at = 0
    for first in sorted(shards):
        if first != at:
            raise CheckpointError(f"the shards of {name} do not cover it: rows {at}..{first} are missing")
        at += shards[first][0]
    rows = shape[0] if shape else 1
    if at != rows:
        raise CheckpointError(f"the shards of {name} do not cover it: {at} of {rows} rows")
    return WholeTensor(name, dtype, shape, tuple(shards[first][1] for first in sorted(shards)))


def _stream(tensors: list[WholeTensor], write: Callable[[bytes | memoryview], Any]) -> None:
    """``model.safetensors``'s bytes, in order, handed to ``write``: the header, then each tensor's
    bytes copied from its shards ``CHUNK`` bytes at a time."""
    ordered = _file_order(tensors)
    write(_file_header(ordered))
    buffer = memoryview(bytearray(CHUNK))
    for tensor in ordered:
        for piece in tensor.pieces:
            with open(piece.path, "rb") as handle:
                handle.seek(piece.start)
                left = piece.length
                while left:
                    part = buffer[: min(left, CHUNK)]
                    _read_exactly(handle, part, piece.path)
                    write(part)
                    left -= len(part)


def _file_order(tensors: list[WholeTensor]) -> list[WholeTensor]:
    """The order safetensors lays tensors out in (by dtype, then name: whatever its version
    does), asked of safetensors itself with empty tensors of the same names and dtypes."""
    empty = {tensor.name: torch.empty(0, dtype=_torch_dtype(tensor)) for tensor in tensors}
    header, _ = _parse_header(save(empty, metadata={}))
    by_name = {tensor.name: tensor for tensor in tensors}
    return [by_name[name] for name in header if name != "__metadata__"]


def _file_header(ordered: list[WholeTensor]) -> bytes:
    """The 8-byte length and the JSON header ``save_base_tensors`` writes for these tensors:
    compact JSON, empty metadata first, padded with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {"__metadata__": {}}
    at = 0
    for tensor in ordered:
        header[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [at, at + tensor.nbytes],
        }
        at += tensor.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text = text.ljust(-(-len(text) // 8) * 8, b" ")
    return len(text).to_bytes(8, "little") + text


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and where its data begins."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            return json.loads(handle.read(length)), 8 + length
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file: {error}") from None


def _parse_header(data: bytes) -> tuple[dict[str, Any], int]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), 8 + length


def _read_exactly(handle: BinaryIO, into: memoryview, path: Path) -> None:
    done = 0
    while done < len(into):
        count = handle.readinto(into[done:])  # type: ignore[attr-defined]
        if not count:
            raise CheckpointError(f"{path}: shorter than its header says (truncated)")
        done += count


def _torch_dtype(tensor: WholeTensor) -> torch.dtype:
    if tensor.dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{tensor.name}: dtype {tensor.dtype} is not one govray reads")
    return SAFETENSORS_DTYPES[tensor.dtype]
