"""``searcher: {name: pbt}``: Population Based Training on Ray Tune.

``population_size`` trials train side by side; every ``perturbation_interval`` steps each one
validates and checkpoints (a signed govray checkpoint held by the Tune checkpoint), and the bottom
``quantile_fraction`` exploit the top: they continue a donor's full state — weights, optimizer,
ledger, decisions — with mutated hyperparameters (resampled from ``hyperparam_mutations`` with
``resample_probability``, else perturbed). A clone records the donor as ``cloned_from``, and its
ledger includes the donor's, so lineage stays true across exploits. ``batch_size`` cannot be
mutated: it fixes the schedule a clone continues.

Synchronous, as Tune's ``synch=True`` (its decisions do not depend on timing), but a perturbation
restarts only the trials it exploits: the others keep their actors and workers
(``searchers.pbt_scheduler``). Seeded: the initial population is sampled and every perturbation
drawn from the experiment's seed, so the same experiment searches the same way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from govray.config.experiment import ExperimentConfig
from govray.config.hyperparameters import Hyperparameter
from govray.config.searcher import SearcherConfig, TunePlan
from govray.core.errors import ConfigError


class PbtSearcher(SearcherConfig):
    name: Literal["pbt"]
    population_size: int = Field(ge=2)
    perturbation_interval: int = Field(ge=1)  # in batches
    hyperparam_mutations: dict[str, Hyperparameter] = Field(min_length=1)
    quantile_fraction: float = Field(default=0.25, gt=0.0, le=0.5)
    resample_probability: float = Field(default=0.25, ge=0.0, le=1.0)


CONFIG = PbtSearcher


def plan(config: ExperimentConfig, max_steps: int) -> TunePlan:
    from govray.data.permutation import derive_seed
    from searchers.pbt_scheduler import SynchronousPbt
    from searchers.space import sampled, sampled_space, seeded_samples

    searcher = config.searcher
    assert isinstance(searcher, PbtSearcher)
    unknown = sorted(set(searcher.hyperparam_mutations) - set(config.hyperparameters))
    if unknown:
        raise ConfigError(
            f"searcher.hyperparam_mutations names unknown hyperparameters: {', '.join(unknown)}"
        )
    if "batch_size" in searcher.hyperparam_mutations:
        raise ConfigError(
            "searcher.hyperparam_mutations: batch_size fixes the schedule a PBT clone continues"
        )
    return TunePlan(
        param_space=sampled_space(config),
        num_samples=searcher.population_size,
        max_concurrent_trials=searcher.population_size,
        # The initial population and every perturbation drawn from the experiment's seed.
        search_alg=seeded_samples(config, searcher.population_size),
        scheduler=SynchronousPbt(
            trial_resources=trial_resources(config),
            seed=derive_seed(config.seed, 0, "pbt"),
            time_attr="step",
            perturbation_interval=searcher.perturbation_interval,
            hyperparam_mutations={name: sampled(hp) for name, hp in searcher.hyperparam_mutations.items()},
            quantile_fraction=searcher.quantile_fraction,
            resample_probability=searcher.resample_probability,
        ),
        validation_period=searcher.perturbation_interval,
        notes={"perturbation_interval": searcher.perturbation_interval},
    )


def trial_resources(config: ExperimentConfig) -> dict[str, float]:
    """What one trial's workers hold (a waiting trial keeps them)."""
    workers = config.resources.max_workers
    held = {"CPU": workers * config.resources.cpus_per_worker}
    return held | ({"GPU": float(workers)} if config.resources.use_gpu else {})
