"""``searcher: {name: bayesian}``: Tree-structured Parzen Estimator search through Ray Tune's
Optuna integration, seeded by the experiment's seed: ``n_startup_trials`` random points, then
TPE proposals from the reported objectives; ``max_trials`` in all, at most
``max_concurrent_trials`` at a time."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SearcherConfig, TunePlan


class BayesianSearcher(SearcherConfig):
    name: Literal["bayesian"]
    max_trials: int = Field(ge=1)
    max_concurrent_trials: int = Field(default=1, ge=1)
    n_startup_trials: int = Field(default=4, ge=1)


CONFIG = BayesianSearcher


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    from searchers.space import sampled_space

    searcher = config.searcher
    assert isinstance(searcher, BayesianSearcher)
    sampler = optuna.samplers.TPESampler(seed=config.seed, n_startup_trials=searcher.n_startup_trials)
    algorithm = OptunaSearch(
        sampler=sampler,
        metric="objective",
        mode="min" if searcher.smaller_is_better else "max",
    )
    return TunePlan(
        param_space=sampled_space(config),
        num_samples=searcher.max_trials,
        max_concurrent_trials=searcher.max_concurrent_trials,
        search_alg=algorithm,  # Tune limits it to max_concurrent_trials
    )
