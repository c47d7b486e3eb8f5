"""Removable adapters: LoRA layers in the user's model, gated by govray.

``GovernedModel`` wraps the user's model as its child ``base``. Each adapter target (an
``nn.Linear``, ``nn.Embedding`` or transformers ``Conv1D``) is replaced in place by a LoRA layer
around it (``govray.governance.lora``: PEFT's layout and arithmetic, without importing PEFT), so
``PeftModel.from_pretrained`` reads what govray saves. The wrapper renames a wrapped
module's tensors (``hidden.weight`` → ``hidden.base_layer.weight``); govray never shows that
name: ``base_named_parameters()``, ``base_state()`` and the base file use the user's names,
``adapter_tensors()`` the ledger names ``adapter/NAME/TARGET.lora_A|B``, and
``GovernedModel.state_dict()`` keeps govray's own keys (``base.USER_NAME``,
``adapters.NAME.TARGET__KEY.lora_A|B``).

The gating is govray's: one adapter (or none) is active, set on every LoRA layer's active-adapter
list; ``requires_grad`` never changes with it (DDP must never see it flip).
An inactive layer returns its base layer's output tensor itself (bit-exact, not ``+ 0``) and its
adapter tensors stay out of the autograd graph. Adapters are initialised after the base from their
own ``torch.Generator``, seeded from (seed, adapter, target); the global RNG is left as it was.

Files are safetensors only (no pickle): one for the base, one per adapter
(``govray.governance.adapter_files``), and PEFT's directory layout for other tools
(``govray.governance.peft_format``). Example::

    base = DigitsMLP(hidden=32, dropout=0.0)        # build the base first
    model = GovernedModel(base, resolve_routes(policy, base), policy.adapters, seed=7)
    with model.active("pii-lora"):
        loss = loss_fn(model(pixels), labels)       # only this batch sees the adapter
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from govray.core.canonical import canonical_json
from govray.core.errors import GovrayError
from govray.governance.lora import LoraLayer, wrap_target
from govray.governance.policy import AdapterSpec
from govray.governance.routing import RoutingTable, adapter_tensor_names, lora_target_kind

_WRAPPED = ".base_layer."  # where a LoRA layer (as PEFT's) puts a wrapped module's own tensors


class AdapterError(GovrayError):
    """An adapter is unknown, or an adapter file does not match the adapter it is loaded into."""

    exit_code = 9


def _adapter_seed(seed: int, adapter: str, target: str) -> int:
    digest = hashlib.sha256(canonical_json(["govray-lora-init", seed, adapter, target])).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits: any torch.Generator accepts it


def _initial_factors(
    kind: str, rank: int, in_features: int, out_features: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh adapter's ``(A, B)``, drawn on the CPU in float32 (device-independent), its delta zero.

    Linear and Conv1D: ``A`` uniform in ``±1/sqrt(in_features)`` (``nn.Linear``'s and PEFT's
    default), ``B`` zero. Embedding (PEFT's convention): ``A`` zero, ``B`` standard normal.
    """
    if kind == "embedding":
        return torch.zeros(rank, in_features), torch.randn(out_features, rank, generator=generator)
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator), torch.zeros(
        out_features, rank
    )


class GovernedModel(nn.Module):
    """The user's model (child ``base``, LoRA layers injected at the adapter targets).

    One adapter (or none) is active at a time; ``forward`` is the base model's forward.
    ``parameters()`` lists the base tensors in the user's order, then each adapter's ``A, B`` per
    target (the optimizer's and the governor's order, whatever the LoRA layers' module nesting).
    """

    def __init__(
        self, base: nn.Module, table: RoutingTable, specs: Mapping[str, AdapterSpec], *, seed: int
    ) -> None:
        super().__init__()
        self.base = base
        self._active: str | None = None
        self._targets: dict[str, tuple[str, ...]] = {}
        self._specs: dict[str, AdapterSpec] = {}
        self._layers: dict[str, LoraLayer] = {}  # target → the LoRA layer wrapping it
        self._kinds: dict[str, str] = {}  # target → lora_target_kind of the wrapped module
        self._seed = seed  # of every adapter's initial factors
        for route, adapter in table.adapter_names.items():
            if adapter in self._targets:
                continue  # several routes may name one adapter
            if adapter not in specs:
                raise AdapterError(f"route '{route}' names adapter '{adapter}', which has no spec")
            self._add_adapter(adapter, table.adapter_targets[route], specs[adapter], seed)
        self._gate()
        self.register_state_dict_post_hook(GovernedModel._govray_keys)
        self.register_load_state_dict_pre_hook(GovernedModel._peft_keys)

    # -- building -----------------------------------------------------------------------------

    def _add_adapter(self, adapter: str, targets: tuple[str, ...], spec: AdapterSpec, seed: int) -> None:
        if not adapter or "." in adapter:
            raise AdapterError(f"adapter name '{adapter}' must be non-empty and contain no '.'")
        if len({_module_key(target) for target in targets}) != len(targets):
            raise AdapterError(f"adapter '{adapter}': targets collide on module keys ({', '.join(targets)})")
        for target in targets:
            self._wrap(adapter, target, spec)
        self._targets[adapter] = targets
        self._specs[adapter] = spec
        self._initialise(adapter, seed)

    def _initialise(self, adapter: str, seed: int) -> None:
        for target in self._targets[adapter]:
            kind = self._kinds[target]
            lora_a, lora_b = self._layers[target].factors(adapter)
            generator = torch.Generator().manual_seed(_adapter_seed(seed, adapter, target))
            initial = _initial_factors(
                kind, self._specs[adapter].rank, lora_a.shape[1], lora_b.shape[0], generator
            )
            # float32 whatever the base's dtype: factors, AdamW state and reduction in fp32 (the
            # layer casts its input to the factors' dtype and the sum back, as PEFT's does).
            lora_a.data = initial[0].to(lora_a.device)
            lora_b.data = initial[1].to(lora_b.device)

    def initialise_adapters(self) -> None:
        """Every adapter's factors set to their initial values again: after the model's memory
        was allocated anew (a model built on the meta device, then ``to_empty``)."""
        for adapter in self._targets:
            self._initialise(adapter, self._seed)

    def _wrap(self, adapter: str, target: str, spec: AdapterSpec) -> None:
        """Add ``adapter``'s LoRA to ``target``, wrapping it in a LoRA layer on first use."""
        if target not in self._layers:
            try:
                module: nn.Module | None = self.base.get_submodule(target)
            except AttributeError:
                module = None
            kind = lora_target_kind(module) if module is not None else None
            if module is None or kind is None:
                raise AdapterError(
                    f"adapter '{adapter}': target '{target}' is not a Linear, Embedding or Conv1D "
                    "module of the model"
                )
            layer = wrap_target(module, kind)
            parent, _, child = target.rpartition(".")
            setattr(self.base.get_submodule(parent), child, layer)
            self._layers[target], self._kinds[target] = layer, kind
        self._layers[target].add_adapter(adapter, spec.rank, spec.alpha, spec.dropout)

    def _gate(self) -> None:
        """Make exactly the active adapter's LoRA run: set each layer's active list, and keep every
        adapter tensor trainable, active or not (one ``requires_grad`` set for the whole run)."""
        for layer in self._layers.values():
            layer.active = [self._active] if self._active in layer.adapter_names() else []
        for adapter in self._targets:
            for parameter in self.adapter_parameters(adapter):
                parameter.requires_grad_(True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.base(*args, **kwargs)

    # -- the active adapter ---------------------------------------------------------------------

    def _require(self, adapter: str) -> None:
        if adapter not in self._targets:
            known = ", ".join(self._targets) or "none"
            raise AdapterError(f"model has no adapter '{adapter}' (adapters: {known})")

    def activate(self, adapter: str | None) -> None:
        """Make ``adapter`` the only active adapter, or (``None``) run the bare base model."""
        if adapter is not None:
            self._require(adapter)
        if adapter != self._active:
            self._active = adapter
            self._gate()

    @contextmanager
    def active(self, adapter: str | None) -> Iterator[None]:
        """Activate ``adapter`` for the block, then restore the previously active one."""
        previous = self._active
        self.activate(adapter)
        try:
            yield
        finally:
            self.activate(previous)

    @property
    def active_adapter(self) -> str | None:
        """The adapter whose delta the forward pass adds, or ``None``."""
        return self._active

    # -- what the model holds -------------------------------------------------------------------

    def adapter_names(self) -> tuple[str, ...]:
        """The adapters this model holds, in routing-table order."""
        return tuple(self._targets)

    def adapter_targets(self, adapter: str) -> tuple[str, ...]:
        """The base modules ``adapter`` wraps, in routing-table order."""
        self._require(adapter)
        return self._targets[adapter]

    def adapter_spec(self, adapter: str) -> AdapterSpec:
        """The policy's declaration of ``adapter`` (targets, rank, alpha, dropout)."""
        self._require(adapter)
        return self._specs[adapter]

    def target_kind(self, target: str) -> str:
        """What an adapter target is (``routing.lora_target_kind``): linear, conv1d or embedding."""
        if target not in self._kinds:
            raise AdapterError(f"model has no adapter on '{target}'")
        return self._kinds[target]

    def adapter_factors(self, adapter: str) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """``(target, A, B)`` of ``adapter`` per target, in target order. ``A`` is ``[rank, in]``
        (Embedding: ``[rank, num_embeddings]``), ``B`` is ``[out, rank]``."""
        self._require(adapter)
        return [(target, *self._layers[target].factors(adapter)) for target in self._targets[adapter]]

    def adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        """``A``, ``B`` of each target, in target order (what the adapter route trains)."""
        return [parameter for _, a, b in self.adapter_factors(adapter) for parameter in (a, b)]

    def adapter_tensors(self, adapter: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors (detached) under their ledger names ``adapter/NAME/TARGET.lora_A|B``."""
        tensors: dict[str, torch.Tensor] = {}
        for target, lora_a, lora_b in self.adapter_factors(adapter):
            name_a, name_b = adapter_tensor_names(adapter, target)
            tensors[name_a] = lora_a.detach()
            tensors[name_b] = lora_b.detach()
        return tensors

    def user_name(self, name: str) -> str:
        """The user's name of a tensor of ``base`` named as its LoRA layer nests it (``X.base_layer.weight``
        → ``X.weight``); other names are returned as they are."""
        head, found, rest = name.partition(_WRAPPED)
        return f"{head}.{rest}" if found and head in self._layers else name

    def _adapter_ids(self) -> set[int]:
        return {id(parameter) for adapter in self._targets for parameter in self.adapter_parameters(adapter)}

    def base_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The base model's parameters under the user's names, in the user's order (no adapter's)."""
        adapters = self._adapter_ids()
        for name, parameter in self.base.named_parameters():
            if id(parameter) not in adapters:
                yield self.user_name(name), parameter

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """torch's names, in govray's order: every base tensor (the user's order), then each adapter's."""
        named = list(super().named_parameters(prefix, recurse, remove_duplicate))
        adapters = self._adapter_ids()
        order = {
            id(p): index
            for index, p in enumerate(p for a in self._targets for p in self.adapter_parameters(a))
        }
        yield from ((name, p) for name, p in named if id(p) not in adapters)
        yield from sorted(
            ((name, p) for name, p in named if id(p) in adapters), key=lambda item: order[id(item[1])]
        )

    def base_state(self) -> dict[str, torch.Tensor]:
        """The base model's ``state_dict`` under the user's own names, without adapter tensors."""
        adapter_keys = set(self._adapter_keys())
        return {
            self.user_name(name): tensor
            for name, tensor in self.base.state_dict().items()
            if name not in adapter_keys
        }

    def load_base_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a base state under the user's names (what ``save_base`` writes), strictly: a
        missing or unexpected name raises ``RuntimeError``, as ``load_state_dict`` does."""
        adapter_keys = self._adapter_keys()
        expected = {self.user_name(name): name for name in self.base.state_dict() if name not in adapter_keys}
        missing = [name for name in expected if name not in state]
        unexpected = [name for name in state if name not in expected]
        if missing or unexpected:
            raise RuntimeError(
                f"base state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        self.base.load_state_dict({expected[name]: tensor for name, tensor in state.items()}, strict=False)

    # -- state_dict keys: govray's, never the LoRA layers' (PEFT's) -----------------------------

    def _adapter_keys(self) -> dict[str, str]:
        """PEFT's key (under ``base``) of every adapter tensor → govray's key (under the model)."""
        keys: dict[str, str] = {}
        for adapter, targets in self._targets.items():
            for target in targets:
                peft_a, peft_b = _peft_names(target, adapter, self._kinds[target])
                ours = f"adapters.{adapter}.{_module_key(target)}"
                keys[peft_a], keys[peft_b] = f"{ours}.lora_A", f"{ours}.lora_B"
        return keys

    def _govray_keys(self, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        adapter_keys = self._adapter_keys()
        base = prefix + "base."
        mine = [(key, state.pop(key)) for key in list(state) if key.startswith(base)]
        adapters = {}
        for key, tensor in mine:
            inner = key[len(base) :]
            if inner in adapter_keys:
                adapters[prefix + adapter_keys[inner]] = tensor
            else:
                state[base + self.user_name(inner)] = tensor
        for ours in adapter_keys.values():  # adapters after the base, in adapter order
            if prefix + ours in adapters:
                state[prefix + ours] = adapters[prefix + ours]

    def _peft_keys(self, state: dict[str, Any], prefix: str, *_: Any) -> None:
        peft_of = {ours: inner for inner, ours in self._adapter_keys().items()}
        base = prefix + "base."
        for key in list(state):
            if key.startswith(base):
                owner, _dot, tensor = key[len(base) :].rpartition(".")
                if owner in self._layers:  # targets are leaf modules: their tensors sit right below
                    state[f"{base}{owner}.base_layer.{tensor}"] = state.pop(key)
            elif key[len(prefix) :] in peft_of and key.startswith(prefix):
                state[base + peft_of[key[len(prefix) :]]] = state.pop(key)

    def drop_adapter(self, adapter: str) -> None:
        """Remove ``adapter``'s tensors; a target no adapter uses any more is unwrapped again, so
        with every adapter dropped ``base`` is the user's model exactly."""
        self._require(adapter)
        if self._active == adapter:
            self._active = None
        for target in self._targets.pop(adapter):
            layer = self._layers[target]
            layer.delete_adapter(adapter)
            if not layer.adapter_names():
                parent, _, child = target.rpartition(".")
                setattr(self.base.get_submodule(parent), child, layer.base_layer)
                del self._layers[target], self._kinds[target]
        del self._specs[adapter]
        self._gate()


def _module_key(target: str) -> str:
    return target.replace(".", "__")


def _peft_names(target: str, adapter: str, kind: str) -> tuple[str, str]:
    """PEFT's names (within the model) of an adapter's ``A`` and ``B`` on ``target``."""
    if kind == "embedding":
        return f"{target}.lora_embedding_A.{adapter}", f"{target}.lora_embedding_B.{adapter}"
    return f"{target}.lora_A.{adapter}.weight", f"{target}.lora_B.{adapter}.weight"
