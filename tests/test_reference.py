"""The reference of the files a user writes is the models that read them (issue 50, item 1): the
JSON Schemas and ``docs/reference.md`` in the repository are what the models give now (drift
fails here), every example validates under both its schema and its model, what a model refuses
its schema refuses too (so an editor flags it), and ``govray schema NAME`` prints the same file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from govray.cli import main
from govray.config.schemas import DOCUMENTS, REFERENCE, SCHEMA_DIR, drifted, schema

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((REPO / "jobs" / "examples").glob("*/experiment.yaml"))


def _plain(text: str) -> Any:
    """A YAML document as an editor's schema check sees it (dates as strings)."""
    return json.loads(json.dumps(yaml.safe_load(text), default=str))


def test_the_schemas_and_reference_in_the_repository_are_what_the_models_give() -> None:
    stale = drifted(REPO)
    assert not stale, f"regenerate with `python -m govray.config.schemas --write`: {stale}"
    reference = (REPO / REFERENCE).read_text()
    for name, document in DOCUMENTS.items():
        assert f"## {name}" in reference and document.example.rstrip() in reference
        for key in schema(name)["properties"]:
            assert f"| `{key}` |" in reference, (name, key)


def test_every_example_validates_under_its_schema_and_its_model() -> None:
    examples = [(name, document.example) for name, document in DOCUMENTS.items()]
    examples += [("experiment", path.read_text()) for path in EXPERIMENTS]
    examples += [("policy", path.read_text()) for path in sorted((REPO / "policies").glob("*.policy.yaml"))]
    examples += [("trust", (REPO / "policies" / "trust.yaml").read_text())]
    assert len(EXPERIMENTS) == 3
    for name, text in examples:
        jsonschema.validate(_plain(text), schema(name))
        DOCUMENTS[name].model.model_validate(_plain(text))


def _experiment() -> dict[str, Any]:
    return _plain(DOCUMENTS["experiment"].example)


def _unknown_key(document: dict[str, Any]) -> None:
    document["chekpoint"] = {"period": 10}


def _unknown_credential_field(document: dict[str, Any]) -> None:
    document["data"]["corpora"][0]["credential"]["licence_class"] = "open"


def _another_strategys_field(document: dict[str, Any]) -> None:
    document["searcher"] = {"name": "grid", "metric": "validation_loss", "max_trials": 4}


def _unknown_strategy(document: dict[str, Any]) -> None:
    document["searcher"]["name"] = "hyperband-ish"


def _a_range_hyperparameter_without_its_bounds(document: dict[str, Any]) -> None:
    document["hyperparameters"]["lr"] = {"type": "log", "minval": -3}


@pytest.mark.parametrize(
    "change",
    [
        _unknown_key,
        _unknown_credential_field,
        _another_strategys_field,
        _unknown_strategy,
        _a_range_hyperparameter_without_its_bounds,
    ],
)
def test_what_the_experiment_model_refuses_its_schema_refuses(change: Any) -> None:
    document = _experiment()
    change(document)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, schema("experiment"))
    with pytest.raises(ValueError):  # (pydantic's ValidationError is a ValueError)
        DOCUMENTS["experiment"].model.model_validate(document)


def test_a_policy_rule_with_an_unknown_route_key_is_refused_by_both() -> None:
    policy = _plain(DOCUMENTS["policy"].example)
    policy["rules"][1]["route"] = {"deepth": {"min": -2}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(policy, schema("policy"))
    with pytest.raises(ValueError):
        DOCUMENTS["policy"].model.model_validate(policy)


def test_govray_schema_prints_the_repositorys_file_and_names_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["schema", "trust"]) == 0
    assert capsys.readouterr().out == (REPO / SCHEMA_DIR / "trust.schema.json").read_text()
    assert main(["schema", "experimnet"]) != 0
    assert "one of: experiment, policy, trust, settings, serve" in capsys.readouterr().err


def test_the_example_experiment_files_name_their_schema_for_editors() -> None:
    for path in EXPERIMENTS:
        first = path.read_text().splitlines()[0]
        found = re.fullmatch(r"# yaml-language-server: \$schema=(\S+)", first)
        assert found, path
        assert (path.parent / found.group(1)).resolve() == REPO / SCHEMA_DIR / "experiment.schema.json"
