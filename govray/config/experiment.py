"""The experiment file (YAML), Determined-style, validated into pydantic models.

The sections have their own modules: ``data:`` in :mod:`govray.config.data`, ``hyperparameters:``
in :mod:`govray.config.hyperparameters`, ``training:`` in :mod:`govray.config.training`, and
``searcher:`` in :mod:`govray.config.searcher` (each strategy's own fields live with the strategy).
Relative paths (corpora, policy, trust, a local ``storage_path``) are relative to the directory
of the experiment file. Errors name the file and the field path::

    ConfigError: jobs/examples/digits/experiment.yaml: data.corpora.1.credential.license_class:
    Input should be 'public-domain', 'permissive', ...
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from govray.config.data import CorpusRole, DataConfig
from govray.config.hyperparameters import Hyperparameter, default_value, extremes
from govray.config.resources import ParallelStrategy, Resources
from govray.config.searcher import SearcherConfig, validated_searcher
from govray.config.training import SETTING_HYPERPARAMETERS, Precision, TrainingSettings
from govray.core.errors import ConfigError, describe_validation_error
from govray.core.identifiers import ExperimentName
from govray.core.yaml_files import parse_yaml_mapping, read_text
from govray.governance.canaries import CanaryProbe, CanarySet

_STRICT = ConfigDict(extra="forbid", frozen=True)


class PolicyRef(BaseModel):
    model_config = _STRICT

    file: Path
    signature: Path | None = None  # default: FILE.sig
    trust: Path | None = None
    allow_unsigned: bool = False

    @property
    def signature_path(self) -> Path:
        return self.signature if self.signature is not None else self.file.with_name(self.file.name + ".sig")


class MlflowConfig(BaseModel):
    """An MLflow tracking server that mirrors the experiment (``govray.platform.mlflow_mirror``)."""

    model_config = _STRICT

    uri: str  # http(s)://HOST:PORT of an `mlflow server`
    experiment_prefix: str = "govray/"  # MLflow experiment = prefix + govray experiment name

    @field_validator("uri")
    @classmethod
    def _http(cls, uri: str) -> str:
        if not uri.startswith(("http://", "https://")):
            raise ValueError(
                "tracking.mlflow.uri is an MLflow tracking server: http://HOST:PORT or https://..."
            )
        return uri.rstrip("/")


class TrackingConfig(BaseModel):
    model_config = _STRICT

    database: str | None = None  # default: sqlite:///<storage_path>/govray.db
    mlflow: MlflowConfig | None = None  # optional mirror; govray's store stays the record

    @model_serializer(mode="wrap")
    def _without_absent_mirror(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Without a mirror, an experiment written before the mirror existed keeps its bytes and digest.
        dumped: dict[str, Any] = handler(self)
        if self.mlflow is None:
            dumped.pop("mlflow", None)
        return dumped

    @field_validator("database")
    @classmethod
    def _known_scheme(cls, url: str | None) -> str | None:
        schemes = ("sqlite:///", "postgresql://", "postgresql+psycopg://", "postgresql+psycopg2://")
        if url is not None and not url.startswith(schemes):
            raise ValueError(
                "database URL must start with sqlite:/// or postgresql:// (or postgresql+psycopg://)"
            )
        return url


class CheckpointConfig(BaseModel):
    """When to checkpoint and which checkpoints to keep (Determined's GC fields)."""

    model_config = _STRICT

    period: int = Field(default=100, ge=1)  # steps
    save_experiment_best: int = Field(default=0, ge=0)
    save_trial_best: int = Field(default=1, ge=0)
    save_trial_latest: int = Field(default=1, ge=0)


class PlateauSchedule(BaseModel):
    """Cut the learning rate when a validation metric stops improving (torch's
    ``ReduceLROnPlateau``, ``threshold_mode="rel"``). Each cut is a recorded decision: a replay
    applies the record instead of watching its own metrics."""

    model_config = _STRICT

    type: Literal["plateau"] = "plateau"
    metric: str = "validation_loss"
    smaller_is_better: bool = True
    factor: float = Field(default=0.1, gt=0.0, lt=1.0)
    patience: int = Field(default=10, ge=0)  # evaluations without improvement before a cut
    threshold: float = Field(default=1e-4, ge=0.0)
    cooldown: int = Field(default=0, ge=0)  # evaluations after a cut before counting again
    min_scale: float = Field(default=0.0, ge=0.0)  # of the initial learning rate


class EarlyStoppingPolicy(BaseModel):
    """Stop a trial early (Determined's policies): once its validation metric reaches
    ``threshold``, or after ``patience`` validations without an improvement above ``min_delta``.
    Each stop is a recorded decision that a replay applies instead of recomputing."""

    model_config = _STRICT

    metric: str = "validation_loss"
    smaller_is_better: bool = True
    patience: int | None = Field(default=None, ge=1)
    min_delta: float = Field(default=0.0, ge=0.0)
    threshold: float | None = None

    @model_validator(mode="after")
    def _some_rule(self) -> EarlyStoppingPolicy:
        if self.patience is None and self.threshold is None:
            raise ValueError("early_stopping needs 'patience', 'threshold' or both")
        return self


class ExperimentConfig(BaseModel):
    """An experiment: a trial class, its hyperparameter space, credentialed data and a policy."""

    model_config = _STRICT

    name: ExperimentName
    description: str = ""
    trial: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # "package.module:Class"
    # Optimizer, batch size, clipping; a hyperparameter of a setting's name overrides it.
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    hyperparameters: dict[str, Hyperparameter] = Field(
        default_factory=dict,
        description="Name → a constant, a range (int, double, log) or a choice list; a bare value is a "
        "constant. A run that samples nothing takes each range's lower end and each list's first value.",
    )
    data: DataConfig
    policy: PolicyRef
    resources: Resources = Field(default_factory=Resources)
    seed: int = Field(default=0, ge=0, lt=2**31)
    storage_path: str = "./govray-storage"
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    max_restarts: int = Field(default=0, ge=0)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    # Validated by the model of the strategy it names (its entry point's CONFIG); absent: single.
    searcher: SerializeAsAny[SearcherConfig] = Field(
        default_factory=lambda: {"name": "single"}, validate_default=True
    )
    # Steps between validations (each also saves a checkpoint); None: only at the end.
    min_validation_period: int | None = Field(default=None, ge=1)
    lr_schedule: PlateauSchedule | None = None
    early_stopping: EarlyStoppingPolicy | None = None

    @model_validator(mode="after")
    def _fsdp_precision(self) -> ExperimentConfig:
        sharded = (ParallelStrategy.FSDP, ParallelStrategy.HSDP)
        if self.resources.strategy in sharded and self.training.precision == Precision.FP16:
            raise ValueError(
                f"precision fp16 with strategy {self.resources.strategy}: use bf16 (FSDP2's mixed "
                "precision, fp32 reduction); fp16's per-route loss scales run under strategy ddp"
            )
        return self

    @model_validator(mode="after")
    def _elastic_runs(self) -> ExperimentConfig:
        if not self.resources.elastic:
            return self
        if self.training.precision == Precision.FP16:
            raise ValueError(
                "precision fp16 with elastic workers: on fewer workers than resources.workers.max "
                "a rank sums several slots per step, which fp16's per-route loss scales refuse "
                "(govray.train.parallel.rounds); use bf16, or a fixed number of workers"
            )
        if self.searcher.name != "single":
            raise ValueError(
                f"elastic workers train one run; searcher '{self.searcher.name}' trains its trials "
                "on a fixed number of workers: set resources.workers to a number"
            )
        return self

    @model_validator(mode="after")
    def _plateau_needs_validations(self) -> ExperimentConfig:
        if self.lr_schedule is not None and self.min_validation_period is None:
            raise ValueError("lr_schedule watches validations: set min_validation_period (steps)")
        if self.early_stopping is not None and self.min_validation_period is None:
            raise ValueError("early_stopping watches validations: set min_validation_period (steps)")
        return self

    @field_validator("searcher", mode="before")
    @classmethod
    def _strategy_model(cls, raw: Any) -> SearcherConfig:
        return validated_searcher(raw)

    @field_validator("hyperparameters", mode="before")
    @classmethod
    def _bare_values_are_const(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        return {
            k: v if isinstance(v, dict) and "type" in v else {"type": "const", "val": v}
            for k, v in raw.items()
        }

    @field_validator("hyperparameters")
    @classmethod
    def _settings_fit(
        cls, space: dict[str, Hyperparameter], info: ValidationInfo
    ) -> dict[str, Hyperparameter]:
        """Every value a hyperparameter that overrides a training setting can take must fit it
        (checked at the ends of ranges and for each choice), so a search never starts a trial
        that cannot build its optimizer."""
        training = info.data.get("training")
        if training is None:
            return space  # the training section itself is invalid (reported on its own)
        defaults = {name: default_value(hp) for name, hp in space.items()}
        for name in SETTING_HYPERPARAMETERS:
            for value in extremes(space[name]) if name in space else ():
                try:
                    training.with_hyperparameters({**defaults, name: value})
                except ConfigError as error:
                    raise ValueError(str(error)) from None
        return space

    @model_serializer(mode="wrap")
    def _without_default_training(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # An experiment that leaves ``training`` at its defaults serializes (and digests) exactly
        # as one written before the section existed: the same file stays the same experiment.
        dumped: dict[str, Any] = handler(self)
        if self.training == TrainingSettings():
            dumped.pop("training", None)
        return dumped

    def default_hparams(self) -> dict[str, Any]:
        """One point of the space without sampling: const values, lower bounds, first choices."""
        return {name: default_value(hp) for name, hp in self.hyperparameters.items()}

    @property
    def database_url(self) -> str:
        """The tracking store's URL: ``tracking.database`` with each ``${VAR}`` replaced by the
        environment variable ``VAR`` (else the SQLite file under a local ``storage_path``).

        The substitution happens here, when the store is opened, not when the file is read: the
        recorded experiment (tracking store, run.json, a job's working directory) keeps
        ``${VAR}``, never the password it stands for."""
        if self.tracking.database is not None:
            return expand_environment(self.tracking.database, "tracking.database")
        if "://" in self.storage_path:
            raise ConfigError("tracking.database is required when storage_path is remote")
        return f"sqlite:///{Path(self.storage_path) / 'govray.db'}"


ENVIRONMENT_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_environment(text: str, field: str) -> str:
    """``text`` with each ``${VAR}`` replaced by the environment variable's value, as it is (so a
    password with ``@``, ``:`` or ``/`` must be percent-encoded in the variable); an unset
    variable is a ``ConfigError`` naming it and ``field``, never showing ``text``."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ConfigError(
                f"{field} uses ${{{name}}}, but the environment variable {name} is not set "
                "(export it where the driver runs; a secret never goes in the experiment file)"
            )
        return os.environ[name]

    return ENVIRONMENT_VARIABLE.sub(value, text)


def _absolutize(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """Resolve relative paths in the raw document against the experiment file's directory."""

    def resolve(value: Any) -> Any:
        if isinstance(value, str) and not Path(value).is_absolute():
            return os.path.normpath(base / value)
        return value

    data = raw.get("data")
    if isinstance(data, dict) and isinstance(data.get("corpora"), list):
        for corpus in data["corpora"]:
            if isinstance(corpus, dict) and "path" in corpus:
                corpus["path"] = resolve(corpus["path"])
            canaries = corpus.get("canaries") if isinstance(corpus, dict) else None
            if isinstance(canaries, dict) and "file" in canaries:
                canaries["file"] = resolve(corpus["canaries"]["file"])
    policy = raw.get("policy")
    if isinstance(policy, dict):
        for key in ("file", "signature", "trust"):
            if key in policy and policy[key] is not None:
                policy[key] = resolve(policy[key])
    storage = raw.get("storage_path")
    if isinstance(storage, str) and "://" not in storage:
        raw["storage_path"] = resolve(storage)
    tracking = raw.get("tracking")
    if isinstance(tracking, dict) and isinstance(tracking.get("database"), str):
        url: str = tracking["database"]
        prefix = "sqlite:///"
        # A path that starts with a ${VAR} is the environment's to give, not relative to the file.
        if url.startswith(prefix) and not url[len(prefix) :].startswith(("/", "${")):
            tracking["database"] = prefix + os.path.normpath(base / url[len(prefix) :])
    return raw


def parse_experiment(text: str, *, source: Path) -> ExperimentConfig:
    shape = "an experiment file is a mapping (name, trial, data, policy, ...)"
    raw = _absolutize(parse_yaml_mapping(text, str(source), ConfigError, shape), source.resolve().parent)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(f"{source}: {describe_validation_error(error, raw)}") from None


def load_experiment(path: Path) -> ExperimentConfig:
    """Read and validate an experiment file."""
    return parse_experiment(read_text(path, ConfigError, "experiment file"), source=path)


def load_canaries(config: ExperimentConfig) -> dict[str, CanaryProbe]:
    """Each corpus's canary set with its reference count; a missing or malformed file, or one
    written for another corpus, is a ``ConfigError``."""
    probes = {}
    for corpus in config.data.corpora:
        if corpus.canaries is None:
            continue
        path = corpus.canaries.file
        try:
            canaries = CanarySet.load(path)
        except OSError as error:
            raise ConfigError(f"corpus '{corpus.id}': cannot read its canaries {path}: {error}") from None
        except ValidationError as error:
            raise ConfigError(
                f"corpus '{corpus.id}': {path} is not a canary set: {describe_validation_error(error)}"
            ) from None
        if canaries.corpus_id != corpus.id:
            raise ConfigError(f"corpus '{corpus.id}': {path} holds the canaries of '{canaries.corpus_id}'")
        if corpus.role != CorpusRole.TRAIN:
            raise ConfigError(f"corpus '{corpus.id}': canaries need a training corpus (role: train)")
        available = canaries.space_size - len(canaries.canaries)
        if corpus.canaries.references > available:
            raise ConfigError(
                f"corpus '{corpus.id}': {corpus.canaries.references} reference candidates asked, but "
                f"the template of {path} admits only {available} besides the canaries"
            )
        probes[corpus.id] = CanaryProbe(canaries=canaries, references=corpus.canaries.references)
    return probes
