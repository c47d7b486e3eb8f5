"""The digits trial, reporting how each model was built: every ``build_model`` call writes one JSON
file into the directory its hyperparameter ``probe_dir`` names — the process, torch's default
device (``meta`` where only routing was wanted), whether deterministic algorithms were on, and the
deterministic-mode variables of its environment. The arithmetic is the digits trial's."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import torch
from torch import nn

from govray.train.reproduce.record import DETERMINISTIC_ENV
from jobs.examples.digits.trial import DigitsTrial


class ProbedDigitsTrial(DigitsTrial):
    def build_model(self) -> nn.Module:
        built = {
            "pid": os.getpid(),
            "device": torch.get_default_device().type,
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "env": {name: os.environ.get(name) for name in DETERMINISTIC_ENV},
        }
        path = Path(str(self.hparams["probe_dir"])) / f"{uuid.uuid4().hex}.json"
        path.write_text(json.dumps(built))
        return super().build_model()


def builds(directory: Path) -> list[dict[str, object]]:
    """What every build under ``directory`` recorded."""
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]
