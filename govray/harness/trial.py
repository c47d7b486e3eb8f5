"""The trial: what a user writes. govray supplies data, DDP, governance and checkpoints.

Example::

    class DigitsTrial(Trial):
        def build_model(self) -> nn.Module:
            return DigitsMLP(hidden=self.hparams["hidden"])

        def layers(self, model: nn.Module) -> list[str]:
            return ["embed", "hidden", "head"]      # optional: default = top-level children
"""

from __future__ import annotations

import importlib
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from govray.errors import ConfigError


class Trial(ABC):
    """Base class of user trials; ``hparams`` are one sample of the experiment's space."""

    def __init__(self, hparams: Mapping[str, Any]) -> None:
        self.hparams = dict(hparams)

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model; govray seeds the generator before calling it."""

    def layers(self, model: nn.Module) -> Sequence[str] | None:
        """The model's ordered layers (module names) for depth ranges; None: top-level children."""
        return None


def load_trial_class(path: str) -> type[Trial]:
    """Import ``"package.module:Class"`` and check it is a :class:`Trial`.

    Like ``python -m``, the working directory is importable: it is the trial's code directory
    (the project root locally, the job's ``working_dir`` under ``ray job submit``).
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"trial '{path}': cannot import module '{module_name}': {error}") from None
    trial = getattr(module, class_name, None)
    if not (isinstance(trial, type) and issubclass(trial, Trial)):
        raise ConfigError(f"trial '{path}': '{class_name}' is not a govray Trial subclass in {module_name}")
    return trial
