"""``searcher: {name: asha}``: Determined's adaptive ASHA on Ray Tune's ``ASHAScheduler``.

Determined's fields map as: ``max_length`` → ``max_t`` (in steps, Tune's time attribute
``step``), ``divisor`` → ``reduction_factor``, ``max_rungs`` → ``grace_period = max_t /
divisor^(max_rungs - 1)`` (rounded down, at least 1), ``brackets`` → ``brackets``; ``max_trials``
random samples (seeded), at most ``max_concurrent_trials`` at a time. Trials validate every
``grace_period`` steps unless the experiment sets ``min_validation_period``, so every rung sees a
report; the objective they report is penalized by memorization.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SearcherConfig, TunePlan


class AshaSearcher(SearcherConfig):
    """Determined's adaptive ASHA; ``grace_period = max_length / divisor**(max_rungs-1)``."""

    name: Literal["asha"]
    max_trials: int = Field(ge=1)
    max_concurrent_trials: int = Field(default=1, ge=1)
    time_metric: str = "batches"
    divisor: float = Field(default=4.0, gt=1.0)
    max_rungs: int = Field(default=5, ge=1)
    brackets: int = Field(default=1, ge=1)


CONFIG = AshaSearcher


def grace_period(max_t: int, divisor: float, max_rungs: int) -> int:
    return max(1, int(max_t / divisor ** (max_rungs - 1)))


def rung_steps(max_t: int, grace: int, divisor: float) -> list[int]:
    """The steps of ASHA's rungs (its first bracket's): grace·divisor^k up to ``max_t``, each
    rounded up, since a trial passes a rung at its first report at or after it."""
    rungs = []
    milestone: float = grace
    while milestone <= max_t:
        rungs.append(math.ceil(milestone))
        milestone *= divisor
    return rungs


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    from ray.tune.schedulers import ASHAScheduler

    from searchers.space import sampled_space, seeded_samples

    searcher = config.searcher
    assert isinstance(searcher, AshaSearcher)
    grace = grace_period(max_steps, searcher.divisor, searcher.max_rungs)
    return TunePlan(
        param_space=sampled_space(config),
        num_samples=searcher.max_trials,
        max_concurrent_trials=searcher.max_concurrent_trials,
        search_alg=seeded_samples(config, searcher.max_concurrent_trials),
        scheduler=ASHAScheduler(
            time_attr="step",
            max_t=max_steps,
            grace_period=grace,
            reduction_factor=searcher.divisor,
            brackets=searcher.brackets,
        ),
        validation_period=grace,
        notes={
            "max_t": max_steps,
            "grace_period": grace,
            "rungs": rung_steps(max_steps, grace, searcher.divisor),
        },
    )
