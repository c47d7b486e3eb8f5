"""The text trial: a small character-level decoder-only transformer over fixed-length ASCII rows.

Tokens are ASCII code points (vocabulary 128). A row's text is ``context`` characters, right-padded
with newlines (``PAD``); the model reads ``BOS`` followed by the row and predicts every non-pad
character, so a row's tokens are its characters before the padding. Layers, bottom to top:
``embed`` (token and position embeddings), ``blocks.0`` … ``blocks.{n_layers-1}`` (pre-LayerNorm
causal self-attention and MLP), ``head`` (final LayerNorm and output projection). Every parameter
lies in exactly one of them; embeddings are not tied; there is no BatchNorm.

Hyperparameters: ``d_model`` (64), ``n_layers`` (2), ``n_heads`` (4), ``dropout`` (0.0),
``context`` (128, the row length). The optimizer, batch size and clipping are the experiment's
``training`` settings (or the hyperparameters ``optimizer``, ``lr``, ``momentum``,
``batch_size``, ``max_grad_norm`` ... that override them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from govray import Batch, ConfigError, Predictions, Trial, scoring

VOCAB = 128
BOS = 0  # NUL: never in a row
PAD = ord("\n")  # normalized text has no newlines: they only pad
SCORE_CHUNK = 256  # texts per forward pass in sequence_scores


class Embedding(nn.Module):
    def __init__(self, d_model: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Embedding(context, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class CausalSelfAttention(nn.Module):
    """Fused ``qkv`` and output ``proj``, both plain ``nn.Linear`` called as modules, so a LoRA
    adapter's forward hook on either sees every call (``nn.MultiheadAttention`` bypasses them)."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ConfigError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            part.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2)
            for part in self.qkv(x).split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class Head(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class CharTransformer(nn.Module):
    """Logits ``[batch, length, VOCAB]`` for token ids ``[batch, length]`` (length ≤ context)."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, dropout: float, context: int) -> None:
        super().__init__()
        self.embed = Embedding(d_model, context)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.head = Head(d_model)
        self.apply(_init_weights)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _init_weights(module: nn.Module) -> None:
    # GPT-2's: small normal weights, zero biases (PyTorch's N(0, 1) embeddings swamp the sum).
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def encode(texts: Sequence[str], length: int) -> torch.Tensor:
    """Code points ``[len(texts), length]`` of texts of exactly ``length`` ASCII characters."""
    if any(len(text) != length for text in texts):
        raise ValueError(f"every text must have exactly {length} characters (the trial's 'context')")
    data = "".join(texts).encode("ascii")  # UnicodeEncodeError names the character
    codes = np.frombuffer(data, dtype=np.uint8).reshape(len(texts), length)
    return torch.from_numpy(codes.astype(np.int64))


def next_character_nll(model: nn.Module, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-character negative log-likelihood (nats) of ``targets`` after BOS, and the logits.

    Pad positions hold 0 in the returned ``[batch, length]`` NLL.
    """
    inputs = torch.cat([torch.full_like(targets[:, :1], BOS), targets[:, :-1]], dim=1)
    logits = model(inputs)
    nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return nll.masked_fill(targets == PAD, 0.0), logits


class CharTransformerTrial(Trial):
    """Next-character prediction; per-example loss = mean NLL over the row's non-pad characters."""

    @property
    def context(self) -> int:
        return int(self.hparams.get("context", 128))

    def build_model(self) -> nn.Module:
        return CharTransformer(
            d_model=int(self.hparams.get("d_model", 64)),
            n_layers=int(self.hparams.get("n_layers", 2)),
            n_heads=int(self.hparams.get("n_heads", 4)),
            dropout=float(self.hparams.get("dropout", 0.0)),
            context=self.context,
        )

    def layers(self, model: nn.Module) -> Sequence[str]:
        assert isinstance(model, CharTransformer)
        return ["embed", *(f"blocks.{index}" for index in range(len(model.blocks))), "head"]

    pad_id = PAD  # a packed window (data.packing) is padded like a row

    def collate(self, rows: pa.Table) -> Batch:
        if "input_ids" in rows.column_names:  # packed windows of code points (data.packing)
            ids = rows["input_ids"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
            width = len(ids) // rows.num_rows if rows.num_rows else self.context
            return {
                "text": torch.from_numpy(ids.astype(np.int64).reshape(rows.num_rows, width)),
                "tokens": torch.tensor(rows["tokens"].to_numpy(zero_copy_only=False)),
            }
        return {"text": encode(rows["text"].to_pylist(), self.context)}

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        nll, _ = next_character_nll(model, batch["text"])
        if "tokens" in batch:  # a packed window: the sum over its characters (govray divides)
            return nll.sum(dim=1)
        return nll.sum(dim=1) / _characters(batch["text"])

    def evaluate(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        targets = batch["text"]
        nll, logits = next_character_nll(model, targets)
        correct = (logits.argmax(dim=2) == targets) & (targets != PAD)
        characters = _characters(targets)
        return {"loss": nll.sum(dim=1) / characters, "accuracy": correct.sum(dim=1) / characters}

    def predictions(self, model: nn.Module, batch: Batch) -> Predictions:
        """Each row's logits for its characters, the characters, and which are not padding."""
        targets = batch["text"]
        return next_character_nll(model, targets)[1], targets, targets != PAD

    def tokens(self, rows: pa.Table) -> list[int]:
        """Characters predicted per row: those before the padding."""
        return [len(text.rstrip("\n")) for text in rows["text"].to_pylist()]

    def tokenize(self, rows: pa.Table) -> list[list[int]]:
        """Code points of each row's characters before the padding (as many as ``tokens`` counts)."""
        return [list(text.rstrip("\n").encode("ascii")) for text in rows["text"].to_pylist()]

    def sequence_scores(self, model: nn.Module, texts: Sequence[str]) -> torch.Tensor:
        """Total NLL in nats of each text (unpadded, 1 to ``context`` characters) after BOS.

        For canary exposure: lower is more likely. Runs in eval mode without gradients and
        restores the model's mode.
        """
        if any(not 0 < len(text) <= self.context or "\n" in text for text in texts):
            raise ValueError(f"texts must have 1 to {self.context} characters and no newline")
        longest = max((len(text) for text in texts), default=0)
        scores = []
        with scoring(model) as device:
            for start in range(0, len(texts), SCORE_CHUNK):
                chunk = [text.ljust(longest, "\n") for text in texts[start : start + SCORE_CHUNK]]
                scores.append(
                    next_character_nll(model, encode(chunk, longest).to(device))[0].sum(dim=1).cpu()
                )
        return torch.cat(scores) if scores else torch.zeros(0)


def _characters(targets: torch.Tensor) -> torch.Tensor:
    return (targets != PAD).sum(dim=1).clamp(min=1)
