"""The digits trial: a small MLP over 8x8 images, three ordered layers (embed, hidden, head).

Hyperparameters: ``hidden`` (width), ``dropout``. The optimizer, batch size and clipping are the
experiment's ``training`` settings (or the hyperparameters ``optimizer``, ``lr``, ``batch_size``,
``max_grad_norm`` ... that override them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from govray import Batch, Predictions, Trial

PIXELS = [f"p{index:02d}" for index in range(64)]


class DigitsMLP(nn.Module):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Linear(64, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)
        self.dropout = nn.Dropout(dropout)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.dropout(torch.relu(self.embed(pixels / 16.0)))
        x = self.dropout(torch.relu(self.hidden(x)))
        return self.head(x)


class DigitsTrial(Trial):
    def build_model(self) -> nn.Module:
        return DigitsMLP(hidden=int(self.hparams["hidden"]), dropout=float(self.hparams["dropout"]))

    def layers(self, model: nn.Module) -> Sequence[str]:
        return ["embed", "hidden", "head"]  # the dropout module holds no parameters

    def collate(self, rows: pa.Table) -> Batch:
        pixels = np.stack([rows[name].to_numpy(zero_copy_only=False) for name in PIXELS], axis=1)
        return {
            "pixels": torch.as_tensor(pixels.astype(np.float32)).reshape(rows.num_rows, 64),
            "label": torch.as_tensor(rows["label"].to_numpy(zero_copy_only=False).astype(np.int64)),
        }

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["pixels"]), batch["label"], reduction="none")

    def predictions(self, model: nn.Module, batch: Batch) -> Predictions:
        return model(batch["pixels"]), batch["label"], None

    def evaluate(self, model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        logits = model(batch["pixels"])
        return {
            "loss": F.cross_entropy(logits, batch["label"], reduction="none"),
            "accuracy": (logits.argmax(dim=1) == batch["label"]).float(),
        }
