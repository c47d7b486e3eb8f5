"""The digits trial, slowed down: the same arithmetic, so its weights equal the golden run's, but
each step takes long enough for a test to pause or kill the run in the middle (``STEP_SECONDS``,
or the hyperparameter ``step_seconds``: 0 runs at the digits trial's own speed)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from jobs.examples.digits.trial import DigitsTrial

STEP_SECONDS = 0.25


class SlowDigitsTrial(DigitsTrial):
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(float(self.hparams.get("step_seconds", STEP_SECONDS)))
        return super().loss(model, batch)
