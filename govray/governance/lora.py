"""govray's LoRA layers: PEFT's module layout and arithmetic, without importing PEFT.

A target module (``nn.Linear``, transformers' ``Conv1D``, ``nn.Embedding``) is replaced by a
``LoraLinear`` or ``LoraEmbedding`` that holds it as ``base_layer`` and each adapter's factors
under PEFT's names (``lora_A.NAME.weight``, ``lora_B.NAME.weight``; embeddings
``lora_embedding_A.NAME``, ``lora_embedding_B.NAME``), so checkpoints, PEFT exports and
``PeftModel.from_pretrained`` see what PEFT 0.21's own LoRA layers hold. The forward pass is PEFT's
vanilla LoRA, operation for operation (``base(x) + B(A(dropout(x))) * alpha / r``, the input cast
to the factors' dtype, the sum cast back to the base output's), so the logits are bit-identical to
PEFT's. Why not PEFT's layers: importing PEFT imports transformers' modeling stack (~5 s of CPU per
process here), which a trial of a model that is not a transformers model never needs.

The layer only computes; ``govray.governance.adapters.GovernedModel`` decides which adapter is
active and draws the factors' initial values. Factors are created without drawing from any RNG.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


class LoraLayer(nn.Module, ABC):
    """A wrapped target and its adapters' factors; at most the adapters in ``active`` add a delta."""

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer  # first: the base's tensors keep their place in the order
        self.scaling: dict[str, float] = {}
        self.lora_dropout = nn.ModuleDict()
        self.active: list[str] = []  # adapters whose delta the forward pass adds, in order

    def add_adapter(self, name: str, rank: int, alpha: float, dropout: float) -> None:
        """Add ``name``'s factors (uninitialised: the caller sets them) and its scale ``alpha / rank``."""
        self.scaling[name] = alpha / rank
        self.lora_dropout[name] = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        self._add_factors(name, rank)

    def delete_adapter(self, name: str) -> None:
        """Remove ``name``'s factors (and make it inactive)."""
        del self.scaling[name], self.lora_dropout[name]
        self._delete_factors(name)
        self.active = [adapter for adapter in self.active if adapter != name]

    def adapter_names(self) -> list[str]:
        """The adapters this layer holds, in the order they were added."""
        return list(self.scaling)

    @abstractmethod
    def factors(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        """``(A, B)`` of ``name``: ``A`` is ``[rank, in]``, ``B`` is ``[out, rank]``."""

    @abstractmethod
    def _add_factors(self, name: str, rank: int) -> None: ...

    @abstractmethod
    def _delete_factors(self, name: str) -> None: ...

    def _device(self) -> torch.device:
        return next(self.base_layer.parameters()).device


class LoraLinear(LoraLayer):
    """LoRA on an ``nn.Linear`` or a transformers ``Conv1D`` (``fan_in_fan_out``: weight ``[in, out]``)."""

    def __init__(self, base_layer: nn.Module, fan_in_fan_out: bool = False) -> None:
        super().__init__(base_layer)
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        rows, columns = base_layer.get_parameter("weight").shape
        in_features, out_features = (rows, columns) if fan_in_fan_out else (columns, rows)
        self.in_features, self.out_features = int(in_features), int(out_features)

    def _add_factors(self, name: str, rank: int) -> None:
        device = self._device()
        self.lora_A[name] = nn.utils.skip_init(nn.Linear, self.in_features, rank, bias=False, device=device)
        self.lora_B[name] = nn.utils.skip_init(nn.Linear, rank, self.out_features, bias=False, device=device)

    def _delete_factors(self, name: str) -> None:
        del self.lora_A[name], self.lora_B[name]

    def factors(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        return self.lora_A[name].get_parameter("weight"), self.lora_B[name].get_parameter("weight")

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        result_dtype = result.dtype
        for name in self.active:
            dtype = self.factors(name)[0].dtype
            x = x if x.dtype == dtype else x.to(dtype=dtype)
            delta = self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x)))
            result = result + delta * self.scaling[name]
        return result.to(result_dtype)  # no adapter active: the base's output tensor itself


class LoraEmbedding(LoraLayer):
    """LoRA on an ``nn.Embedding``: ``A`` is ``[rank, num_embeddings]``, ``B`` ``[dim, rank]``
    (PEFT's convention; a transformers embedding's scalar ``embed_scale`` scales the delta too)."""

    def __init__(self, base_layer: nn.Embedding) -> None:
        super().__init__(base_layer)
        self.lora_embedding_A = nn.ParameterDict()
        self.lora_embedding_B = nn.ParameterDict()
        self.in_features, self.out_features = base_layer.num_embeddings, base_layer.embedding_dim

    def _add_factors(self, name: str, rank: int) -> None:
        device = self._device()
        self.lora_embedding_A[name] = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_embedding_B[name] = nn.Parameter(torch.empty(self.out_features, rank, device=device))

    def _delete_factors(self, name: str) -> None:
        del self.lora_embedding_A[name], self.lora_embedding_B[name]

    def factors(self, name: str) -> tuple[nn.Parameter, nn.Parameter]:
        return self.lora_embedding_A[name], self.lora_embedding_B[name]

    def _embed_scale(self) -> torch.Tensor | None:
        scale = getattr(self.base_layer, "embed_scale", None)
        if isinstance(scale, (int, float)):
            weight = self.base_layer.get_parameter("weight")
            return torch.tensor(scale, device=weight.device, dtype=weight.dtype)
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            return scale
        return None

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        base = cast(nn.Embedding, self.base_layer)
        result = base(x, *args, **kwargs)
        result_dtype = result.dtype
        embed_scale = self._embed_scale() if self.active else None
        for name in self.active:
            after_a = F.embedding(
                x,
                self.lora_embedding_A[name].T,
                padding_idx=base.padding_idx,
                max_norm=base.max_norm,
                norm_type=base.norm_type,
                scale_grad_by_freq=base.scale_grad_by_freq,
                sparse=base.sparse,
            )
            delta = (after_a @ self.lora_embedding_B[name].T) * self.scaling[name]
            if embed_scale is not None:
                delta = delta * embed_scale.to(delta.dtype)
            result = result + delta
        return result.to(result_dtype)


def wrap_target(module: nn.Module, kind: str) -> LoraLayer:
    """The LoRA layer for a target of ``routing.lora_target_kind`` ``kind``."""
    if kind == "embedding":
        assert isinstance(module, nn.Embedding)
        return LoraEmbedding(module)
    return LoraLinear(module, fan_in_fan_out=kind == "conv1d")
