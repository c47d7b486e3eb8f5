"""The digits trial: a small MLP over 8x8 images, three ordered layers (embed, hidden, head)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from govray.harness.trial import Trial


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
