"""Memory traded for compute: a causal LM's loss chunk by chunk, and activation checkpointing.

``chunked_token_nll`` computes a language model's output head and cross-entropy a chunk of
positions at a time, each chunk under a non-reentrant ``torch.utils.checkpoint``: the forward keeps
no chunk's logits (only the final hidden states, which the model had anyway, and the per-token
NLL), and the backward recomputes one chunk's logits at a time. With vocabulary 128k and 4,096
positions, the whole sequence's fp32 logits are 2 GiB per row, and the backward of a plain
cross-entropy holds them twice; chunked, it holds one chunk's.

``checkpoint_activations`` makes a model's blocks recompute their activations in the backward
instead of keeping them (``training.activation_checkpointing``): each named module's forward runs
under a non-reentrant checkpoint, which restores the RNG state it ran with (dropout recomputes
the same mask) and the autocast state. Parameter names stay the user's (no wrapper module is
inserted), so routing, checkpoints and adapters see the same model. The backward recomputes each
block with the adapter that was active in its forward: govray runs the backward inside the same
``active(adapter)`` block as the forward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE = -100  # a target that is not predicted (padding)


def _chunk_nll(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # The same ops, in the same order, as the whole-sequence loss: fp32 cross-entropy of the logits.
    return token_nll(head(hidden), targets)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position NLL (nats) of ``targets`` ``[batch, length]`` under ``logits`` ``[batch,
    length, vocab]``, computed in fp32; 0 where the target is ``IGNORE``.

    One row per position, the vocabulary contiguous: log-softmax's fast path. (A ``[batch,
    vocab, length]`` view, cross-entropy's K-dimensional form, makes it copy the logits and stride
    across the vocabulary: a third of a 1B Llama's step on an H200, BENCHMARKS.md.)"""
    batch, length = targets.shape
    rows = logits.reshape(batch * length, logits.shape[-1]).float()
    nll = F.cross_entropy(rows, targets.reshape(-1), ignore_index=IGNORE, reduction="none")
    return nll.view(batch, length)


def chunked_token_nll(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Per-position NLL ``[batch, length]`` of ``targets`` under ``head(hidden)``, ``chunk``
    positions at a time; equal to ``token_nll(head(hidden), targets)`` without ever holding the
    logits of more than one chunk (forward or backward).

    Each position's value is the same arithmetic as the whole computation's; whether it is the same
    bits depends on the matrix product giving each row the same bits for a chunk's rows as for the
    whole sequence's (it does on CPU for chunks of 64 positions or more in the tests here; a GEMM
    kernel chosen by size may round differently, within fp32's last bits).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 position, got {chunk}")
    parts = [
        checkpoint(
            _chunk_nll,
            head,
            hidden[:, start : start + chunk],
            targets[:, start : start + chunk],
            use_reentrant=False,
        )
        for start in range(0, hidden.shape[1], chunk)
    ]
    if not parts:  # a sequence of no positions
        return hidden.new_zeros(targets.shape, dtype=torch.float32)
    return torch.cat(parts, dim=1)


def checkpoint_activations(model: nn.Module, modules: Sequence[str]) -> None:
    """Run each of ``modules`` (names in ``model``) under a non-reentrant activation checkpoint:
    its forward keeps only its inputs, and the backward recomputes it (same RNG, same autocast).

    The module's ``forward`` is replaced on the instance, so names, hooks and state dicts are
    unchanged. A module named twice, or a name that is no module, is an error.
    """
    if len(set(modules)) != len(modules):
        raise ValueError(f"a module is named more than once among {list(modules)}")
    for name in modules:
        module = model.get_submodule(name)
        if isinstance(module.forward, functools.partial) and module.forward.func is checkpoint:
            raise ValueError(f"module '{name}' is already checkpointed")
        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
