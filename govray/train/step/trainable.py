"""Which tensors train, and in what dtype: tensors no route may update leave autograd before
the model is wrapped (``freeze_unroutable``), trainable tensors are fp32 whatever dtype the base
was loaded in (``trainable_in_fp32``).

Example (the governed step's order)::

    frozen = freeze_unroutable(model, table)     # before DDP / FSDP wrap the model
    trainable_in_fp32(model)
    optimizer = build_optimizer(trainable_tensors)
"""

from __future__ import annotations

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
