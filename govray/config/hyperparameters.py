"""Hyperparameters, Determined's types: a constant, an int / double / log range, or a choice.

A bare value in the experiment file is a constant (``lr: 0.01`` reads as ``{type: const, val:
0.01}``); ``count`` on a range gives grid search its points. A run that samples nothing (``govray
run``, the ``single`` searcher) takes the space's **default point** (``default_value``): each
constant, each choice list's first value, each range's lower end (``base ** minval`` for a log
range); ``govray run`` prints it (``default_point_said``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(extra="forbid", frozen=True)


class ConstHP(BaseModel):
    model_config = _STRICT
    type: Literal["const"] = "const"
    val: Any


class _RangeHP(BaseModel):
    model_config = _STRICT
    minval: float
    maxval: float
    count: int | None = Field(default=None, ge=1)  # grid points

    @model_validator(mode="after")
    def _ordered(self) -> _RangeHP:
        if self.maxval < self.minval:
            raise ValueError(f"maxval {self.maxval} is below minval {self.minval}")
        return self


class IntHP(_RangeHP):
    type: Literal["int"]
    minval: int
    maxval: int


class DoubleHP(_RangeHP):
    type: Literal["double"]


class LogHP(_RangeHP):
    """``base ** x`` for x uniform in [minval, maxval]."""

    type: Literal["log"]
    base: float = Field(default=10.0, gt=1.0)


class CategoricalHP(BaseModel):
    model_config = _STRICT
    type: Literal["categorical"]
    vals: list[Any] = Field(min_length=1)


Hyperparameter = Annotated[ConstHP | IntHP | DoubleHP | LogHP | CategoricalHP, Field(discriminator="type")]


def default_value(hp: ConstHP | IntHP | DoubleHP | LogHP | CategoricalHP) -> Any:
    """The point of ``hp`` taken without sampling: the constant, the first choice, the lower end."""
    if isinstance(hp, ConstHP):
        return hp.val
    if isinstance(hp, CategoricalHP):
        return hp.vals[0]
    if isinstance(hp, LogHP):
        return hp.base**hp.minval
    return hp.minval


def extremes(hp: ConstHP | IntHP | DoubleHP | LogHP | CategoricalHP) -> list[Any]:
    """The values of ``hp`` that bound what it can take: every choice, or a range's two ends."""
    if isinstance(hp, ConstHP):
        return [hp.val]
    if isinstance(hp, CategoricalHP):
        return list(hp.vals)
    if isinstance(hp, LogHP):
        return [hp.base**hp.minval, hp.base**hp.maxval]
    return [hp.minval, hp.maxval]


def default_point_said(space: dict[str, ConstHP | IntHP | DoubleHP | LogHP | CategoricalHP]) -> str:
    """The default point of ``space``'s ranges and choices, said with where each value comes from
    ("" when the space holds constants only): what ``govray run`` prints before it trains."""
    said = []
    for name, hp in space.items():
        if isinstance(hp, ConstHP):
            continue
        value = default_value(hp)
        shown = f"{value:.6g}" if isinstance(value, float) else repr(value)
        if isinstance(hp, CategoricalHP):
            where = "the first choice"
        elif isinstance(hp, LogHP):
            where = f"the lower end: {hp.base:g}^{hp.minval:g}"
        else:
            where = "the lower end"
        said.append(f"{name}={shown} ({where})")
    return ", ".join(said)
