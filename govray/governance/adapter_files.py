"""Adapter and base model files: safetensors only (no pickle), canonical bytes.

One file for the base (``save_base``: the user's tensor names; its digest never depends on which
adapters exist) and one per adapter (``save_adapter``, format ``govray-lora-v1``, ledger names:
what checkpoints and attestations hold). Example::

    save_base(model, directory / "model.safetensors")
    save_adapter(model, "pii-lora", directory / "adapter-pii-lora.safetensors")
    load_adapter(model, "pii-lora", directory / "adapter-pii-lora.safetensors")  # AdapterError: no fit
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from govray.core.canonical import file_sha256
from govray.core.storage import as_created
from govray.governance.adapters import AdapterError, GovernedModel
from govray.governance.routing import adapter_tensor_names

ADAPTER_FORMAT = "govray-lora-v1"


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> str:
    """Write a safetensors file with canonical bytes; return its sha256.

    safetensors writes ``__metadata__`` in hash-map order, which changes from process to process;
    the header is rewritten in place with sorted metadata keys (same length), so equal tensors and
    metadata always give equal bytes.
    """
    save_file(dict(tensors), str(path), metadata=metadata)
    as_created(path)  # (safetensors writes 0600)
    with open(path, "r+b") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        assert len(text) <= length, "reordering metadata keys never lengthens the header"
        handle.seek(8)
        handle.write(text.ljust(length, b" "))
    return file_sha256(path)


def save_adapter(model: GovernedModel, adapter: str, path: Path) -> str:
    """Write ``adapter``'s tensors (ledger names) to a safetensors file; return its sha256."""
    spec = model.adapter_spec(adapter)
    tensors = {name: tensor.cpu().contiguous() for name, tensor in model.adapter_tensors(adapter).items()}
    metadata = {
        "adapter": adapter,
        "format": ADAPTER_FORMAT,
        "rank": str(spec.rank),
        "alpha": str(spec.alpha),
    }
    if spec.dropout:
        metadata["dropout"] = str(spec.dropout)  # absent at 0: files from before dropout keep their bytes
    return write_safetensors(tensors, path, metadata)


def save_base(model: GovernedModel, path: Path) -> str:
    """Write the base model's state (its own names) to a safetensors file; return its sha256.

    safetensors refuses tensors that share storage. A tied tensor (embedding and LM head) is
    stored under every name it has: the first name in ``state_dict`` order keeps the tensor, later
    names hold a copy, so the file reloads with ``load_state_dict(strict=True)``. Adapters never
    enter this file, so its digest does not depend on which adapters exist.
    """
    return save_base_tensors(model.base_state(), path)


def save_base_tensors(state: Mapping[str, torch.Tensor], path: Path) -> str:
    """``save_base``'s file from a base state (the user's names; what a sharded checkpoint's
    shards put together give): the same bytes for the same tensors."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        stored = tensor.detach().cpu()
        storage = stored.untyped_storage().data_ptr()
        if storage in seen or not stored.is_contiguous():
            stored = stored.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
        tensors[name] = stored
    return write_safetensors(tensors, path, {})


def _read_adapter_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as error:
        raise AdapterError(f"adapter file {path}: not a readable safetensors file: {error}") from None
    return metadata, tensors


def load_adapter(model: GovernedModel, adapter: str, path: Path) -> None:
    """Load ``adapter``'s tensors from a ``save_adapter`` file (format ``govray-lora-v1``: what
    checkpoints hold, before and after adapters became PEFT layers — same tensors, same math);
    refuse a file that does not match, naming the tensor."""
    expected = model.adapter_tensors(adapter)
    spec = model.adapter_spec(adapter)
    metadata, tensors = _read_adapter_file(path)
    if metadata.get("format") != ADAPTER_FORMAT or metadata.get("adapter") != adapter:
        raise AdapterError(
            f"adapter file {path}: metadata says format '{metadata.get('format')}', adapter "
            f"'{metadata.get('adapter')}'; expected format '{ADAPTER_FORMAT}', adapter '{adapter}'"
        )
    if metadata.get("alpha") != str(spec.alpha):
        raise AdapterError(
            f"adapter file {path}: alpha {metadata.get('alpha')} does not match the policy's {spec.alpha}"
        )
    for name, current in expected.items():
        if name not in tensors:
            raise AdapterError(f"adapter file {path}: missing tensor '{name}'")
        if tensors[name].shape != current.shape:
            raise AdapterError(
                f"adapter file {path}: tensor '{name}' has shape {tuple(tensors[name].shape)}, "
                f"expected {tuple(current.shape)}"
            )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise AdapterError(f"adapter file {path}: unexpected tensor '{unexpected[0]}'")
    with torch.no_grad():
        for name, current in expected.items():
            current.copy_(tensors[name])


def read_adapter_factors(
    path: Path, adapter: str, targets: Sequence[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each target's ``(A, B)`` from an adapter file govray wrote (``save_adapter``), refusing
    a file of another adapter or format, or one that lacks a target's tensors."""
    metadata, tensors = _read_adapter_file(path)
    if metadata.get("adapter") != adapter or metadata.get("format") != ADAPTER_FORMAT:
        raise AdapterError(
            f"adapter file {path}: metadata says format '{metadata.get('format')}', adapter "
            f"'{metadata.get('adapter')}'; expected format '{ADAPTER_FORMAT}', adapter '{adapter}'"
        )
    factors = {}
    for target in targets:
        name_a, name_b = adapter_tensor_names(adapter, target)
        if name_a not in tensors or name_b not in tensors:
            raise AdapterError(f"adapter file {path}: no tensors for target '{target}'")
        factors[target] = (tensors[name_a], tensors[name_b])
    return factors
