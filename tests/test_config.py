"""Experiment files: the example loads; errors name the file and the field path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from govray.config.data import CorpusFormat
from govray.config.experiment import load_canaries, load_experiment
from govray.config.hyperparameters import CategoricalHP, ConstHP, IntHP, LogHP, default_point_said
from govray.config.searcher import searcher_model
from govray.config.training import OptimizerConfig, OptimizerName, TrainingSettings
from govray.core.errors import ConfigError
from govray.governance.credentials import Credential
from jobs.examples.digits.golden import EXAMPLE_CONFIG
from tests.helpers.builders import BASE_CREDENTIAL


def test_example_experiment_loads_with_paths_relative_to_the_file() -> None:
    config = load_experiment(EXAMPLE_CONFIG)
    assert [c.id for c in config.data.corpora] == ["digits-public", "digits-licensed", "digits-writers"]
    assert [c.resolved_format for c in config.data.corpora] == [
        CorpusFormat.PARQUET,
        CorpusFormat.JSONL,
        CorpusFormat.CSV,
    ]
    assert config.policy.file == EXAMPLE_CONFIG.parents[3] / "policies" / "digits.policy.yaml"
    assert config.policy.signature_path.name == "digits.policy.yaml.sig"
    assert isinstance(config.hyperparameters["lr"], LogHP)
    assert config.default_hparams() == {"hidden": 64, "dropout": 0.1, "lr": 10**-2.5, "batch_size": 32}
    # What `govray run` prints of it: only what was not fixed, and where each value comes from.
    assert default_point_said(config.hyperparameters) == "lr=0.00316228 (the lower end: 10^-2.5)"
    space = {
        "width": IntHP(type="int", minval=8, maxval=64),
        "act": CategoricalHP(type="categorical", vals=["gelu", "relu"]),
    }
    assert default_point_said(space) == "width=8 (the lower end), act='gelu' (the first choice)"
    assert default_point_said({"lr": ConstHP(val=0.1)}) == ""
    assert config.database_url == f"sqlite:///{EXAMPLE_CONFIG.parents[3] / 'govray-storage' / 'govray.db'}"


def write(tmp_path: Path, mutate: Any) -> Path:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    mutate(raw)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda r: r["data"]["corpora"][1]["credential"].update(license_class="open"),
            r"corpus 'digits-licensed': credential: license_class should be 'public-domain'",
        ),
        (
            lambda r: r["data"]["corpora"][0]["credential"].update(jurisdiction="Germany"),
            r"corpus 'digits-public': credential: jurisdiction should match pattern",
        ),
        (
            lambda r: r["data"]["corpora"][0]["credential"].update(
                collection_period={"start": "2020-02-01", "end": "2020-01-01"}
            ),
            r"collection period ends \(2020-01-01\) before it starts \(2020-02-01\)",
        ),
        (
            lambda r: r["data"]["corpora"][2].update(credential_columns={"corpus_id": "who"}),
            r"corpus 'digits-writers': credential_columns: 'corpus_id' cannot be set per row",
        ),
        (
            lambda r: r["hyperparameters"].update(lr={"type": "loguniform", "minval": 1}),
            r"hyperparameters.lr: type 'loguniform' is none of 'const', 'int'",
        ),
        (
            lambda r: r["hyperparameters"].update(hidden={"type": "int", "minval": 9, "maxval": 3}),
            r"hyperparameters.hidden: maxval 3 is below minval 9",
        ),
        (
            lambda r: r.update(searcher={"name": "asha", "metric": "loss"}),
            r"searcher 'asha': max_trials is required",
        ),
        (
            lambda r: r.update(resources={"workers": 0}),
            r"resources.workers: is 0: a run needs at least 1 worker",
        ),
        (lambda r: r.update(trial="not a path"), r"trial should match pattern"),
        (
            lambda r: r.update(tracking={"database": "mysql://x"}),
            r"tracking.database: .*sqlite:/// or postgresql://",
        ),
        (lambda r: r.update(surprise=1), r"unknown field 'surprise'"),
        (
            lambda r: r["data"].update(holdout_fraction=1.5),
            r"data.holdout_fraction should be less than 1",
        ),
    ],
)
def test_errors_name_the_file_and_the_field_path(tmp_path: Path, mutate: Any, message: str) -> None:
    path = write(tmp_path, mutate)
    with pytest.raises(ConfigError, match=rf"{path}: .*{message}"):
        load_experiment(path)


PBT = {"name": "pbt", "metric": "loss", "population_size": 2, "perturbation_interval": 2}


@pytest.mark.parametrize(
    ("mutate", "sentence"),
    [
        (  # a corpus is named by its id, a nested credential error reads as one clause
            lambda r: r["data"]["corpora"][1]["credential"].update(license_class="open"),
            "corpus 'digits-licensed': credential: license_class should be 'public-domain', 'permissive', "
            "'copyleft', 'non-commercial', 'licensed', 'proprietary' or 'unknown'",
        ),
        (
            lambda r: r["data"]["corpora"][2].pop("path"),
            "corpus 'digits-writers': path is required",
        ),
        (
            lambda r: r["data"]["corpora"][0].update(colour="red"),
            "corpus 'digits-public': unknown field 'colour'",
        ),
        (  # a search range: the union's tag ('int') is not in the file, so not in the message
            lambda r: r["hyperparameters"].update(hidden={"type": "int", "minval": 9, "maxval": 3}),
            "hyperparameters.hidden: maxval 3 is below minval 9",
        ),
        (  # a range inside a searcher's section, with a second problem in the same section
            lambda r: r.update(
                searcher={
                    **PBT,
                    "max_trials": 4,
                    "hyperparam_mutations": {"lr": {"type": "double", "minval": 2, "maxval": 1}},
                }
            ),
            "searcher 'pbt': hyperparam_mutations.lr: maxval 1.0 is below minval 2.0; "
            "searcher 'pbt': unknown field 'max_trials'",
        ),
        (
            lambda r: r["hyperparameters"].update(lr={"type": "loguniform", "minval": 1}),
            "hyperparameters.lr: type 'loguniform' is none of 'const', 'int', 'double', 'log', 'categorical'",
        ),
        (
            lambda r: r.update(resources={"workers": 1, "strategy": "fsdp"}),
            "resources: strategy fsdp shards the model across workers: it needs workers >= 2",
        ),
        (
            lambda r: r["hyperparameters"].update(momentum=0.9),
            "hyperparameters: hyperparameters {'lr': 0.0031622776601683794, 'momentum': 0.9, "
            "'batch_size': 32} do not fit the training settings: optimizer: optimizer 'adamw' takes no "
            "momentum (it takes lr, weight_decay, betas, eps)",
        ),
        (lambda r: r.update(surprise=1), "unknown field 'surprise'"),
    ],
)
def test_config_errors_read_as_sentences_about_the_users_file(
    tmp_path: Path, mutate: Any, sentence: str
) -> None:
    """The whole message: the file, then what is wrong in it, in its own terms (no pydantic
    prefixes such as ``Value error,`` or ``(root)``, no list indices for named corpora)."""
    path = write(tmp_path, mutate)
    with pytest.raises(ConfigError) as refused:
        load_experiment(path)
    assert str(refused.value) == f"{path}: {sentence}"


def test_unreadable_or_non_mapping_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read experiment file .*missing.yaml"):
        load_experiment(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="list.yaml: an experiment file is a mapping"):
        load_experiment(tmp_path / "list.yaml")


def test_asha_fields_follow_determined() -> None:
    asha = searcher_model("asha").model_validate(
        {"name": "asha", "max_trials": 16, "max_length": {"batches": 1024}}
    )
    assert (asha.divisor, asha.max_rungs, asha.brackets, asha.smaller_is_better) == (4.0, 5, 1, True)  # type: ignore[attr-defined]


def test_credentials_have_closed_vocabularies() -> None:
    good = Credential.model_validate({**BASE_CREDENTIAL, "corpus_id": "news-2024"})
    assert good.field_value("license_class") == "public-domain"
    for field, value in [("source_type", "scraped"), ("modality", "smell"), ("sensitivity", "secret")]:
        with pytest.raises(ValueError, match=field):
            Credential.model_validate({**BASE_CREDENTIAL, "corpus_id": "c", field: value})
    with pytest.raises(ValueError, match="corpus_id"):
        Credential.model_validate({**BASE_CREDENTIAL, "corpus_id": "Bad Id!"})


def canary_set(**changes: Any) -> dict[str, Any]:
    document = {
        "corpus_id": "digits-writers",
        "file": "pii.csv",
        "template": "code {} {}",
        "alphabet": "0123456789",
        "repeats": 1,
        "canaries": [{"text": "code 1 2", "secret": "12", "rows": [3]}],
    }
    return {**document, **changes}


@pytest.mark.parametrize(
    ("document", "references", "message"),
    [
        (canary_set(), 100, "the template of .* admits only 99 besides the canaries"),
        (canary_set(corpus_id="digits-public"), 10, "holds the canaries of 'digits-public'"),
        (canary_set(template="code {} {x}"), 10, "no other braces"),
        (canary_set(alphabet="0012345678"), 10, "repeats a symbol"),
        (canary_set(canaries=[{"text": "code 1 2", "secret": "12", "rows": [-1]}]), 10, "negative row"),
        ("not json", 10, "is not a canary set"),
    ],
)
def test_a_bad_canary_set_is_refused_before_training(
    tmp_path: Path, document: Any, references: int, message: str
) -> None:
    path = tmp_path / "canaries.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))

    def mutate(raw: dict[str, Any]) -> None:
        pii = next(c for c in raw["data"]["corpora"] if c["id"] == "digits-writers")
        pii["canaries"] = {"file": str(path), "references": references}

    with pytest.raises(ConfigError, match=message):
        load_canaries(load_experiment(write(tmp_path, mutate)))


def test_a_good_canary_set_loads_with_its_reference_count(tmp_path: Path) -> None:
    path = tmp_path / "canaries.json"
    path.write_text(json.dumps(canary_set()))

    def mutate(raw: dict[str, Any]) -> None:
        pii = next(c for c in raw["data"]["corpora"] if c["id"] == "digits-writers")
        pii["canaries"] = {"file": "canaries.json", "references": 50}  # relative to the experiment file

    probes = load_canaries(load_experiment(write(tmp_path, mutate)))
    assert list(probes) == ["digits-writers"] and probes["digits-writers"].references == 50
    assert probes["digits-writers"].canaries.canaries[0].rows == (3,)


# --- training settings: typed, overridable by hyperparameters of the same names ---------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda r: r.update(training={"optimizer": {"name": "rmsprop"}}),
            r"training.optimizer.name should be 'adamw', 'adam' or 'sgd'",
        ),
        (
            lambda r: r.update(training={"optimizer": {"name": "adamw", "momentum": 0.9}}),
            r"training.optimizer: optimizer 'adamw' takes no momentum \(it takes lr, "
            r"weight_decay, betas, eps\)",
        ),
        (
            lambda r: r.update(training={"optimizer": {"name": "sgd", "betas": [0.9, 0.99]}}),
            r"optimizer 'sgd' takes no betas",
        ),
        (
            lambda r: r.update(training={"optimizer": {"lr": 0}}),
            r"training.optimizer.lr should be greater than 0",
        ),
        (lambda r: r.update(training={"batch_size": 0}), r"training.batch_size should be greater"),
        (lambda r: r.update(training={"max_grad_norm": -1}), r"training.max_grad_norm should be"),
        (lambda r: r.update(training={"lr": 0.1}), r"training: unknown field 'lr'"),
        (
            lambda r: r["hyperparameters"].update(optimizer="rmsprop"),
            r"hyperparameters: hyperparameters \{'optimizer': 'rmsprop', 'lr': .*\} do not "
            r"fit the training settings: optimizer.name should be 'adamw', 'adam' or 'sgd'",
        ),
        (
            lambda r: r["hyperparameters"].update(optimizer={"type": "categorical", "vals": ["sgd", "lion"]}),
            r"hyperparameters: .*'optimizer': 'lion'.* optimizer.name should be",
        ),
        (
            lambda r: r["hyperparameters"].update(batch_size={"type": "int", "minval": 0, "maxval": 64}),
            r"hyperparameters: .*'batch_size': 0.* batch_size should be greater than or equal to 1",
        ),
        (
            lambda r: r["hyperparameters"].update(momentum=0.9),
            r"hyperparameters: .*optimizer: optimizer 'adamw' takes no momentum",
        ),
    ],
)
def test_bad_training_settings_are_refused_naming_the_setting(
    tmp_path: Path, mutate: Any, message: str
) -> None:
    path = write(tmp_path, mutate)
    with pytest.raises(ConfigError, match=rf"{path}: .*{message}"):
        load_experiment(path)


def test_a_hyperparameter_overrides_the_training_setting_of_its_name(tmp_path: Path) -> None:
    def mutate(raw: dict[str, Any]) -> None:
        raw["training"] = {
            "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
            "batch_size": 8,
            "max_grad_norm": 2.0,
        }
        raw["hyperparameters"] = {"hidden": 16, "dropout": 0.0, "lr": 0.05}

    config = load_experiment(write(tmp_path, mutate))
    assert config.training.with_hyperparameters({"hidden": 16}) == config.training  # nothing to override
    settings = config.training.with_hyperparameters(config.default_hparams())
    assert settings == TrainingSettings(
        optimizer=OptimizerConfig(name=OptimizerName.SGD, lr=0.05, momentum=0.9),
        batch_size=8,
        max_grad_norm=2.0,
    )
    overridden = config.training.with_hyperparameters(
        {"batch_size": 16, "max_grad_norm": None, "momentum": 0.5, "weight_decay": 0.01}
    )
    assert (overridden.batch_size, overridden.max_grad_norm) == (16, None)
    assert overridden.optimizer == OptimizerConfig(name="sgd", lr=0.1, momentum=0.5, weight_decay=0.01)
    # A hyperparameter that picks the optimizer drops the settings that optimizer does not take:
    # one flat search space can cover optimizers with different settings.
    adam = config.training.with_hyperparameters({"optimizer": "adamw", "momentum": 0.5, "eps": 1e-6})
    assert adam.optimizer == OptimizerConfig(name="adamw", lr=0.1, eps=1e-6)


def test_hyperparameters_alone_resolve_as_trials_read_them_before_the_training_section() -> None:
    """Without a ``training`` section the settings are the hyperparameters over the defaults the
    base trial used to read (AdamW, lr 1e-3, weight decay 0.01, 32 rows, no clipping)."""
    defaults = TrainingSettings()
    assert defaults.optimizer.arguments() == {"lr": 1e-3}  # AdamW's own weight_decay is 0.01
    assert (defaults.optimizer.name, defaults.batch_size, defaults.max_grad_norm) == ("adamw", 32, None)
    sgd = defaults.with_hyperparameters(
        {"optimizer": "sgd", "lr": 0.05, "batch_size": 16, "max_grad_norm": 0.25}
    )
    assert sgd.optimizer.arguments() == {"lr": 0.05}  # momentum and weight decay: SGD's own 0
    assert (sgd.optimizer.name, sgd.batch_size, sgd.max_grad_norm) == ("sgd", 16, 0.25)
    with pytest.raises(ConfigError, match=r"hyperparameters \{'batch_size': 'many'\} do not fit"):
        defaults.with_hyperparameters({"batch_size": "many"})


def test_an_experiment_without_training_settings_digests_as_before_they_existed(tmp_path: Path) -> None:
    """The section is left out of the recorded config when it holds only defaults, so an unchanged
    experiment file keeps its config digest (and stays the same experiment in the store)."""
    config = load_experiment(EXAMPLE_CONFIG)
    assert "training" not in config.model_dump(mode="json")
    assert "training" not in json.loads(config.model_dump_json())

    def mutate(raw: dict[str, Any]) -> None:
        raw["training"] = {"max_grad_norm": 1.0}

    tuned = load_experiment(write(tmp_path, mutate))
    assert tuned.model_dump(mode="json")["training"]["max_grad_norm"] == 1.0
    assert type(tuned).model_validate_json(tuned.model_dump_json()) == tuned
