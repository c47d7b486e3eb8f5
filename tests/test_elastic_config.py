"""``resources.workers: {min: A, max: B}``: an elastic run. Its schedule is defined on B workers,
Ray Train starts it once A fit and grows it to B, a lost node is not fatal, and what elastic
rounds cannot run exactly is refused as a config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from govray.config.experiment import ExperimentConfig, load_experiment
from govray.config.resources import Resources
from govray.core.errors import ConfigError
from govray.platform.rerun.resume import on_workers
from govray.platform.run.runner import failure_config_for, scaling_config_for
from jobs.examples.digits.golden import EXAMPLE_CONFIG

ELASTIC = {"workers": {"min": 2, "max": 3}, "resize_check_s": 2}


def example(**resources: Any) -> dict[str, Any]:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["resources"] = {**raw["resources"], **resources}
    return raw


def test_a_number_of_workers_stays_a_fixed_size_run_with_the_same_digest() -> None:
    config = load_experiment(EXAMPLE_CONFIG)
    resources = config.resources
    assert (resources.elastic, resources.min_workers, resources.max_workers) == (False, 2, 2)
    # Serialized (and digested) as before workers could be a range: no resize_check_s.
    assert config.model_dump(mode="json")["resources"] == {
        "workers": 2,
        "use_gpu": False,
        "cpus_per_worker": 1.0,
        "placement_strategy": "PACK",
    }
    scaling, failures = scaling_config_for(config, local=False), failure_config_for(config)
    assert (scaling.num_workers, failures.max_failures) == (2, config.max_restarts)


def test_a_range_of_workers_is_an_elastic_run_on_ray_trains_elastic_scaling() -> None:
    config = ExperimentConfig.model_validate(example(**ELASTIC))
    resources = config.resources
    assert (resources.elastic, resources.min_workers, resources.max_workers) == (True, 2, 3)
    assert resources.describe_workers() == "2 to 3 workers (elastic)"
    assert config.model_dump(mode="json")["resources"]["workers"] == {"min": 2, "max": 3}
    assert ExperimentConfig.model_validate(config.model_dump(mode="json")) == config
    scaling = scaling_config_for(config, local=False)
    assert scaling.num_workers == (2, 3)
    assert scaling.elastic_resize_monitor_interval_s == 2  # type: ignore[attr-defined]
    # Ray Train V2 counts a node lost without notice against max_failures: never fatal here.
    assert failure_config_for(config).max_failures == -1


def test_a_range_of_one_size_is_a_fixed_size_run() -> None:
    resources = Resources.model_validate({"workers": {"min": 3, "max": 3}})
    assert (resources.elastic, resources.max_workers, resources.describe_workers()) == (False, 3, "3 workers")


def test_resume_on_a_number_of_workers_turns_an_elastic_config_into_a_fixed_size_one() -> None:
    config = ExperimentConfig.model_validate(example(**ELASTIC))
    assert on_workers(config, None) is config
    two = on_workers(config, 2)
    assert (two.resources.workers, two.resources.elastic) == (2, False)
    assert two.model_copy(update={"resources": config.resources}) == config


@pytest.mark.parametrize(
    ("resources", "sentence"),
    [
        ({"workers": 0}, "resources.workers: is 0: a run needs at least 1 worker"),
        ({"workers": {"min": 3, "max": 2}}, "resources.workers: min (3) is above max (2)"),
        (
            {"workers": {"min": 0, "max": 2}},
            "resources.workers: min and max are numbers of workers, at least 1 (min 0, max 2)",
        ),
        (
            {"workers": {"min": 2}},
            "resources.workers: is {'min': 2}: a number of workers, or an elastic range {min: A, max: B}",
        ),
        (
            {"workers": 3, "resize_check_s": 5},
            "resources: resources.resize_check_s is how often an elastic run looks for room to grow: "
            "it needs workers: {min: A, max: B} with A < B",
        ),
        (
            {"workers": {"min": 1, "max": 3}, "strategy": "fsdp"},
            "resources: strategy fsdp shards the model across workers: it needs workers >= 2",
        ),
        (
            {"workers": {"min": 4, "max": 8}, "strategy": "hsdp", "shard_group": 2},
            "resources: strategy hsdp with elastic workers: Ray Train may resize the run to any number "
            "of workers between min and max, and HSDP needs whole shard groups of resources.shard_group "
            "(two or more); use strategy fsdp, or a fixed number of workers (`govray resume --workers "
            "N` moves an HSDP run to another multiple of its group)",
        ),
    ],
)
def test_an_elastic_range_a_run_cannot_take_is_refused_as_a_sentence(
    tmp_path: Path, resources: dict[str, Any], sentence: str
) -> None:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["resources"] = resources
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as refused:
        load_experiment(path)
    assert str(refused.value) == f"{path}: {sentence}"


def test_fp16_and_searches_are_refused_with_elastic_workers() -> None:
    """fp16's per-route loss scales need one slot per worker, which a smaller world breaks; a
    search's trials hold a fixed number of workers across their rungs."""
    fp16 = {**example(**ELASTIC), "training": {"precision": "fp16"}}
    with pytest.raises(ValueError, match="precision fp16 with elastic workers"):
        ExperimentConfig.model_validate(fp16)
    grid = {**example(**ELASTIC), "searcher": {"name": "grid", "metric": "validation_loss"}}
    with pytest.raises(ValueError, match="elastic workers train one run; searcher 'grid'"):
        ExperimentConfig.model_validate(grid)
    fixed_fp16 = {**example(workers=3), "training": {"precision": "fp16"}}
    assert ExperimentConfig.model_validate(fixed_fp16).training.precision == "fp16"
