"""``searcher: {name: random}``: ``max_trials`` points sampled from the space, seeded by the
experiment's seed (the same experiment samples the same points)."""

from __future__ import annotations

from govray.config.experiment import ExperimentConfig, RandomSearcher
from govray.platform.search import TunePlan
from searchers.space import sampled_space, seeded_samples


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    searcher = config.searcher
    assert isinstance(searcher, RandomSearcher)
    return TunePlan(
        param_space=sampled_space(config),
        num_samples=searcher.max_trials,
        max_concurrent_trials=searcher.max_concurrent_trials,
        search_alg=seeded_samples(config, searcher.max_concurrent_trials),
    )
