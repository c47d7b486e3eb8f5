"""``searcher: {name: single}``: one trial with the default point of the space."""

from __future__ import annotations

from govray.config.experiment import ExperimentConfig
from govray.platform.search import TunePlan


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    return TunePlan(param_space=config.default_hparams(), num_samples=1, max_concurrent_trials=1)
