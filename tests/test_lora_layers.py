"""govray's LoRA layers compute what PEFT's compute, bit for bit (forward, dropout, gradients,
bf16 bases), hold their factors under PEFT's names, and a governed model of a plain torch model
with an adapter never imports PEFT or transformers (issue 33: a trial's imports)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from govray.governance.lora import LoraLayer, wrap_target
from tests.helpers.builders import REPO

RANK, ALPHA = 4, 8


def base_module(kind: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    if kind == "linear":
        module: nn.Module = nn.Linear(12, 7)
    elif kind == "conv1d":
        module = transformers.pytorch_utils.Conv1D(7, 12)  # nf=7 outputs, nx=12 inputs
    else:
        module = nn.Embedding(20, 6, padding_idx=1)
    return module.to(dtype)


def peft_layer(kind: str, base: nn.Module, dropout: float) -> Any:
    from peft import LoraConfig
    from peft.tuners.lora.layer import dispatch_default

    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=dropout,
        fan_in_fan_out=kind == "conv1d",
        init_lora_weights=False,
    )
    layer = dispatch_default(base, "a", config=config, r=RANK, lora_alpha=ALPHA)
    layer.set_adapter("a")
    return layer


def pair(kind: str, dtype: torch.dtype, dropout: float) -> tuple[LoraLayer, Any]:
    """The same target in govray's layer and PEFT's, with the same (non-zero) factors."""
    ours = wrap_target(base_module(kind, dtype), kind)
    ours.add_adapter("a", RANK, ALPHA, dropout)
    ours.active = ["a"]
    theirs = peft_layer(kind, base_module(kind, dtype), dropout)
    generator = torch.Generator().manual_seed(1)
    for mine, peft_factor in zip(
        ours.factors("a"),
        (theirs.lora_embedding_A["a"], theirs.lora_embedding_B["a"])
        if kind == "embedding"
        else (theirs.lora_A["a"].weight, theirs.lora_B["a"].weight),
        strict=True,
    ):
        assert mine.shape == peft_factor.shape
        value = torch.randn(mine.shape, generator=generator)
        mine.data, peft_factor.data = value.clone(), value.clone()
    return ours, theirs


def inputs(kind: str, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    if kind == "embedding":
        return torch.randint(0, 20, (3, 5), generator=generator)
    return torch.randn(3, 5, 12, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-base"])
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("kind", ["linear", "conv1d", "embedding"])
def test_a_govray_lora_layer_computes_what_pefts_computes_bit_for_bit(
    kind: str, dropout: float, dtype: torch.dtype
) -> None:
    ours, theirs = pair(kind, dtype, dropout)
    x = inputs(kind, dtype)
    outputs, gradients = [], []
    for layer in (ours, theirs):
        layer.train()
        torch.manual_seed(3)  # the same dropout mask
        output = layer(x)
        output.float().square().sum().backward()
        outputs.append(output)
        gradients.append([p.grad for p in layer.parameters() if p.grad is not None])
    assert outputs[0].dtype == outputs[1].dtype == dtype  # the base output's dtype
    assert torch.equal(outputs[0], outputs[1])
    expected = 3 if kind == "embedding" else 4  # the base's weight (and bias), A, B
    assert len(gradients[0]) == len(gradients[1]) == expected
    for mine, peft_gradient in zip(gradients[0], gradients[1], strict=True):
        assert torch.equal(mine, peft_gradient)


@pytest.mark.parametrize("kind", ["linear", "conv1d", "embedding"])
def test_a_govray_lora_layers_state_dict_keys_are_pefts(kind: str) -> None:
    ours, theirs = pair(kind, torch.float32, 0.1)
    assert list(ours.state_dict()) == list(theirs.state_dict())


def test_an_inactive_or_dropped_adapter_returns_the_bases_output_tensor_itself() -> None:
    ours, _ = pair("linear", torch.float32, 0.0)
    x = inputs("linear", torch.float32)
    ours.active = []
    assert torch.equal(ours(x), ours.base_layer(x))
    ours.active = ["a"]
    ours.delete_adapter("a")
    assert ours.adapter_names() == [] and ours.active == []
    assert list(ours.state_dict()) == ["base_layer.weight", "base_layer.bias"]


def test_factors_are_created_without_drawing_from_the_global_rng() -> None:
    layer = wrap_target(nn.Linear(12, 7), "linear")
    state = torch.random.get_rng_state()
    layer.add_adapter("a", RANK, ALPHA, 0.0)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_governed_plain_torch_model_with_an_adapter_imports_neither_peft_nor_transformers() -> None:
    """What a search trial of the digits example builds: its model, the policy's LoRA adapter on
    ``hidden``, a training step with the adapter active. (A fresh interpreter: this one has both.)"""
    probe = """
import sys, torch
from pathlib import Path
from govray.governance.adapters import GovernedModel
from govray.governance.policy import load_policy
from govray.governance.routing import resolve_routes
from jobs.examples.digits.trial import DigitsMLP

policy = load_policy(Path("policies/digits.policy.yaml"))
base = DigitsMLP(hidden=16, dropout=0.0)
model = GovernedModel(base, resolve_routes(policy, base), policy.adapters, seed=7)
with model.active("pii-lora"):
    model(torch.rand(4, 64)).sum().backward()
assert all(p.grad is not None for p in model.adapter_parameters("pii-lora"))
print(sorted(m for m in ("peft", "transformers", "accelerate") if m in sys.modules))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
