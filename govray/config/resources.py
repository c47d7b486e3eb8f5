"""The experiment's ``resources:`` section: how many workers, where Ray places them, and how they
hold the model.

``workers`` is a number (a fixed-size run) or a range, ``{min: A, max: B}``: an elastic run on
Ray Train's elastic scaling, which starts once A workers fit and grows to B as nodes come, and
after losing a node continues on the workers left from the newest verified checkpoint. The
schedule is defined on B: every step has B slots (its global batch), whatever the world's size,
and a world of W < B ranks runs each step's slots in rounds (``govray.train.parallel.rounds``)::

    resources:
      workers: {min: 2, max: 3}
      resize_check_s: 60     # how often a running elastic run looks for room to grow
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

_STRICT = ConfigDict(extra="forbid", frozen=True)
RESIZE_CHECK_S = 60.0  # Ray Train's default ``elastic_resize_monitor_interval_s``


class PlacementStrategy(StrEnum):
    """Where Ray places the workers (Ray Train's ``ScalingConfig.placement_strategy``)."""

    PACK = "PACK"  # as few nodes as possible (best effort)
    SPREAD = "SPREAD"  # across nodes (best effort)
    STRICT_PACK = "STRICT_PACK"  # all on one node, or wait
    STRICT_SPREAD = "STRICT_SPREAD"  # one worker per node, or wait (for more nodes)


class ParallelStrategy(StrEnum):
    """How the workers hold the model: whole on each (DDP), or sharded across them (FSDP2)."""

    DDP = "ddp"  # a full copy of model, gradients and optimizer state per worker; governed allreduce
    FSDP = "fsdp"  # each worker holds a shard; governed reduce-scatter (govray.train.parallel.fsdp)
    # FSDP within groups of ``resources.shard_group`` workers, replicated across the groups
    # (govray.train.parallel.hsdp): the all-gathers stay inside a group (a node), one all-reduce across.
    HSDP = "hsdp"


class WorkerRange(BaseModel):
    """``resources.workers: {min: A, max: B}``: an elastic run of A to B workers."""

    model_config = _STRICT

    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> WorkerRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class Resources(BaseModel):
    model_config = _STRICT

    workers: int | WorkerRange = 1
    # An elastic run: seconds between Ray Train's looks for room to grow while it trains.
    resize_check_s: float = Field(default=RESIZE_CHECK_S, gt=0)
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=1.0, gt=0)
    # Results do not depend on it: governed CPU runs are bit-identical on one node or many.
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    strategy: ParallelStrategy = ParallelStrategy.DDP
    # strategy hsdp: the workers each shard group spans (the model is sharded within a group and
    # replicated across groups). Unset: the workers on a node (its GPUs), which needs use_gpu; a
    # CPU run names it, there being no GPUs per node to count.
    shard_group: int | None = Field(default=None, ge=2)

    @field_validator("workers", mode="before")
    @classmethod
    def _number_or_range(cls, raw: Any) -> Any:
        # Checked here, not by the union, so that a mistake reads as one sentence.
        if isinstance(raw, WorkerRange):
            return raw
        if isinstance(raw, int) and not isinstance(raw, bool):
            if raw < 1:
                raise ValueError(f"is {raw}: a run needs at least 1 worker")
            return raw
        if not isinstance(raw, dict) or set(raw) != {"min", "max"}:
            raise ValueError(f"is {raw!r}: a number of workers, or an elastic range {{min: A, max: B}}")
        low, high = raw["min"], raw["max"]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (low, high)):
            raise ValueError(f"min and max are numbers of workers, at least 1 (min {low!r}, max {high!r})")
        if low > high:
            raise ValueError(f"min ({low}) is above max ({high})")
        return WorkerRange(min=low, max=high)

    @property
    def elastic(self) -> bool:
        """Whether the world size may change while the run trains (``workers: {min, max}``)."""
        return isinstance(self.workers, WorkerRange) and self.workers.min < self.workers.max

    @property
    def min_workers(self) -> int:
        return self.workers.min if isinstance(self.workers, WorkerRange) else self.workers

    @property
    def max_workers(self) -> int:
        """The most workers the run may have: every step's slots (its global batch) are this many."""
        return self.workers.max if isinstance(self.workers, WorkerRange) else self.workers

    def describe_workers(self) -> str:
        """``3 workers``, or ``2 to 3 workers (elastic)``."""
        if self.elastic:
            return f"{self.min_workers} to {self.max_workers} workers (elastic)"
        return f"{self.max_workers} worker{'s' if self.max_workers > 1 else ''}"

    @model_validator(mode="after")
    def _resize_check_is_elastic(self) -> Resources:
        if not self.elastic and self.resize_check_s != RESIZE_CHECK_S:
            raise ValueError(
                "resources.resize_check_s is how often an elastic run looks for room to grow: "
                "it needs workers: {min: A, max: B} with A < B"
            )
        return self

    @model_validator(mode="after")
    def _sharding_needs_workers(self) -> Resources:
        if self.strategy == ParallelStrategy.FSDP and self.min_workers < 2:
            raise ValueError("strategy fsdp shards the model across workers: it needs workers >= 2")
        if self.strategy != ParallelStrategy.HSDP:
            if self.shard_group is not None:
                raise ValueError(f"resources.shard_group is for strategy hsdp (this one is {self.strategy})")
            return self
        if self.elastic:
            raise ValueError(
                "strategy hsdp with elastic workers: Ray Train may resize the run to any number of "
                "workers between min and max, and HSDP needs whole shard groups of "
                "resources.shard_group (two or more); use strategy fsdp, or a fixed number of workers "
                "(`govray resume --workers N` moves an HSDP run to another multiple of its group)"
            )
        if self.max_workers < 4:
            raise ValueError(
                "strategy hsdp shards within groups of 2 or more workers and replicates across 2 or "
                f"more groups: it needs workers >= 4 (this run has {self.max_workers}); use strategy fsdp"
            )
        if self.shard_group is None:
            if not self.use_gpu:
                raise ValueError(
                    "strategy hsdp on CPUs needs resources.shard_group (the workers each shard group "
                    "spans): it defaults to the GPUs per node only under use_gpu"
                )
            return self  # the workers per node, checked by the workers (train.hybrid.shard_group_size)
        refusal = shard_group_refusal(self.max_workers, self.shard_group)
        if refusal is not None:
            raise ValueError(refusal)
        return self

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left at their defaults, the strategy, shard group and resize check are not serialized:
        # an experiment written before they existed keeps its bytes and its digest.
        dumped: dict[str, Any] = handler(self)
        if self.strategy == ParallelStrategy.DDP:
            dumped.pop("strategy", None)
        if self.shard_group is None:
            dumped.pop("shard_group", None)
        if self.resize_check_s == RESIZE_CHECK_S:
            dumped.pop("resize_check_s", None)
        return dumped


def shard_group_refusal(workers: int, shard_group: int) -> str | None:
    """Why ``workers`` do not split into two or more whole shard groups of ``shard_group``
    (strategy hsdp), or None when they do."""
    if workers % shard_group:
        return (
            f"strategy hsdp: {workers} workers do not split into shard groups of {shard_group} "
            "(workers must be a multiple of resources.shard_group)"
        )
    if workers // shard_group < 2:
        return (
            f"strategy hsdp: {workers} workers in shard groups of {shard_group} make one group, "
            "nothing to replicate across: use strategy fsdp (or more workers)"
        )
    return None
