"""A strategy owns its ``searcher:`` section: its model lives beside its ``plan`` and is found
through the same entry point, so a new strategy is one file and one entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from govray.config.experiment import ExperimentConfig, load_experiment
from govray.config.searcher import SEARCHER_GROUP, SearcherConfig, installed_searchers, searcher_model
from govray.core.errors import ConfigError
from govray.platform.run.preflight import config_digest
from jobs.examples.digits.golden import EXAMPLE_CONFIG
from tests.helpers.builders import REPO

SHIPPED = ["adaptive_asha", "asha", "bayesian", "grid", "pbt", "random", "single"]


def experiment(tmp_path: Path, searcher: Any) -> Path:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["data"]["corpora"] = [
        {**c, "path": str(EXAMPLE_CONFIG.parent / c["path"])} for c in raw["data"]["corpora"]
    ]
    raw["policy"] = {k: str(EXAMPLE_CONFIG.parent / v) for k, v in raw["policy"].items()}
    if searcher is None:
        raw.pop("searcher", None)
    else:
        raw["searcher"] = searcher
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_each_strategys_model_is_the_config_of_its_entry_points_module() -> None:
    found = installed_searchers()
    assert sorted(found) == SHIPPED
    for name, point in found.items():
        model = searcher_model(name)
        plan = point.load()
        assert model.__module__ == plan.__module__ == point.module, name
        assert issubclass(model, SearcherConfig) and model.model_fields["name"].annotation is not str


def test_a_section_is_validated_by_its_strategys_model_and_survives_a_round_trip(tmp_path: Path) -> None:
    section = {"name": "asha", "max_trials": 8, "divisor": 3, "max_length": {"batches": 27}}
    config = load_experiment(experiment(tmp_path, section))
    assert type(config.searcher) is searcher_model("asha")
    assert config.searcher.max_trials == 8  # type: ignore[attr-defined]
    dumped = config.model_dump(mode="json")["searcher"]
    assert dumped["max_trials"] == 8 and dumped["brackets"] == 1  # the strategy's fields, defaults too
    again = ExperimentConfig.model_validate_json(config.model_dump_json())
    assert again == config and config_digest(again) == config_digest(config)


def test_an_experiment_without_a_searcher_runs_single(tmp_path: Path) -> None:
    config = load_experiment(experiment(tmp_path, None))
    assert type(config.searcher) is searcher_model("single")
    assert config.searcher.metric == "validation_loss"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"name": "asha", "metric": "loss"}, r"searcher 'asha': max_trials is required"),
        (
            {"name": "grid", "max_concurrent_trials": 0},
            r"searcher 'grid': max_concurrent_trials should be",
        ),
        (
            {"name": "random", "max_trials": 2, "rungs": 3},
            r"searcher 'random': unknown field 'rungs'",
        ),
        (
            {"name": "adaptive_asha", "max_trials": 4, "bracket_rungs": [9]},
            r"searcher 'adaptive_asha': bracket_rungs must lie in 1..max_rungs \(5\)",
        ),
        ({"name": "single", "max_length": {}}, r"searcher 'single': max_length: give exactly one"),
    ],
)
def test_a_bad_section_names_the_strategy_and_the_field(tmp_path: Path, section: Any, message: str) -> None:
    path = experiment(tmp_path, section)
    with pytest.raises(ConfigError, match=rf"{path}: {message}"):
        load_experiment(path)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"name": "hyperband"},
            r"searcher: no searcher 'hyperband' is installed \(entry points govray\.searchers: ",
        ),
        (
            {"metric": "loss"},
            r"searcher: a searcher section is a mapping that names its strategy \(name: one of ",
        ),
        ("asha", r"searcher: a searcher section is a mapping that names its strategy \(name: one of "),
    ],
)
def test_an_unknown_or_missing_strategy_is_refused_naming_the_installed_ones(
    tmp_path: Path, section: Any, message: str
) -> None:
    path = experiment(tmp_path, section)
    with pytest.raises(ConfigError, match=rf"{path}: {message}{', '.join(SHIPPED)}\)$"):
        load_experiment(path)


HALVING = """
from typing import Literal

from pydantic import Field

from govray.config.searcher import SearcherConfig


class HalvingSearcher(SearcherConfig):
    name: Literal["halving"]
    rungs: int = Field(ge=2)


CONFIG = HalvingSearcher


def plan(config, max_steps):
    raise NotImplementedError
"""


@pytest.fixture
def one_more_strategy(tmp_path: Path) -> Iterator[Path]:
    """A strategy installed the way a package installs one: one module and one entry point."""
    root = tmp_path / "site"
    (root / "halving_strategy-1.0.dist-info").mkdir(parents=True)
    (root / "halving_strategy.py").write_text(HALVING)
    info = root / "halving_strategy-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: halving-strategy\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{SEARCHER_GROUP}]\nhalving = halving_strategy:plan\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("halving_strategy", None)


def test_a_new_strategy_needs_one_file_and_one_entry_point(tmp_path: Path, one_more_strategy: Path) -> None:
    config = load_experiment(experiment(tmp_path, {"name": "halving", "rungs": 3}))
    assert type(config.searcher).__name__ == "HalvingSearcher" and config.searcher.rungs == 3  # type: ignore[attr-defined]
    bad = experiment(tmp_path, {"name": "halving", "rungs": 1})
    with pytest.raises(ConfigError, match=r"searcher 'halving': rungs should be greater than or equal to 2"):
        load_experiment(bad)


def test_a_strategy_module_that_does_not_import_is_refused_naming_it(
    tmp_path: Path, one_more_strategy: Path
) -> None:
    (one_more_strategy / "halving_strategy.py").write_text("import a_package_nobody_installed\n" + HALVING)
    path = experiment(tmp_path, {"name": "halving", "rungs": 3})
    with pytest.raises(
        ConfigError, match=r"searcher: searcher 'halving': cannot import its module halving_strategy"
    ):
        load_experiment(path)


def test_a_strategy_module_without_a_config_model_is_refused(tmp_path: Path, one_more_strategy: Path) -> None:
    module = one_more_strategy / "halving_strategy.py"
    module.write_text(HALVING.replace("CONFIG = HalvingSearcher", ""))
    path = experiment(tmp_path, {"name": "halving", "rungs": 3})
    with pytest.raises(
        ConfigError, match=r"searcher: searcher 'halving': its module halving_strategy defines no CONFIG"
    ):
        load_experiment(path)


# Validates each named strategy's smallest section in this one fresh process and prints which heavy
# modules are loaded after each.
PROBE = """
import json, sys
from govray.config.searcher import searcher_model
for name in json.loads(sys.argv[1]):
    model = searcher_model(name)
    model.model_validate({"name": name, **json.loads(sys.argv[2]).get(name, {})})
    print(json.dumps([name, sorted(m for m in ("torch", "ray", "pyarrow") if m in sys.modules)]))
"""

TRIALS = {"max_trials": 4}
REQUIRED = {  # the fields a strategy has no default for
    "random": TRIALS,
    "asha": TRIALS,
    "adaptive_asha": TRIALS,
    "bayesian": TRIALS,
    "pbt": {
        "population_size": 2,
        "perturbation_interval": 4,
        "hyperparam_mutations": {"lr": {"type": "log", "minval": -3, "maxval": -1, "base": 10}},
    },
}


def test_every_installed_searcher_validates_without_ray_or_torch() -> None:
    names = sorted(installed_searchers())
    assert {"single", "grid", "random", "asha", "adaptive_asha", "pbt", "bayesian"} <= set(names)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(names), json.dumps(REQUIRED)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [[name, []] for name in names]
