"""Memory traded for compute: the chunked causal-LM loss equals the whole-sequence loss (values bit
for bit, gradients to fp32 rounding) and never allocates a tensor of the whole sequence's logits,
forward or backward; activation-checkpointed blocks keep less and give bit-identical gradients,
dropout and an active LoRA adapter included (no Ray)."""

from __future__ import annotations

import contextlib
from typing import Any

import pyarrow as pa
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from govray.config.training import TrainingSettings
from govray.governance.adapters import GovernedModel
from govray.governance.routing import resolve_routes
from govray.train.hf import CausalLMTrial, decoder_layers
from govray.train.step.memory_savers import checkpoint_activations
from govray.train.trial import Trial
from jobs.examples.text.trial import CharTransformerTrial
from tests.helpers.lm import VOCAB, llama, make_nonzero, policy

GPT2: dict[str, Any] = {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4}


def trial(config: dict[str, Any], chunk: int | None, context: int = 200) -> CausalLMTrial:
    return CausalLMTrial({"model": config, "context": context}, TrainingSettings(loss_chunk=chunk))


def random_batch(length: int, vocab: int, rows: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    targets = torch.randint(0, vocab, (rows, length), generator=generator)
    targets[1, length // 2 :] = -100  # a shorter row: padding is not predicted
    return {"ids": ids, "targets": targets}


def loss_and_gradients(
    config: dict[str, Any], chunk: int | None, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    lm = trial(config, chunk)
    model = lm.build_model().eval()  # no dropout: both runs see the same arithmetic
    losses = lm.loss(model, batch)
    losses.sum().backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", [llama(), llama(tied=False), GPT2], ids=["llama-tied", "llama", "gpt2"])
def test_the_chunked_loss_equals_the_whole_sequence_loss_and_gradients(config: dict[str, Any]) -> None:
    batch = random_batch(200, VOCAB)  # 200 = 3 chunks of 64 and one of 8
    whole, whole_grads = loss_and_gradients(config, None, batch)
    chunked, chunked_grads = loss_and_gradients(config, 64, batch)
    assert torch.equal(chunked, whole)  # per example, bit for bit (each position's arithmetic is the same)
    assert chunked_grads.keys() == whole_grads.keys()
    for name, grad in whole_grads.items():
        # The head's gradient is summed chunk by chunk instead of in one product: fp32 rounding.
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_trials_sequence_scores_and_token_counts_do_not_depend_on_the_chunk() -> None:
    texts = ["Ada Lovelace, 10 Dec 1815", "tied weights", "x"]
    scores = []
    for chunk in (None, 8):
        torch.manual_seed(0)
        lm = trial(llama(257), chunk, context=32)
        scores.append(lm.sequence_scores(lm.build_model(), texts))
        assert lm.tokens(pa.table({"text": texts})) == [25, 12, 1]
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-6, atol=0.0)


class LargestAllocation(TorchDispatchMode):
    """The element count of the largest tensor any operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("chunk", [None, 64])
def test_the_chunked_loss_never_allocates_the_whole_sequences_logits(chunk: int | None) -> None:
    vocab, length, rows = 8192, 512, 2
    torch.manual_seed(0)
    lm = trial(llama(vocab, tied=False), chunk, context=length)
    model = lm.build_model()
    batch = random_batch(length, vocab, rows)
    with LargestAllocation() as seen:
        lm.loss(model, batch).sum().backward()
    whole_logits = rows * length * vocab
    if chunk is None:
        assert seen.largest >= whole_logits  # the measure sees them when they exist
    else:
        # The largest tensors are one chunk's logits (and the head's weight and gradient).
        assert seen.largest == max(rows * chunk * vocab, vocab * 32)


# -- activation checkpointing ---------------------------------------------------------------------


def lora_llama(checkpointed: bool) -> tuple[CausalLMTrial, GovernedModel]:
    """A tiny Llama with attention dropout and a nonzero LoRA adapter on q/v of every block."""
    lm = trial({**llama(257), "attention_dropout": 0.3}, None, context=32)
    torch.manual_seed(0)
    base = lm.build_model()
    if checkpointed:
        checkpoint_activations(base, lm.checkpoint_units(base))
    rules = policy(["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.v_proj"])
    model = GovernedModel(base, resolve_routes(rules, base, decoder_layers(base)), rules.adapters, seed=7)
    make_nonzero(model)
    return lm, model


def char_transformer(checkpointed: bool) -> tuple[Trial, torch.nn.Module]:
    lm = CharTransformerTrial({"d_model": 32, "n_layers": 2, "dropout": 0.3, "context": 32})
    torch.manual_seed(0)
    model = lm.build_model()
    if checkpointed:
        checkpoint_activations(model, lm.checkpoint_units(model))
    return lm, model


def saved_bytes_and_gradients(build: Any, checkpointed: bool) -> tuple[int, dict[str, torch.Tensor]]:
    lm, model = build(checkpointed)
    model.train()
    texts = ["Ada Lovelace, 10 Dec 1815".ljust(32, "\n"), "tied weights".ljust(32, "\n")]
    batch = lm.collate(pa.table({"text": texts}))
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(3)  # the step's seed: dropout masks drawn in the forward
    active = model.active("pii-lora") if isinstance(model, GovernedModel) else contextlib.nullcontext()
    with active:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            losses = lm.loss(model, batch)
        torch.manual_seed(99)  # other draws before the backward: the recompute must not see them
        torch.rand(5)
        losses.sum().backward()
    return saved, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [lora_llama, char_transformer], ids=["hf-llama-lora", "text-example"])
def test_checkpointed_blocks_keep_less_and_give_bit_identical_gradients_with_dropout(build: Any) -> None:
    plain_saved, plain = saved_bytes_and_gradients(build, checkpointed=False)
    saved, checkpointed = saved_bytes_and_gradients(build, checkpointed=True)
    assert saved < plain_saved / 2  # the blocks' activations are not kept
    assert checkpointed.keys() == plain.keys()
    if build is lora_llama:  # the active adapter is in the recomputed blocks
        assert any("lora_B" in name and bool(grad.any()) for name, grad in plain.items())
    for name, grad in plain.items():
        assert torch.equal(checkpointed[name], grad), name


def test_checkpoint_units_of_a_transformers_decoder_are_its_blocks() -> None:
    lm = trial(llama(257), None, context=32)
    assert lm.checkpoint_units(lm.build_model()) == ["model.layers.0", "model.layers.1"]
    text = CharTransformerTrial({"n_layers": 2})
    assert text.checkpoint_units(text.build_model()) == ["embed", "blocks.0", "blocks.1", "head"]


def test_a_module_is_checkpointed_once() -> None:
    _, model = char_transformer(checkpointed=True)
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_activations(model, ["blocks.0"])
