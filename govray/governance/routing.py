"""Routing tables: a depth policy resolved against a concrete model.

For every route of the policy the table holds one boolean per parameter tensor: may this route's
gradients update it? Layers are the trial's ordered layers (module names), by default the model's
top-level children in registration order. A parameter held by several layers (tied embedding and
LM head) is updated by a route only if the route may update every name it is held under.

Example::

    table = resolve_routes(policy, model)           # layers = top-level children
    table.may_update("licensed", "head.weight")      # True / False
    table.allowed("licensed")                        # ("hidden.weight", "hidden.bias", ...)
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from govray.core.errors import RoutingError
from govray.governance.policy import AdapterRoute, DepthPolicy, DepthRange, LayerRoute, Route

if TYPE_CHECKING:  # what reads a routing table back (attestations, lineage) needs no torch
    from torch import nn

ADAPTER_PREFIX = "adapter/"  # adapter tensors: adapter/NAME/TARGET.lora_A|B
OUTSIDE_LAYERS = "(outside layers)"  # what a parameter in no declared layer is listed under


@dataclass(frozen=True)
class ParameterInfo:
    """One parameter tensor: its canonical name, every name it is held under, and their layers."""

    name: str
    aliases: tuple[str, ...]
    layers: tuple[int | None, ...]  # the layer index of each alias (None: outside every layer)
    numel: int


@dataclass(frozen=True)
class RoutingTable:
    """Per route, which parameter tensors its gradients may update."""

    policy_name: str
    policy_version: int
    layers: tuple[str, ...]
    parameters: tuple[ParameterInfo, ...]
    masks: dict[str, tuple[bool, ...]]  # route key → one flag per parameter, in model order
    adapter_targets: dict[str, tuple[str, ...]]  # adapter route key → modules it wraps (lora_target_kind)
    adapter_names: dict[str, str]  # adapter route key → adapter name

    @property
    def routes(self) -> tuple[str, ...]:
        return tuple(self.masks)

    def _index(self, parameter: str) -> int:
        for index, info in enumerate(self.parameters):
            if parameter == info.name or parameter in info.aliases:
                return index
        raise RoutingError(f"model has no parameter '{parameter}'")

    def _mask(self, route: str) -> tuple[bool, ...]:
        if route not in self.masks:
            raise RoutingError(f"policy '{self.policy_name}' v{self.policy_version} has no route '{route}'")
        return self.masks[route]

    def may_update(self, route: str, parameter: str) -> bool:
        return self._mask(route)[self._index(parameter)]

    def allowed(self, route: str) -> tuple[str, ...]:
        """Names of the base parameters ``route`` may update, in model order."""
        return tuple(info.name for info, ok in zip(self.parameters, self._mask(route), strict=True) if ok)

    def updated_tensors(self, route: str) -> tuple[str, ...]:
        """Every tensor ``route`` updates: its base parameters, or its adapter's tensors."""
        if route in self.adapter_names:
            adapter = self.adapter_names[route]
            return tuple(
                name
                for target in self.adapter_targets[route]
                for name in adapter_tensor_names(adapter, target)
            )
        return self.allowed(route)

    def layer_of_tensor(self, tensor: str) -> int | None:
        """The layer index holding a base parameter or an adapter tensor (None: outside layers)."""
        if tensor.startswith(ADAPTER_PREFIX):
            target = tensor.split("/", 2)[2].rsplit(".", 1)[0]
            return _layer_of(target, self.layers)
        info = self.parameters[self._index(tensor)]
        return info.layers[info.aliases.index(tensor)] if tensor in info.aliases else info.layers[0]

    def tensor_layers(self) -> dict[str, int | None]:
        """Every tensor a route can update (base parameters and adapter tensors) → its layer."""
        tensors = [info.name for info in self.parameters]
        tensors += [tensor for route in self.adapter_names for tensor in self.updated_tensors(route)]
        return {tensor: self.layer_of_tensor(tensor) for tensor in tensors}

    def routes_updating(self, parameter: str) -> tuple[str, ...]:
        index = self._index(parameter)
        return tuple(route for route, mask in self.masks.items() if mask[index])

    def masked_fraction(self, route: str) -> float:
        """Fraction of base parameter elements ``route`` may NOT update."""
        total = sum(info.numel for info in self.parameters)
        frozen = sum(
            info.numel for info, ok in zip(self.parameters, self._mask(route), strict=True) if not ok
        )
        return frozen / total if total else 0.0


def adapter_tensor_names(adapter: str, target: str) -> tuple[str, str]:
    """Ledger and attestation names of the LoRA tensors of ``adapter`` on module ``target``."""
    return f"{ADAPTER_PREFIX}{adapter}/{target}.lora_A", f"{ADAPTER_PREFIX}{adapter}/{target}.lora_B"


def adapter_of_tensor(tensor: str) -> str | None:
    """The adapter a tensor named by :func:`adapter_tensor_names` belongs to; None: a base tensor."""
    return tensor.split("/", 2)[1] if tensor.startswith(ADAPTER_PREFIX) else None


def layer_label(layer: str | None, adapter: str | None = None) -> str:
    """Where a tensor lies, as ledgers, attestations and lineage answers name it: ``adapter:NAME``
    for a removable adapter's tensors, else its layer's name, else ``(outside layers)``."""
    if adapter is not None:
        return f"adapter:{adapter}"
    return layer if layer is not None else OUTSIDE_LAYERS


def default_layers(model: nn.Module) -> tuple[str, ...]:
    """The model's top-level child modules, in registration order."""
    return tuple(name for name, _ in model.named_children())


def _layer_of(name: str, layers: Sequence[str]) -> int | None:
    """The index of the layer holding parameter ``name`` (the longest matching prefix)."""
    best: int | None = None
    best_length = -1
    for index, layer in enumerate(layers):
        if (name == layer or name.startswith(layer + ".")) and len(layer) > best_length:
            best, best_length = index, len(layer)
    return best


def describe_parameters(model: nn.Module, layers: Sequence[str]) -> tuple[ParameterInfo, ...]:
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    infos = []
    for name, parameter in model.named_parameters():
        names = tuple(aliases[id(parameter)])
        infos.append(
            ParameterInfo(
                name=name,
                aliases=names,
                layers=tuple(_layer_of(alias, layers) for alias in names),
                numel=parameter.numel(),
            )
        )
    return tuple(infos)


def _depth_indexes(depth: DepthRange, layers: Sequence[str], route: str) -> set[int]:
    count = len(layers)

    def normalize(value: int, end: str) -> int:
        if not -count <= value < count:
            raise RoutingError(
                f"route '{route}': depth {end} {value} matches no layer; the model has {count} "
                f"layers ({', '.join(layers)})"
            )
        return value % count

    low = normalize(depth.min, "min") if depth.min is not None else 0
    high = normalize(depth.max, "max") if depth.max is not None else count - 1
    if low > high:
        raise RoutingError(
            f"route '{route}': depth range {depth.min}..{depth.max} matches no layer "
            f"(resolves to {low}..{high} over {count} layers)"
        )
    return set(range(low, high + 1))


def _layer_route_mask(
    route: LayerRoute, key: str, parameters: Sequence[ParameterInfo], layers: Sequence[str]
) -> tuple[bool, ...]:
    all_names = [alias for info in parameters for alias in info.aliases]
    for pattern in route.params:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in all_names):
            raise RoutingError(f"route '{key}': glob '{pattern}' matches no parameter of the model")
    depth = _depth_indexes(route.depth, layers, key) if route.depth is not None else set()

    def alias_selected(alias: str, layer: int | None) -> bool:
        in_depth = layer is not None and layer in depth
        return in_depth or any(fnmatch.fnmatchcase(alias, pattern) for pattern in route.params)

    # A tied tensor is updated only if every name it is held under is selected.
    return tuple(
        all(alias_selected(alias, layer) for alias, layer in zip(info.aliases, info.layers, strict=True))
        for info in parameters
    )


def lora_target_kind(module: nn.Module) -> str | None:
    """What a LoRA adapter may wrap: ``linear`` (``nn.Linear``), ``conv1d`` (transformers'
    ``Conv1D``, GPT-2's projections, weight ``[in, out]``), ``embedding``; None: nothing."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    # A model holding a Conv1D has imported transformers; one without never needs it imported.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    if pytorch_utils is not None and isinstance(module, pytorch_utils.Conv1D):
        return "conv1d"
    return None


def _adapter_targets(model: nn.Module, route: AdapterRoute, key: str, policy: DepthPolicy) -> tuple[str, ...]:
    spec = policy.adapters[route.adapter]
    wrappable = [name for name, module in model.named_modules() if lora_target_kind(module) is not None]
    targets: list[str] = []
    for pattern in spec.targets:
        matched = [name for name in wrappable if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise RoutingError(
                f"route '{key}': adapter '{route.adapter}' target '{pattern}' matches no Linear, "
                f"Embedding or Conv1D module (those modules: {', '.join(wrappable) or 'none'})"
            )
        targets.extend(name for name in matched if name not in targets)
    return tuple(targets)


def _running_stat_modules(model: nn.Module) -> list[str]:
    # BatchNorm/InstanceNorm with running statistics update buffers outside any gradient.
    from torch import nn

    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
    ]


def resolve_routes(
    policy: DepthPolicy, model: nn.Module, layers: Sequence[str] | None = None
) -> RoutingTable:
    """Resolve every route of ``policy`` against ``model`` and its ordered ``layers``."""
    ordered = tuple(layers) if layers is not None else default_layers(model)
    if not ordered:
        raise RoutingError("the model has no layers: declare the trial's ordered layers")
    module_names = {name for name, _ in model.named_modules()}
    for layer in ordered:
        if layer not in module_names:
            raise RoutingError(f"declared layer '{layer}' is not a module of the model")
    if len(set(ordered)) != len(ordered):
        raise RoutingError("declared layers repeat a module")
    if policy.restricts:
        stateful = _running_stat_modules(model)
        if stateful:
            raise RoutingError(
                f"policy '{policy.name}' v{policy.version} restricts routes, but modules "
                f"{', '.join(stateful)} keep running statistics (BatchNorm) that no gradient mask "
                "governs; use LayerNorm/GroupNorm, or track_running_stats=False"
            )
    parameters = describe_parameters(model, ordered)
    masks: dict[str, tuple[bool, ...]] = {}
    adapter_targets: dict[str, tuple[str, ...]] = {}
    adapter_names: dict[str, str] = {}
    for key, route in policy.routes().items():
        masks[key] = _route_mask(route, key, parameters, ordered)
        if isinstance(route, AdapterRoute):
            adapter_targets[key] = _adapter_targets(model, route, key, policy)
            adapter_names[key] = route.adapter
        elif not any(masks[key]):
            raise RoutingError(
                f"route '{key}' may update no parameter: a tied parameter needs every layer "
                "holding it inside the route"
            )
    return RoutingTable(
        policy_name=policy.name,
        policy_version=policy.version,
        layers=ordered,
        parameters=parameters,
        masks=masks,
        adapter_targets=adapter_targets,
        adapter_names=adapter_names,
    )


def _route_mask(
    route: Route, key: str, parameters: Sequence[ParameterInfo], layers: Sequence[str]
) -> tuple[bool, ...]:
    if route == "all":
        return tuple(True for _ in parameters)
    if isinstance(route, AdapterRoute):
        return tuple(False for _ in parameters)  # base weights never see an adapter route
    assert isinstance(route, LayerRoute)
    return _layer_route_mask(route, key, parameters, layers)
