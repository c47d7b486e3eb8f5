"""The experiment's hyperparameters as Ray Tune search spaces (Determined's types, one mapping).

    const        → the value itself
    int          → tune.randint(minval, maxval + 1)             (both bounds inclusive, as in Determined)
    double       → tune.uniform(minval, maxval)
    log          → tune.loguniform(base**minval, base**maxval, base)
    categorical  → tune.choice(vals)

For grid search every non-constant hyperparameter becomes ``tune.grid_search`` over its points:
``count`` evenly spaced values of a range (rounded and deduplicated for ``int``), every value of a
categorical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ray import tune
from ray.tune.search.basic_variant import BasicVariantGenerator

from govray.config.experiment import ExperimentConfig
from govray.config.hyperparameters import CategoricalHP, ConstHP, DoubleHP, Hyperparameter, IntHP, LogHP
from govray.core.errors import ConfigError


def sampled(hp: Hyperparameter) -> Any:
    """A Tune domain sampling ``hp`` (or the constant)."""
    if isinstance(hp, ConstHP):
        return hp.val
    if isinstance(hp, CategoricalHP):
        return tune.choice(hp.vals)
    if isinstance(hp, IntHP):
        return tune.randint(hp.minval, hp.maxval + 1)
    if isinstance(hp, LogHP):
        return tune.loguniform(hp.base**hp.minval, hp.base**hp.maxval, base=hp.base)
    assert isinstance(hp, DoubleHP)
    return tune.uniform(hp.minval, hp.maxval)


def grid_points(name: str, hp: Hyperparameter) -> list[Any]:
    """The values grid search tries for ``hp``."""
    if isinstance(hp, ConstHP):
        return [hp.val]
    if isinstance(hp, CategoricalHP):
        return list(hp.vals)
    if hp.count is None:
        raise ConfigError(f"hyperparameters.{name}: grid search needs 'count' (how many points of the range)")
    points = np.linspace(hp.minval, hp.maxval, hp.count)
    if isinstance(hp, IntHP):
        return sorted({round(float(p)) for p in points})
    if isinstance(hp, LogHP):
        return [float(hp.base**p) for p in points]
    return [float(p) for p in points]


def sampled_space(config: ExperimentConfig) -> dict[str, Any]:
    return {name: sampled(hp) for name, hp in config.hyperparameters.items()}


def grid_space(config: ExperimentConfig) -> dict[str, Any]:
    space: dict[str, Any] = {}
    for name, hp in config.hyperparameters.items():
        points = grid_points(name, hp)
        space[name] = points[0] if isinstance(hp, ConstHP) else tune.grid_search(points)
    return space


def grid_size(config: ExperimentConfig) -> int:
    size = 1
    for name, hp in config.hyperparameters.items():
        size *= len(grid_points(name, hp))
    return size


def seeded_samples(config: ExperimentConfig, max_concurrent: int) -> BasicVariantGenerator:
    """Tune's random sampler seeded by the experiment's seed, running at most ``max_concurrent``
    trials at a time (Tune ignores ``TuneConfig.max_concurrent_trials`` once a sampler is given,
    so the sampler itself must hold the limit)."""
    return BasicVariantGenerator(random_state=config.seed, max_concurrent=max_concurrent)
