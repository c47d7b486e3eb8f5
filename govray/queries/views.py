"""The documents the query layer answers with: one pydantic model per thing a reader asks about.

They are the lineage app's response bodies (and its OpenAPI schema), so field names are the
public vocabulary: ``examples``/``tokens``/``steps`` as in the ledger, ``layer`` as in the
attestation's coverage matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from govray.queries.errors import QueryError

MAX_LIMIT = 500
DEFAULT_LIMIT = 50

Item = TypeVar("Item")
_FROZEN = ConfigDict(frozen=True)


@dataclass(frozen=True)
class Window:
    """Which slice of a list to return: ``limit`` items from position ``offset``."""

    offset: int = 0
    limit: int = DEFAULT_LIMIT

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise QueryError(f"offset {self.offset} is negative")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise QueryError(f"limit {self.limit} is outside 1..{MAX_LIMIT}")


class Page(BaseModel, Generic[Item]):
    """One page of a list: ``items[0]`` is the ``offset``-th of ``total``."""

    model_config = _FROZEN

    items: list[Item]
    total: int = Field(description="How many items the whole list holds.")
    offset: int
    limit: int


def page(items: list[Item], total: int, window: Window) -> Page[Item]:
    return Page(items=items, total=total, offset=window.offset, limit=window.limit)


class ExperimentView(BaseModel):
    model_config = _FROZEN

    id: int
    name: str
    description: str
    state: str
    config_digest: str
    policy_digest: str | None
    storage_path: str
    parent_id: int | None
    trials: int
    created_at: datetime
    updated_at: datetime


class ExperimentDetail(ExperimentView):
    config: dict[str, Any] = Field(description="The experiment's frozen configuration.")


class TrialView(BaseModel):
    model_config = _FROZEN

    id: int
    experiment_id: int
    state: str
    seed: int
    hyperparameters: dict[str, Any]
    ray_run_name: str | None
    cloned_from: int | None
    kind: str = Field(description="original, or replay: a counterfactual rerun of trial replay_of.")
    replay_of: int | None
    created_at: datetime
    ended_at: datetime | None


class CheckpointView(BaseModel):
    model_config = _FROZEN

    id: int
    trial_id: int
    uuid: str
    step: int
    state: str = Field(description="active, or deleted by GC (the row and its attestations stay).")
    path: str
    manifest_digest: str
    created_at: datetime


class TrialDetail(TrialView):
    source_checkpoint: dict[str, Any] | None = Field(description="The checkpoint the trial started from.")
    checkpoints: list[CheckpointView]


class MetricView(BaseModel):
    model_config = _FROZEN

    step: int
    kind: str
    name: str
    value: float
    recorded_at: datetime


class DecisionView(BaseModel):
    """A decision a trial's controller took (or applied from the trial it replays)."""

    model_config = _FROZEN

    seq: int
    step: int
    kind: str
    payload: dict[str, Any]
    replayed: bool  # applied from the source trial's record rather than computed


class ModelView(BaseModel):
    model_config = _FROZEN

    name: str
    description: str
    versions: int
    latest_version: int | None
    created_at: datetime


class ModelVersionView(BaseModel):
    model_config = _FROZEN

    id: int
    model_name: str
    version: int
    checkpoint_id: int
    tags: dict[str, Any]
    path: str | None = Field(description="Where the version's model files are (its checkpoint's by default).")
    parent_id: int | None = Field(
        description="The version it was derived from (e.g. by removing an adapter)."
    )
    removed_adapters: list[str] = Field(description="Adapters removed from the version it came from.")
    excluded_corpora: list[str] = Field(description="Corpora the removal leaves out entirely.")
    description: str
    created_at: datetime


class VersionRef(BaseModel):
    model_config = _FROZEN

    model_name: str
    version: int


class CorpusCounts(BaseModel):
    """What one corpus directly contributed to one layer."""

    model_config = _FROZEN

    corpus_id: str
    examples: int
    tokens: int
    steps: int
    tensors: int = Field(description="How many of the layer's tensors the corpus reached.")


class LayerLineage(BaseModel):
    model_config = _FROZEN

    layer: str = Field(description="The layer's name, 'adapter:NAME', or '(outside layers)'.")
    index: int | None = Field(description="The layer's position in the trial's ordered layers.")
    corpora: list[CorpusCounts]


class Lineage(BaseModel):
    """Which corpora directly shaped each layer of a checkpoint (or of a model version's files)."""

    model_config = _FROZEN

    checkpoint_id: int
    trial_id: int
    experiment_id: int
    step: int = Field(description="The checkpoint's step: what the answer is as of.")
    trial_state: str
    running: bool = Field(description="The trial still trains: a later checkpoint may add to this.")
    as_of: str = Field(description="'as of step N (running)', or the finished trial's state.")
    ledger: Literal["checkpoint", "trial"] = Field(
        description="'checkpoint': rows recorded for this checkpoint; 'trial': the trial's ledger, "
        "recorded with its last checkpoint."
    )
    model: VersionRef | None = None
    layers: list[LayerLineage]


class LayerReach(BaseModel):
    """How far one corpus reached into one layer."""

    model_config = _FROZEN

    layer: str
    index: int | None
    examples: int
    tokens: int
    steps: int
    tensors: int


class InfluenceItem(BaseModel):
    """One trial ledger (a checkpoint) a corpus reached, the model versions made from it, and the
    layers it reached there."""

    model_config = _FROZEN

    trial_id: int
    experiment_id: int
    checkpoint_id: int | None = Field(description="None when the trial's ledger has no checkpoint.")
    step: int | None = Field(description="The checkpoint's step: what the item is as of.")
    trial_state: str
    running: bool = Field(description="The trial still trains: its later checkpoints are further items.")
    model_versions: list[VersionRef]
    layers: list[LayerReach]


class AuditEventView(BaseModel):
    model_config = _FROZEN

    seq: int
    at: str
    event_type: str
    experiment_id: int | None
    actor: str
    payload: dict[str, Any]
    prev_hash: str
    hash: str


class AttestationView(BaseModel):
    model_config = _FROZEN

    id: int
    checkpoint_id: int | None
    model_version_id: int | None
    subject_digest: str = Field(description="sha256 of the attested base model file.")
    predicate_type: str | None = Field(description="None when the stored envelope cannot be read.")
    created_at: datetime
