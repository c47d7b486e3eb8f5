"""What ``jobs.gpu_session`` measures govray's step against, and with: an independent Hugging Face
(+ PEFT) training loop (nothing of govray), a step timer (CUDA events on a GPU), the FLOPs a token
costs and the peak dense bf16 FLOP/s of each GPU model (MFU's denominator).

FLOPs per token, PaLM's accounting: ``6N + 12·L·d·S`` for a full fine-tune, ``4N + 12·L·d·S`` for a
frozen base (no weight gradients; attention's backward is still twice its forward); ``N`` counts
the weights of every matmul (the head included, the embedding lookup not), adapters are left out,
attention is counted whole (not halved for the causal mask) and recomputation is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Peak dense (not sparse) bf16 tensor FLOP/s by GPU model, from NVIDIA's data sheets; matched
# against torch's device name, longest name first.
PEAK_BF16: dict[str, float] = {
    "B200": 2250e12,
    "H200": 989.4e12,
    "GH200": 989.4e12,
    "H100 PCIe": 756.5e12,
    "H100 NVL": 835.5e12,
    "H100": 989.4e12,
    "A100": 312e12,
    "L40S": 362.05e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
}


def peak_flops(name: str) -> float | None:
    """The peak dense bf16 FLOP/s of the GPU named ``name`` (None: not in the table)."""
    for model in sorted(PEAK_BF16, key=len, reverse=True):
        if model in name:
            return PEAK_BF16[model]
    return None


def matmul_weights(shape: dict[str, Any]) -> int:
    """Weights of every matmul of the model (the head included once, the embedding lookup not)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {key: value for key, value in shape.items() if key != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(shape["model_type"], **settings))
    return sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))


def flops_per_token(shape: dict[str, Any], window: int, frozen_base: bool) -> float:
    """PaLM's accounting (see the module's docstring)."""
    weights = matmul_weights(shape)
    attention = 12 * shape["num_hidden_layers"] * shape["hidden_size"] * window
    return (4 if frozen_base else 6) * weights + attention


class PlainLoop:
    """An independent Hugging Face (+ PEFT) training step over packed windows: nothing of govray."""

    def __init__(
        self, shape: dict[str, Any], lora: bool, lr: float, device: torch.device, bf16: bool
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        settings = {key: value for key, value in shape.items() if key != "model_type"}
        torch.manual_seed(0)
        with device:  # initialised where it trains (a 1B model's init on the host takes tens of seconds)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(shape["model_type"], **settings))
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(PROJECTIONS))
            )
        self.model = model.to(device).train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=lr)
        self.device, self.bf16 = device, bf16

    def step(self, windows: Any) -> None:
        ids = torch.tensor(windows["input_ids"].to_pylist(), dtype=torch.long)
        real = torch.tensor(windows["tokens"].to_pylist(), dtype=torch.long)
        labels = ids.masked_fill(torch.arange(ids.shape[1]) >= real[:, None], -100)
        ids, labels = ids.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trainable, 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Seconds one call takes: CUDA events on a GPU, the wall clock elsewhere."""

    def cuda(run: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def wall(run: Callable[[], None]) -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    return cuda if device.type == "cuda" else wall
