"""The experiment's ``searcher:`` section: the fields every strategy shares, and the strategy's own
model, found through the strategy's entry point.

A strategy is one module above govray (``searchers/``), registered in the ``govray.searchers``
entry-point group under its name, pointing at its ``plan`` (pyproject.toml)::

    [project.entry-points."govray.searchers"]
    grid = "searchers.grid:plan"

The same module defines ``CONFIG``: the model of its section, a :class:`SearcherConfig` subclass
whose ``name`` is the strategy's name. govray reaches the module only through the entry point
(govray never imports ``searchers/``), so a new strategy is one file and one entry point.

Example::

    model = searcher_model("asha")
    model.model_validate({"name": "asha", "max_trials": 16})

A strategy's ``plan(config, max_steps)`` returns a :class:`TunePlan`. Validating a section loads
only the strategy's module and its ``CONFIG``: a strategy imports Ray Tune (and what else its
search needs) inside ``plan``, so reading an experiment's recorded config loads neither Ray nor
torch.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from govray.core.errors import ConfigError

SEARCHER_GROUP = "govray.searchers"
CONFIG_ATTRIBUTE = "CONFIG"  # what a strategy's module calls the model of its section


class Length(BaseModel):
    """How long one trial trains: ``batches`` (steps) or ``epochs``, exactly one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batches: int | None = Field(default=None, ge=1)
    epochs: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> Length:
        if (self.batches is None) == (self.epochs is None):
            raise ValueError("give exactly one of 'batches' or 'epochs'")
        return self


class SearcherConfig(BaseModel):
    """The fields every strategy shares; a strategy's model subclasses it, narrowing ``name`` to
    its own (``name: Literal["grid"]``) and adding its fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str = "validation_loss"
    smaller_is_better: bool = True
    max_length: Length = Field(default_factory=lambda: Length(epochs=1))
    memorization_lambda: float = Field(default=0.0, ge=0.0)  # objective = metric + λ·score
    # Declared after the shared fields, so a section serializes in the order it always has.
    name: str


@dataclass(frozen=True)
class TunePlan:
    """What a strategy asks of Ray Tune for one experiment."""

    param_space: dict[str, Any]
    num_samples: int
    max_concurrent_trials: int
    search_alg: Any = None  # a ray.tune.search.Searcher, or None: Tune's variant generator
    scheduler: Any = None  # a ray.tune.schedulers.TrialScheduler, or None: FIFO
    validation_period: int | None = None  # steps between reports, when the config sets none
    notes: dict[str, Any] = field(default_factory=dict)  # derived settings, shown to the user


def installed_searchers() -> dict[str, EntryPoint]:
    """The strategies installed in the ``govray.searchers`` entry-point group, by name."""
    return dict(_searcher_entry_points(tuple(sys.path)))


@functools.lru_cache(maxsize=8)
def _searcher_entry_points(path: tuple[str, ...]) -> tuple[tuple[str, EntryPoint], ...]:
    # importlib.metadata reads every installed distribution (~40 ms here), and a search validates
    # its config at every checkpoint it records (GC): what is installed is read once per sys.path.
    return tuple((point.name, point) for point in entry_points(group=SEARCHER_GROUP))


def searcher_model(name: str) -> type[SearcherConfig]:
    """The model of strategy ``name``'s section: ``CONFIG`` in the module of its entry point."""
    found = installed_searchers()
    if name not in found:
        raise ConfigError(_unknown(name, found))
    try:
        module = importlib.import_module(found[name].module)
    except ImportError as error:
        raise ConfigError(
            f"searcher '{name}': cannot import its module {found[name].module}: {error}"
        ) from None
    model = getattr(module, CONFIG_ATTRIBUTE, None)
    if not (isinstance(model, type) and issubclass(model, SearcherConfig)):
        raise ConfigError(
            f"searcher '{name}': its module {module.__name__} defines no {CONFIG_ATTRIBUTE} "
            "(the SearcherConfig model of its section)"
        )
    return model


def validated_searcher(raw: Any) -> SearcherConfig:
    """``raw`` (a ``searcher:`` section) validated by its strategy's model; the pydantic
    validator of ``ExperimentConfig.searcher``. A problem is reported at ``searcher.NAME.FIELD``,
    an unknown or missing name with the installed names."""
    if isinstance(raw, SearcherConfig):
        return raw
    found = installed_searchers()
    name = raw.get("name") if isinstance(raw, Mapping) else None
    if not isinstance(name, str):
        raise PydanticCustomError(
            "searcher_name",
            "a searcher section is a mapping that names its strategy (name: one of {known})",
            {"known": _names(found)},
        )
    if name not in found:
        raise PydanticCustomError("searcher_unknown", _unknown(name, found))
    try:
        model = searcher_model(name)
    except ConfigError as error:
        raise PydanticCustomError("searcher_model", str(error)) from None
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        # Located under the strategy's name, as a union tagged by ``name`` reports it.
        details: list[InitErrorDetails] = [
            {
                "type": item["type"],
                "loc": (name, *item["loc"]),
                "input": item["input"],
                **({"ctx": item["ctx"]} if "ctx" in item else {}),  # type: ignore[typeddict-item]
            }
            for item in error.errors()
        ]
        raise ValidationError.from_exception_data(error.title, details) from None


def _names(found: Mapping[str, EntryPoint]) -> str:
    return ", ".join(sorted(found)) or "none"


def _unknown(name: str, found: Mapping[str, EntryPoint]) -> str:
    return f"no searcher '{name}' is installed (entry points {SEARCHER_GROUP}: {_names(found)})"
