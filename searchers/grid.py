"""``searcher: {name: grid}``: every combination of the hyperparameters' grid points, once."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SearcherConfig, TunePlan


class GridSearcher(SearcherConfig):
    name: Literal["grid"]
    max_concurrent_trials: int = Field(default=1, ge=1)


CONFIG = GridSearcher


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    from searchers.space import grid_size, grid_space

    searcher = config.searcher
    assert isinstance(searcher, GridSearcher)
    return TunePlan(
        param_space=grid_space(config),
        num_samples=1,  # grid_search already enumerates every point
        max_concurrent_trials=searcher.max_concurrent_trials,
        notes={"trials": grid_size(config)},
    )
