"""The trial of ``data_scale``: a small MLP over eight generated features (``f0``..``f7``) and a
label, split into three layers so the digits policy's routes have layers to update."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from govray import Batch, Trial

FEATURES = [f"f{index}" for index in range(8)]


class ScaleMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(len(FEATURES), 32)
        self.hidden = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.embed(features)))))


class ScaleTrial(Trial):
    def build_model(self) -> nn.Module:
        return ScaleMLP()

    def layers(self, model: nn.Module) -> Sequence[str]:
        return ["embed", "hidden", "head"]

    def collate(self, rows: pa.Table) -> Batch:
        columns = [rows[name].to_numpy(zero_copy_only=False) for name in FEATURES]
        features = np.stack(columns, axis=1) if rows.num_rows else np.zeros((0, len(FEATURES)))
        return {
            "features": torch.as_tensor(features.astype(np.float32)),
            "label": torch.as_tensor(rows["label"].to_numpy(zero_copy_only=False).astype(np.int64)),
        }

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["features"]), batch["label"], reduction="none")
