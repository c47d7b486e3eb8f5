"""``searcher: {name: single}``: one trial with the default point of the space."""

from __future__ import annotations

from typing import Literal

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SearcherConfig, TunePlan


class SingleSearcher(SearcherConfig):
    """The default when an experiment has no ``searcher:`` section."""

    name: Literal["single"] = "single"


CONFIG = SingleSearcher


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    return TunePlan(param_space=config.default_hparams(), num_samples=1, max_concurrent_trials=1)
