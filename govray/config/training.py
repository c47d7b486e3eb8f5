"""What govray's step takes from the experiment besides the trial: the optimizer, the batch size
and gradient clipping, typed.

The experiment file's ``training`` section declares them; a hyperparameter of a setting's name
overrides it for one trial, so a search can sample it::

    training:
      optimizer: {name: sgd, lr: 0.05}     # adamw (default) | adam | sgd, and their settings
      batch_size: 16                       # rows per worker per step (one schedule slot)
      max_grad_norm: 0.25                  # clip each route group's gradient norm (default: none)
      precision: bf16                      # fp32 (default) | bf16 | fp16 (ARCHITECTURE.md, "Precision")
      accumulation_steps: 4                # micro-batches per slot (DDP: the first 3 under no_sync())
      deterministic: true                  # deterministic torch / cuBLAS / NCCL (GPU replay bit-exact)
      activation_checkpointing: true       # each block recomputes its activations in the backward
      loss_chunk: 1024                     # causal LMs: head + cross-entropy per 1024 positions (null: whole)
    hyperparameters:
      lr: {type: log, minval: -3, maxval: -1}   # overrides training.optimizer.lr

The hyperparameters that override settings are ``optimizer`` (the name), ``lr``,
``weight_decay``, ``momentum``, ``betas``, ``eps``, ``batch_size`` and ``max_grad_norm``.
``precision``, ``accumulation_steps``, ``deterministic``, ``activation_checkpointing`` and
``loss_chunk`` are the engine's: the same for every
trial of an experiment (a search never samples them).
The driver resolves them into one :class:`TrainingSettings` per trial
(:meth:`TrainingSettings.with_hyperparameters`), which the workers' trials receive.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from govray.core.errors import ConfigError, describe_validation_error

_STRICT = ConfigDict(extra="forbid", frozen=True)


class OptimizerName(StrEnum):
    """The optimizers govray builds: torch's ``AdamW``, ``Adam`` and ``SGD``."""

    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


OPTIMIZER_NAMES = tuple(name.value for name in OptimizerName)

# The settings each optimizer takes besides ``lr`` and ``weight_decay`` (passed to torch as is).
_OWN_SETTINGS = {
    OptimizerName.ADAMW: ("betas", "eps"),
    OptimizerName.ADAM: ("betas", "eps"),
    OptimizerName.SGD: ("momentum",),
}
_SHARED_SETTINGS = ("lr", "weight_decay")
OPTIMIZER_SETTINGS = ("lr", "weight_decay", "momentum", "betas", "eps")
# Hyperparameter names that override a setting (``optimizer`` names the optimizer).
SETTING_HYPERPARAMETERS = ("optimizer", *OPTIMIZER_SETTINGS, "batch_size", "max_grad_norm")

Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class Precision(StrEnum):
    """The step's arithmetic (ARCHITECTURE.md, "Precision").

    ``fp32``: everything in float32. ``bf16``: forward and backward under bfloat16 autocast;
    parameters, optimizer state and the gradient reduction stay float32. ``fp16``: float16
    autocast with a dynamic loss scale per route group: an overflow skips only the tensors of the
    route that produced it (a recorded decision), and only that route's scale backs off.
    """

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


# Engine settings a trial's hyperparameters never override; left at these defaults they are not
# serialized, so an experiment or run spec written before they existed keeps its bytes and digest.
ENGINE_DEFAULTS: dict[str, Any] = {
    "precision": Precision.FP32,
    "accumulation_steps": 1,
    "deterministic": False,
    "tf32": None,
    "activation_checkpointing": False,
    "loss_chunk": 1024,
}


class OptimizerConfig(BaseModel):
    """The optimizer over every trainable tensor (base and adapters).

    A setting left out takes torch's default for that optimizer (``weight_decay``: 0.01 for
    adamw, 0 for adam and sgd; ``momentum`` 0; ``betas`` (0.9, 0.999); ``eps`` 1e-8). A setting
    the named optimizer does not take is an error.
    """

    model_config = _STRICT

    name: OptimizerName = OptimizerName.ADAMW
    lr: float = Field(default=1e-3, gt=0.0)
    weight_decay: float | None = Field(default=None, ge=0.0)
    momentum: float | None = Field(default=None, ge=0.0)  # sgd
    betas: tuple[Beta, Beta] | None = None  # adamw, adam
    eps: float | None = Field(default=None, gt=0.0)  # adamw, adam

    @model_validator(mode="after")
    def _settings_of_this_optimizer(self) -> OptimizerConfig:
        taken = (*_SHARED_SETTINGS, *_OWN_SETTINGS[self.name])
        foreign = [
            name for name in OPTIMIZER_SETTINGS if name not in taken and getattr(self, name) is not None
        ]
        if foreign:
            raise ValueError(
                f"optimizer '{self.name.value}' takes no {', '.join(foreign)} (it takes {', '.join(taken)})"
            )
        return self

    def arguments(self) -> dict[str, Any]:
        """Keyword arguments for the torch optimizer: ``lr`` and every setting given."""
        given = {name: getattr(self, name) for name in OPTIMIZER_SETTINGS}
        return {name: value for name, value in given.items() if value is not None}


class TrainingSettings(BaseModel):
    """The ``training`` section of an experiment, and one trial's settings once its
    hyperparameters are applied (what :class:`govray.train.trial.Trial` receives)."""

    model_config = _STRICT

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    batch_size: int = Field(default=32, ge=1)  # rows per worker per step (one schedule slot)
    max_grad_norm: float | None = Field(default=None, gt=0.0)  # per route group; None: no clipping
    precision: Precision = Precision.FP32
    # A slot's rows split into this many micro-batches (same route, counts and masks of the slot).
    accumulation_steps: int = Field(default=1, ge=1)
    # torch deterministic algorithms, a fixed cuBLAS workspace and NCCL algorithm/protocol.
    deterministic: bool = False
    # TensorFloat-32 for float32 matmuls and convolutions on GPUs (what stays fp32 under bf16:
    # adapters, heads). None: on for GPU runs, off on CPU; deterministic mode keeps it off.
    tf32: bool | None = None
    # Each of the trial's checkpoint units (Trial.checkpoint_units: a decoder's blocks) keeps only
    # its inputs in the forward and recomputes its activations in the backward (non-reentrant).
    activation_checkpointing: bool = False
    # CausalLMTrial's loss: output head and cross-entropy this many positions at a time, so the
    # whole sequence's logits are never held (govray.train.step.memory_savers); None: the whole sequence.
    loss_chunk: int | None = Field(default=1024, ge=1)

    @model_validator(mode="after")
    def _micro_batches_fit(self) -> TrainingSettings:
        if self.accumulation_steps > self.batch_size:
            raise ValueError(
                f"accumulation_steps {self.accumulation_steps} exceeds batch_size {self.batch_size}: "
                "every micro-batch needs at least one row"
            )
        if self.tf32 and self.deterministic:
            raise ValueError(
                "tf32: true with deterministic: true: deterministic mode keeps float32 matmuls in "
                "float32 (leave tf32 unset, or set it false)"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_default_engine(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        for name, default in ENGINE_DEFAULTS.items():
            if getattr(self, name) == default:
                dumped.pop(name, None)
        return dumped

    def with_hyperparameters(self, hparams: Mapping[str, Any]) -> TrainingSettings:
        """These settings, each overridden by the hyperparameter of its name.

        A hyperparameter ``optimizer`` picks the optimizer; the settings it does not take are then
        dropped, so one flat search space can cover optimizers with different settings. A value
        that does not fit is a ``ConfigError`` naming the hyperparameters::

            >>> settings = TrainingSettings().with_hyperparameters({"optimizer": "sgd", "lr": 0.05})
            >>> settings.optimizer.name, settings.optimizer.lr, settings.batch_size
            (<OptimizerName.SGD: 'sgd'>, 0.05, 32)
        """
        if not any(name in hparams for name in SETTING_HYPERPARAMETERS):
            return self
        optimizer = self.optimizer.model_dump(exclude_none=True)
        optimizer.update({name: hparams[name] for name in OPTIMIZER_SETTINGS if name in hparams})
        if "optimizer" in hparams:
            optimizer["name"] = hparams["optimizer"]
            if hparams["optimizer"] in OPTIMIZER_NAMES:
                taken = {"name", *_SHARED_SETTINGS, *_OWN_SETTINGS[OptimizerName(hparams["optimizer"])]}
                optimizer = {name: value for name, value in optimizer.items() if name in taken}
        raw = {
            **{name: getattr(self, name) for name in ENGINE_DEFAULTS},
            "optimizer": optimizer,
            "batch_size": hparams.get("batch_size", self.batch_size),
            "max_grad_norm": hparams.get("max_grad_norm", self.max_grad_norm),
        }
        try:
            return TrainingSettings.model_validate(raw)
        except ValidationError as error:
            given = {name: hparams[name] for name in SETTING_HYPERPARAMETERS if name in hparams}
            detail = describe_validation_error(error)
            raise ConfigError(f"hyperparameters {given} do not fit the training settings: {detail}") from None
