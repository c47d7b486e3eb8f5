"""A plain Hugging Face GPT-2 trial with no empty-batch special case: its loss reshapes the logits
as transformers' own loss does and refuses a batch without rows (a 0-row batch would fail inside
GPT-2's attention anyway: ``cannot reshape tensor of 0 elements``). Hyperparameter ``dtype``:
``bfloat16`` builds the model in bf16 (as ``from_pretrained`` loads Llama 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from govray.train.hf import IGNORE, CausalLMTrial
from govray.train.trial import Batch


class EmptyBatchError(AssertionError):
    """The trial was handed a batch with no rows."""


class PlainGPT2Trial(CausalLMTrial):
    def build_model(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=257,
            n_embd=32,
            n_layer=4,
            n_head=4,
            n_positions=160,
            bos_token_id=256,
            eos_token_id=256,
        )
        model = GPT2LMHeadModel(config)
        return model.to(getattr(torch, self.hparams.get("dtype", "float32")))

    def build_meta_model(self) -> nn.Module:
        with torch.device("meta"):
            return self.build_model()

    def encode(self, text: str) -> list[int]:
        return super().encode(text.rstrip("\n"))

    def token_nll(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        ids = batch["ids"]
        if len(ids) == 0:
            raise EmptyBatchError("loss called with a batch of 0 rows")
        logits = model(input_ids=ids, use_cache=False).logits
        flat = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            batch["targets"].reshape(-1),
            ignore_index=IGNORE,
            reduction="none",
        )
        return flat.view(ids.shape)
