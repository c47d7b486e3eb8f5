"""The trial contract: govray owns the step, so the optimizer, the batch size and clipping are the
trial's resolved settings, not keys it reads from its hyperparameters; the probe hooks are
optional and have defaults; a trial's module is importable from its code directory."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from torch import nn

from govray.config.training import OptimizerConfig, OptimizerName, TrainingSettings
from govray.train.trial import ProbeHooks, Trial, defines_sequence_scores, importable, make_trial
from jobs.examples.digits.trial import DigitsTrial
from jobs.examples.text.trial import CharTransformerTrial

DIGITS = "jobs.examples.digits.trial:DigitsTrial"


def test_the_trial_builds_what_its_settings_say_not_what_its_hparams_say() -> None:
    """The driver resolves hyperparameters into the settings; a trial given settings builds the
    optimizer, batch size and clipping from them alone."""
    settings = TrainingSettings(
        optimizer=OptimizerConfig(name=OptimizerName.SGD, lr=0.2, momentum=0.9, weight_decay=1e-4),
        batch_size=7,
        max_grad_norm=0.5,
    )
    trial = make_trial(DIGITS, {"hidden": 8, "dropout": 0.0, "lr": 0.05, "batch_size": 16}, settings)
    assert isinstance(trial, DigitsTrial) and trial.settings is settings
    assert (trial.batch_size, trial.max_grad_norm) == (7, 0.5)
    optimizer = trial.build_optimizer(trial.build_model().parameters())
    assert type(optimizer) is torch.optim.SGD
    (group,) = optimizer.param_groups
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.2, 0.9, 1e-4)


@pytest.mark.parametrize(
    ("hparams", "kind", "expected"),
    [
        ({}, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.999), "eps": 1e-8}),
        ({"optimizer": "sgd", "lr": 0.05}, torch.optim.SGD, {"lr": 0.05, "momentum": 0, "weight_decay": 0}),
        (
            {"optimizer": "adam", "betas": [0.8, 0.9]},
            torch.optim.Adam,
            {"betas": (0.8, 0.9), "weight_decay": 0},
        ),
        ({"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0}, torch.optim.AdamW, {"weight_decay": 0.0}),
    ],
)
def test_a_trial_built_from_hparams_alone_resolves_them_over_the_defaults(
    hparams: dict[str, Any], kind: type[torch.optim.Optimizer], expected: dict[str, Any]
) -> None:
    """Off the driver (a trial built by hand, a run recorded before settings were resolved), the
    hyperparameters apply over the default settings; a setting left out is torch's default."""
    trial = CharTransformerTrial({"d_model": 8, "n_layers": 1, "n_heads": 2, "context": 16, **hparams})
    assert trial.settings == TrainingSettings().with_hyperparameters(hparams)
    optimizer = trial.build_optimizer(trial.build_model().parameters())
    assert type(optimizer) is kind
    (group,) = optimizer.param_groups
    assert {name: group[name] for name in expected} == expected


def test_a_trial_may_still_build_its_own_optimizer() -> None:
    class Rmsprop(DigitsTrial):
        def build_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.RMSprop(parameters, lr=self.settings.optimizer.lr)

    trial = Rmsprop({"hidden": 8, "dropout": 0.0}, TrainingSettings(optimizer=OptimizerConfig(lr=0.5)))
    optimizer = trial.build_optimizer(trial.build_model().parameters())
    assert type(optimizer) is torch.optim.RMSprop and optimizer.param_groups[0]["lr"] == 0.5


def test_probe_hooks_are_optional_with_defaults() -> None:
    """A trial without text has no tokens and cannot score canaries (the driver refuses a corpus
    with canaries for it); the entropy profile's default representation averages positions."""
    assert issubclass(Trial, ProbeHooks)
    assert not defines_sequence_scores(DigitsTrial) and defines_sequence_scores(CharTransformerTrial)
    digits = DigitsTrial({"hidden": 8, "dropout": 0.0})
    assert digits.tokens(pa.table({"label": [1, 2]})) is None
    with pytest.raises(NotImplementedError, match="DigitsTrial does not define sequence_scores"):
        digits.sequence_scores(digits.build_model(), ["x"])
    output = torch.arange(24.0).reshape(2, 3, 4)
    assert torch.equal(digits.representation("blocks.0", (output,)), output.mean(dim=1))


def test_importable_puts_a_code_directory_first_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    importable(tmp_path)
    importable(tmp_path)
    assert sys.path[0] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1
    before = list(sys.path)
    importable(tmp_path / "missing")
    importable("")  # a spec without a code directory
    assert sys.path == before
