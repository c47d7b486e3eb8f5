"""Removable LoRA adapters that never touch the base model's names or forward pass unless active.

``GovernedModel`` wraps the user's model as its child ``base`` (parameter names inside it are
exactly the user's, so ``model.base.state_dict()`` is the base file) and keeps every adapter under
``adapters[NAME][TARGET]`` (``TARGET`` is the Linear module's name with ``.`` replaced by ``__``).
A forward hook on each target Linear adds the adapter's delta only while that adapter is active;
while it is inactive the hook returns ``None``, so the Linear's output is the base output itself
(bit-exact, not ``+ 0``) and the adapter's tensors stay out of the autograd graph.

Adapters are initialised from their own ``torch.Generator``, seeded from (seed, adapter, target),
never from the global RNG: adding or dropping one shifts neither the base nor any other adapter.

Files are safetensors only (no pickle): one for the base, one per adapter. Example::

    base = DigitsMLP(hidden=32, dropout=0.0)        # build the base first
    model = GovernedModel(base, resolve_routes(policy, base), policy.adapters, seed=7)
    with model.active("pii-lora"):
        loss = loss_fn(model(pixels), labels)       # only this batch sees the adapter
    save_base(model, directory / "model.safetensors")
    save_adapter(model, "pii-lora", directory / "pii-lora.safetensors")
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from govray.core.canonical import canonical_json, file_sha256
from govray.core.errors import GovrayError
from govray.governance.policy import AdapterSpec
from govray.governance.routing import RoutingTable, adapter_tensor_names

ADAPTER_FORMAT = "govray-lora-v1"


class AdapterError(GovrayError):
    """An adapter is unknown, or an adapter file does not match the adapter it is loaded into."""

    exit_code = 9


class LoRA(nn.Module):
    """One low-rank adapter on one Linear: ``delta(x) = (alpha / rank) * (x @ A.T) @ B.T``.

    ``lora_A`` is uniform in ``±1/sqrt(in_features)`` (what ``nn.Linear`` uses for its weight),
    drawn from ``generator``; ``lora_B`` is zero, so a fresh adapter changes nothing.
    """

    def __init__(
        self, in_features: int, out_features: int, rank: int, alpha: float, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.rank = rank
        self.alpha = alpha
        bound = 1.0 / math.sqrt(in_features)
        self.lora_A = nn.Parameter(
            torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)
        )
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * (self.alpha / self.rank)


class _LoRAHook:
    """Forward hook on a target Linear: adds the adapter's delta while that adapter is active.

    A small object rather than a closure so a deep copy or pickle of the model copies it along.
    """

    def __init__(self, owner: GovernedModel, adapter: str, key: str) -> None:
        self.owner = owner
        self.adapter = adapter
        self.key = key

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
    ) -> torch.Tensor | None:
        if self.owner.active_adapter != self.adapter:
            return None  # leave the base output untouched
        lora = self.owner.lora(self.adapter, self.key)
        return output + lora(args[0] if args else kwargs["input"])


def _module_key(target: str) -> str:
    return target.replace(".", "__")


def _adapter_seed(seed: int, adapter: str, target: str) -> int:
    digest = hashlib.sha256(canonical_json(["govray-lora-init", seed, adapter, target])).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits: any torch.Generator accepts it


class GovernedModel(nn.Module):
    """The user's model (child ``base``) and its removable adapters (child ``adapters``).

    ``adapters`` is a ``ModuleDict`` keyed by adapter name, each a ``ModuleDict`` of ``LoRA``
    keyed by target module name with ``.`` replaced by ``__``. One adapter (or none) is active at a
    time; ``forward`` is the base model's forward.
    """

    def __init__(
        self, base: nn.Module, table: RoutingTable, specs: Mapping[str, AdapterSpec], *, seed: int
    ) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict()
        self._active: str | None = None
        self._targets: dict[str, tuple[str, ...]] = {}
        self._specs: dict[str, AdapterSpec] = {}
        self._hooks: dict[str, list[RemovableHandle]] = {}
        for route, adapter in table.adapter_names.items():
            if adapter in self._targets:
                continue  # several routes may name one adapter
            if adapter not in specs:
                raise AdapterError(f"route '{route}' names adapter '{adapter}', which has no spec")
            self._add_adapter(adapter, table.adapter_targets[route], specs[adapter], seed)

    def _add_adapter(self, adapter: str, targets: tuple[str, ...], spec: AdapterSpec, seed: int) -> None:
        if not adapter or "." in adapter:
            raise AdapterError(f"adapter name '{adapter}' must be non-empty and contain no '.'")
        modules = nn.ModuleDict()
        linears: list[tuple[str, nn.Linear]] = []
        for target in targets:
            try:
                linear = self.base.get_submodule(target)
            except AttributeError:
                linear = None
            if not isinstance(linear, nn.Linear):
                raise AdapterError(
                    f"adapter '{adapter}': target '{target}' is not a Linear module of the model"
                )
            key = _module_key(target)
            if key in modules:
                raise AdapterError(f"adapter '{adapter}': targets collide on module key '{key}'")
            generator = torch.Generator().manual_seed(_adapter_seed(seed, adapter, target))
            lora = LoRA(linear.in_features, linear.out_features, spec.rank, spec.alpha, generator)
            # Drawn on the CPU in float32, then placed like the base weight: init is device-independent.
            modules[key] = lora.to(device=linear.weight.device, dtype=linear.weight.dtype)
            linears.append((key, linear))
        self.adapters[adapter] = modules
        self._targets[adapter] = targets
        self._specs[adapter] = spec
        self._hooks[adapter] = [
            linear.register_forward_hook(_LoRAHook(self, adapter, key), with_kwargs=True)
            for key, linear in linears
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.base(*args, **kwargs)

    def _require(self, adapter: str) -> None:
        if adapter not in self._targets:
            known = ", ".join(self._targets) or "none"
            raise AdapterError(f"model has no adapter '{adapter}' (adapters: {known})")

    def activate(self, adapter: str | None) -> None:
        """Make ``adapter`` the only active adapter, or (``None``) run the bare base model."""
        if adapter is not None:
            self._require(adapter)
        self._active = adapter

    @contextmanager
    def active(self, adapter: str | None) -> Iterator[None]:
        """Activate ``adapter`` for the block, then restore the previously active one."""
        previous = self._active
        self.activate(adapter)
        try:
            yield
        finally:
            self._active = previous

    @property
    def active_adapter(self) -> str | None:
        """The adapter whose delta the forward pass adds, or ``None``."""
        return self._active

    def adapter_names(self) -> tuple[str, ...]:
        """The adapters this model holds, in routing-table order."""
        return tuple(self._targets)

    def adapter_targets(self, adapter: str) -> tuple[str, ...]:
        """The base Linear modules ``adapter`` wraps, in routing-table order."""
        self._require(adapter)
        return self._targets[adapter]

    def adapter_spec(self, adapter: str) -> AdapterSpec:
        """The policy's declaration of ``adapter`` (targets, rank, alpha)."""
        self._require(adapter)
        return self._specs[adapter]

    def lora(self, adapter: str, key: str) -> LoRA:
        """The ``LoRA`` of ``adapter`` on the target whose module key (``.`` → ``__``) is ``key``."""
        modules = self.adapters[adapter]
        assert isinstance(modules, nn.ModuleDict)
        lora = modules[key]
        assert isinstance(lora, LoRA)
        return lora

    def _loras(self, adapter: str) -> list[tuple[str, LoRA]]:
        self._require(adapter)
        return [(target, self.lora(adapter, _module_key(target))) for target in self._targets[adapter]]

    def adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        """``lora_A``, ``lora_B`` of each target, in target order (what the adapter route trains)."""
        return [param for _, lora in self._loras(adapter) for param in (lora.lora_A, lora.lora_B)]

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors (detached) under their ledger names ``adapter/NAME/TARGET.lora_A|B``."""
        tensors: dict[str, torch.Tensor] = {}
        for target, lora in self._loras(adapter):
            name_a, name_b = adapter_tensor_names(adapter, target)
            tensors[name_a] = lora.lora_A.detach()
            tensors[name_b] = lora.lora_B.detach()
        return tensors

    def base_state(self) -> dict[str, torch.Tensor]:
        """The base model's ``state_dict``, under the user's own names."""
        return dict(self.base.state_dict())

    def drop_adapter(self, adapter: str) -> None:
        """Remove ``adapter``'s modules and hooks; the base model is untouched."""
        self._require(adapter)
        for handle in self._hooks.pop(adapter):
            handle.remove()
        del self.adapters[adapter]
        del self._targets[adapter]
        del self._specs[adapter]
        if self._active == adapter:
            self._active = None


def _write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> str:
    """Write a safetensors file with canonical bytes; return its sha256.

    safetensors writes ``__metadata__`` in hash-map order, which changes from process to process;
    the header is rewritten in place with sorted metadata keys (same length), so equal tensors and
    metadata always give equal bytes.
    """
    save_file(dict(tensors), str(path), metadata=metadata)
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
    return _write_safetensors(tensors, path, metadata)


def save_base(model: GovernedModel, path: Path) -> str:
    """Write the base model's state (its own names) to a safetensors file; return its sha256.

    safetensors refuses tensors that share storage. A tied tensor (embedding and LM head) is
    stored under every name it has: the first name in ``state_dict`` order keeps the tensor, later
    names hold a copy, so the file reloads with ``load_state_dict(strict=True)``. Adapters never
    enter this file, so its digest does not depend on which adapters exist.
    """
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.base_state().items():
        stored = tensor.detach().cpu()
        storage = stored.untyped_storage().data_ptr()
        if storage in seen or not stored.is_contiguous():
            stored = stored.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
        tensors[name] = stored
    return _write_safetensors(tensors, path, {})


def _read_adapter_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as error:
        raise AdapterError(f"adapter file {path}: not a readable safetensors file: {error}") from None
    return metadata, tensors


def load_adapter(model: GovernedModel, adapter: str, path: Path) -> None:
    """Load ``adapter``'s tensors from ``path``; refuse a file that does not match, naming the tensor."""
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
