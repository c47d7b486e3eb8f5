"""The digits trial with an injected fp16 overflow: the loss of every row of the PII corpus
(``digits-writers``, routed to the adapter) is multiplied by ``BOOST``, so under fp16 its route's
gradients overflow at the starting loss scales while the other routes' do not."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from jobs.examples.digits.trial import DigitsTrial

BOOST = 8.0
OVERFLOWING_CORPUS = "digits-writers"


class OverflowDigitsTrial(DigitsTrial):
    def collate(self, rows: pa.Table) -> dict[str, torch.Tensor]:
        batch = super().collate(rows)
        boosted = pc.equal(rows["_corpus"], OVERFLOWING_CORPUS).to_numpy(zero_copy_only=False)
        batch["boost"] = torch.as_tensor(1.0 + (BOOST - 1.0) * boosted.astype("float32"))
        return batch

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return super().loss(model, batch) * batch["boost"]
