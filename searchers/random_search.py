"""``searcher: {name: random}``: ``max_trials`` points sampled from the space, seeded by the
experiment's seed (the same experiment samples the same points)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SearcherConfig, TunePlan


class RandomSearcher(SearcherConfig):
    name: Literal["random"]
    max_trials: int = Field(ge=1)
    max_concurrent_trials: int = Field(default=1, ge=1)


CONFIG = RandomSearcher


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    from searchers.space import sampled_space, seeded_samples

    searcher = config.searcher
    assert isinstance(searcher, RandomSearcher)
    return TunePlan(
        param_space=sampled_space(config),
        num_samples=searcher.max_trials,
        max_concurrent_trials=searcher.max_concurrent_trials,
        search_alg=seeded_samples(config, searcher.max_concurrent_trials),
    )
