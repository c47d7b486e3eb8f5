"""Which tensors train, and in what dtype: tensors no route may update leave autograd before
the model is wrapped (``freeze_unroutable``), trainable tensors are fp32 whatever dtype the base
was loaded in (``trainable_in_fp32``), and an optimizer state saved before tensors were frozen
(indexed over every tensor) is re-indexed over today's (``reindexed``).

Example (the governed step's order)::

    frozen = freeze_unroutable(model, table)     # before DDP / FSDP wrap the model
    trainable_in_fp32(model)
    optimizer.load_state_dict(reindexed(saved, optimizer, lambda: build_optimizer(every_tensor)))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from govray.governance.adapters import GovernedModel
from govray.governance.routing import RoutingTable


def freeze_unroutable(model: GovernedModel, table: RoutingTable) -> list[str]:
    """Take every base tensor that no route may update out of autograd (``requires_grad_(False)``),
    before DDP or FSDP wraps the model: a LoRA-only job then computes no base gradient and its
    buckets hold trainable tensors only. Returns the names of the tensors it froze."""
    frozen = []
    for name, parameter in model.base_named_parameters():
        if parameter.requires_grad and not table.routes_updating(name):
            parameter.requires_grad_(False)
            frozen.append(name)
    return frozen


def trainable_in_fp32(model: GovernedModel) -> None:
    """Every trainable base tensor in float32, whatever dtype the base was loaded in (transformers
    loads Llama 3 in bf16): parameters, their gradients, optimizer state and reduction are fp32.
    (Adapters are made fp32 where they are built.) A frozen base keeps its dtype."""
    for _, parameter in model.base_named_parameters():
        if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()  # the same Parameter: every reference stays valid


def reindexed(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, before: Callable[[], torch.optim.Optimizer]
) -> dict[str, Any]:
    """``state`` (an ``optimizer.state_dict()``) re-indexed over ``optimizer``'s tensors if it
    indexes those of ``before()`` — the optimizer as built before frozen tensors left autograd:
    over every tensor then trainable, the frozen ones without state (never stepped). Optimizer
    state is saved by index, so the old optimizer is built again (it allocates no state) to map
    each index to its tensor. A state of neither layout is returned as it is (for
    ``load_state_dict`` to refuse)."""
    sizes = [len(group["params"]) for group in state["param_groups"]]
    if sizes == [len(group["params"]) for group in optimizer.param_groups]:
        return state
    old_optimizer = before()
    if sizes != [len(group["params"]) for group in old_optimizer.param_groups]:
        return state
    old = [parameter for group in old_optimizer.param_groups for parameter in group["params"]]
    now = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    position = {id(parameter): index for index, parameter in enumerate(now)}
    groups = []
    for saved, group in zip(state["param_groups"], old_optimizer.param_groups, strict=True):
        kept = [position[id(parameter)] for parameter in group["params"] if id(parameter) in position]
        if kept:  # a group of frozen tensors only is no group any more
            groups.append({**saved, "params": kept})
    return {
        "state": {
            position[id(old[int(index)])]: values
            for index, values in state["state"].items()
            if id(old[int(index)]) in position
        },
        "param_groups": groups,
    }
