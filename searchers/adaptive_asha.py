"""``searcher: {name: adaptive_asha}``: Determined's adaptive ASHA on Ray Tune's ASHA brackets.

Determined (``master/pkg/searcher/adaptive_asha.go``) runs one asynchronous successive-halving
search per bracket. A bracket is named by its number of rungs ``r``; its rungs lie at
``max_length / divisor**k`` for ``k = r-1 .. 0``, so a bracket of fewer rungs starts later and
stops less. The mode picks the brackets (``max_rungs`` clamped first, as Determined does, so that
the first rung is at least one step and one rung's survivors are at least one trial):

- ``aggressive``: ``[max_rungs]``;
- ``standard``: ``(max_rungs-1)//2 + 1 .. max_rungs``;
- ``conservative``: ``1 .. max_rungs``.

``max_trials`` is split so each bracket gets roughly the same training budget (weight
``divisor**(r-1) / r``, at least one trial each, the remainder to the bracket that stops most), and
``max_concurrent_trials`` evenly, the remainder again to the brackets that stop most.

On Tune, a bracket of ``r`` rungs is ASHA's bracket ``s = max_rungs - r`` (grace period
``max_length / divisor**(max_rungs-1)``): the same milestones, the same rule (a trial continues
past a rung only in the top ``1/divisor`` of the results recorded there). Where Tune draws each
trial's bracket at random, ``DeterminedBrackets`` (``searchers.brackets``) assigns it by the
quotas above, so a search's brackets are a function of its config (reproducible), and a trial goes
to a bracket with a free concurrency slot. Trials validate at every rung; a stop is recorded as a
scheduler early stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from govray.config.experiment import ExperimentConfig
from govray.config.searcher import SearcherConfig, TunePlan
from searchers.asha import grace_period


class AdaptiveAshaSearcher(SearcherConfig):
    """Determined's ``adaptive_asha``: asynchronous successive halving in several brackets.

    ``mode`` picks the brackets as Determined does (each bracket named by its number of rungs,
    ``max_rungs`` at most): ``aggressive`` one bracket of ``max_rungs``; ``standard`` the brackets
    of ``(max_rungs - 1) // 2 + 1`` to ``max_rungs`` rungs; ``conservative`` those of 1 to
    ``max_rungs``. ``bracket_rungs`` names them instead. A bracket of ``r`` rungs has its first rung
    at ``max_length / divisor**(r - 1)``: fewer rungs, less early stopping.
    """

    name: Literal["adaptive_asha"]
    max_trials: int = Field(ge=1)
    max_concurrent_trials: int = Field(default=1, ge=1)
    mode: Literal["aggressive", "standard", "conservative"] = "standard"
    divisor: float = Field(default=4.0, gt=1.0)
    max_rungs: int = Field(default=5, ge=1)
    bracket_rungs: list[int] = Field(default_factory=list)

    @model_validator(mode="after")
    def _rungs_within_max(self) -> AdaptiveAshaSearcher:
        if any(not 1 <= rungs <= self.max_rungs for rungs in self.bracket_rungs):
            raise ValueError(f"bracket_rungs must lie in 1..max_rungs ({self.max_rungs})")
        if len(set(self.bracket_rungs)) != len(self.bracket_rungs):
            raise ValueError("bracket_rungs names a bracket twice")
        return self


CONFIG = AdaptiveAshaSearcher


def mode_brackets(mode: str, max_rungs: int) -> list[int]:
    """The brackets' numbers of rungs for Determined's ``mode``, most early stopping first.

    >>> mode_brackets("standard", 5)
    [5, 4, 3]
    """
    if mode == "aggressive":
        rungs = [max_rungs]
    elif mode == "standard":
        rungs = list(range((max_rungs - 1) // 2 + 1, max_rungs + 1))
    else:
        rungs = list(range(1, max_rungs + 1))
    return sorted(rungs, reverse=True)


def clamped_max_rungs(max_rungs: int, max_steps: int, max_trials: int, divisor: float) -> int:
    """Determined's clamp: no rung below one step, no rung that keeps less than one trial."""
    return max(
        1,
        min(
            max_rungs,
            int(math.log(max_steps) / math.log(divisor)) + 1,
            int(math.log(max_trials) / math.log(divisor)) + 1,
        ),
    )


def bracket_max_trials(max_trials: int, divisor: float, brackets: list[int]) -> list[int]:
    """Trials per bracket for roughly equal training budget per bracket (Determined's weights)."""
    weights = [divisor ** (rungs - 1) / rungs for rungs in brackets]
    total = sum(weights)
    trials = [max(int(weight / total * max_trials), 1) for weight in weights]
    trials[0] += max(max_trials - sum(trials), 0)
    return trials


def bracket_max_concurrent(max_concurrent: int, brackets: int) -> list[int]:
    """``max_concurrent`` split evenly, the remainder to the brackets that stop most."""
    max_concurrent = max(max_concurrent, brackets)
    share, remainder = divmod(max_concurrent, brackets)
    return [share + (1 if index < remainder else 0) for index in range(brackets)]


@dataclass(frozen=True)
class BracketPlan:
    rungs: int  # its number of rungs
    max_trials: int
    max_concurrent: int
    milestones: tuple[int, ...]  # the steps of its rungs, first to last


def bracket_plans(searcher: AdaptiveAshaSearcher, max_steps: int) -> tuple[int, list[BracketPlan]]:
    """(grace period, the brackets) of a search whose trials train ``max_steps`` steps."""
    max_rungs = clamped_max_rungs(searcher.max_rungs, max_steps, searcher.max_trials, searcher.divisor)
    rungs = sorted({min(r, max_rungs) for r in searcher.bracket_rungs}, reverse=True) or mode_brackets(
        searcher.mode, max_rungs
    )
    grace = grace_period(max_steps, searcher.divisor, max_rungs)
    trials = bracket_max_trials(searcher.max_trials, searcher.divisor, rungs)
    concurrent = bracket_max_concurrent(searcher.max_concurrent_trials, len(rungs))
    plans = []
    for index, count in enumerate(rungs):
        first = max_rungs - count
        early = [min(max_steps, int(grace * searcher.divisor**k)) for k in range(first, max_rungs - 1)]
        milestones = (*early, max_steps)
        plans.append(BracketPlan(count, trials[index], concurrent[index], milestones))
    return grace, plans


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    from searchers.brackets import DeterminedBrackets
    from searchers.space import sampled_space, seeded_samples

    searcher = config.searcher
    assert isinstance(searcher, AdaptiveAshaSearcher)
    grace, plans = bracket_plans(searcher, max_steps)
    return TunePlan(
        param_space=sampled_space(config),
        num_samples=searcher.max_trials,
        max_concurrent_trials=searcher.max_concurrent_trials,
        search_alg=seeded_samples(config, searcher.max_concurrent_trials),
        scheduler=DeterminedBrackets(grace, max_steps, searcher.divisor, plans),
        validation_period=grace,
        notes={
            "max_t": max_steps,
            "grace_period": grace,
            "rungs": list(plans[0].milestones),  # the steps of every rung (the first bracket has all)
            "brackets": [
                {"rungs": p.rungs, "max_trials": p.max_trials, "max_concurrent_trials": p.max_concurrent}
                for p in plans
            ],
        },
    )
