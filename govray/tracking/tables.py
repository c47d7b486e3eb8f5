"""The tracking schema: one SQLModel class per table, declared once.

JSON documents are stored as text and timestamps as timezone-aware UTC, so the same rows read
back identically from SQLite and PostgreSQL. The hand-written migration
``migrations/versions/0001_release.py`` creates exactly this metadata; a test compares them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import BigInteger, DateTime, Dialect, Index, Integer, Text, TypeDecorator, UniqueConstraint
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is stored in UTC and always read back timezone-aware.

    SQLite keeps no offset, so values are normalised to UTC on the way in and tagged UTC on the
    way out; naive datetimes are refused rather than guessed at.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()} given; use a UTC-aware one")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime from the database, got {value!r}")
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# A count that can pass 2**31 (tokens over a run, rows of a web-scale corpus): BIGINT on PostgreSQL,
# whose INTEGER is 32-bit. SQLite's INTEGER holds 64 bits already and stays as it is (migration 0006).
COUNT = BigInteger().with_variant(Integer(), "sqlite")


class ExperimentState(StrEnum):
    """Determined's lifecycle: the driver sets ``active``/``completed``/``errored``; ``paused`` and
    ``killed`` follow a request (``govray experiment pause|kill``) at the next step boundary."""

    CREATED = "created"
    INGESTED = "ingested"
    ACTIVE = "active"
    PAUSED = "paused"
    COMPLETED = "completed"
    ERRORED = "errored"
    KILLED = "killed"


class TrialState(StrEnum):
    PENDING = "pending"
    ACTIVE = "active"
    PAUSED = "paused"
    COMPLETED = "completed"
    ERRORED = "errored"
    KILLED = "killed"


TERMINAL_TRIAL_STATES = frozenset({TrialState.COMPLETED, TrialState.ERRORED, TrialState.KILLED})
# A pending trial may be about to resume from its latest checkpoint, a running or paused one surely
# will: its ledger and checkpoints may still grow.
LIVE_TRIAL_STATES = frozenset({TrialState.PENDING.value, TrialState.ACTIVE.value, TrialState.PAUSED.value})
TERMINAL_EXPERIMENT_STATES = frozenset(
    {ExperimentState.COMPLETED, ExperimentState.ERRORED, ExperimentState.KILLED}
)


class TrialKind(StrEnum):
    """An original trial trains as configured; a replay reruns a recorded trial (``replay_of``)
    with some corpora excluded, so its weights are a counterfactual, never the experiment's result."""

    ORIGINAL = "original"
    REPLAY = "replay"


class ControlRequest(StrEnum):
    """What a user asked of a running experiment; its driver acts on it at a step boundary."""

    PAUSE = "pause"
    KILL = "kill"


class DecisionKind(StrEnum):
    """Decisions a trial recorded, so a replay applies them instead of recomputing (all but a
    preemption, which has no training effect)."""

    LR_SCALE = "lr_scale"
    EARLY_STOP = "early_stop"
    GATE = "gate"
    ROLLBACK = "rollback"
    LOSS_SCALE_SKIP = "loss_scale_skip"  # fp16: a route's overflow skipped its tensors' update
    PREEMPTED = "preempted"  # a node's reclaim notice: a checkpoint sealed, nothing trained after it


class MetricKind(StrEnum):
    TRAINING = "training"
    VALIDATION = "validation"


class CheckpointStatus(StrEnum):
    ACTIVE = "active"
    DELETED = "deleted"


class Experiment(SQLModel, table=True):
    """One governed experiment: its frozen config and the policy it runs under."""

    __tablename__ = "experiments"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True)
    description: str = ""
    config_json: str = Field(sa_type=Text)
    config_digest: str
    policy_digest: str | None = None
    storage_path: str
    state: str = ExperimentState.CREATED.value
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    # migration 0003: lineage, a GC policy set after creation, and a pending pause/kill request
    parent_id: int | None = Field(default=None, foreign_key="experiments.id")
    gc_policy_json: str | None = Field(default=None, sa_type=Text)
    requested: str | None = None


class TrialRecord(SQLModel, table=True):
    """One training run of an experiment with fixed hyper-parameters and seed."""

    __tablename__ = "trials"

    id: int | None = Field(default=None, primary_key=True)
    experiment_id: int = Field(foreign_key="experiments.id", index=True)
    hparams_json: str = Field(sa_type=Text)
    seed: int
    state: str = TrialState.PENDING.value
    ray_run_name: str | None = None
    cloned_from: int | None = Field(default=None, foreign_key="trials.id")
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    reproducibility_json: str | None = Field(default=None, sa_type=Text)  # migration 0002
    source_checkpoint_json: str | None = Field(default=None, sa_type=Text)  # migration 0003
    kind: str = TrialKind.ORIGINAL.value  # migration 0007
    replay_of: int | None = Field(default=None, foreign_key="trials.id")  # the trial a replay reruns
    last_step: int | None = None  # the last step it reported (migration 0008)
    stop_reason: str | None = None  # pause, kill or early_stop: why it ended before its last step
    # [[from_step, workers], ...]: the world sizes it trained on (migration 0010; NULL before).
    world_history_json: str | None = Field(default=None, sa_type=Text)

    @property
    def world_history(self) -> list[tuple[int, int]]:
        """The world sizes the trial trained on, from each step (empty: not recorded)."""
        if not self.world_history_json:
            return []
        return [(int(step), int(workers)) for step, workers in json.loads(self.world_history_json)]


class DecisionRecord(SQLModel, table=True):
    """A decision a trial made from its metrics (LR on plateau, early stop, gate, rollback).

    ``replayed`` marks a decision a counterfactual replay applied from its source trial's record
    rather than computing it.
    """

    __tablename__ = "decisions"
    __table_args__ = (UniqueConstraint("trial_id", "seq", name="uq_decisions_trial_seq"),)

    id: int | None = Field(default=None, primary_key=True)
    trial_id: int = Field(foreign_key="trials.id", index=True)
    seq: int  # position in the trial's decision record
    step: int
    kind: str
    payload_json: str = Field(sa_type=Text)
    replayed: bool = False
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Metric(SQLModel, table=True):
    """One scalar reported by a trial at one step."""

    __tablename__ = "metrics"
    __table_args__ = (Index("ix_metrics_trial_name_step", "trial_id", "name", "step"),)

    id: int | None = Field(default=None, primary_key=True)
    trial_id: int = Field(foreign_key="trials.id")
    step: int
    kind: str
    name: str
    value: float
    recorded_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class CorpusRecord(SQLModel, table=True):
    """One corpus as ingested for an experiment: its fingerprint, credential and routes."""

    __tablename__ = "corpora"
    __table_args__ = (UniqueConstraint("experiment_id", "corpus_id", name="uq_corpora_experiment_corpus"),)

    id: int | None = Field(default=None, primary_key=True)
    experiment_id: int = Field(foreign_key="experiments.id")
    corpus_id: str = Field(index=True)
    role: str
    fingerprint: str
    rows: int = Field(sa_type=COUNT)
    train_rows: int = Field(sa_type=COUNT)
    holdout_rows: int = Field(sa_type=COUNT)
    credential_json: str = Field(sa_type=Text)
    route_counts_json: str = Field(sa_type=Text)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class CheckpointRecord(SQLModel, table=True):
    """A checkpoint a trial saved; GC marks it deleted and keeps the row (and attestations)."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("uuid", name="uq_checkpoints_uuid"),)

    id: int | None = Field(default=None, primary_key=True)
    trial_id: int = Field(foreign_key="trials.id", index=True)
    uuid: str
    path: str
    step: int
    manifest_digest: str
    state: str = CheckpointStatus.ACTIVE.value
    metrics_json: str = Field(sa_type=Text)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    deleted_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class RegisteredModel(SQLModel, table=True):
    """A named model in the registry; its versions point at checkpoints."""

    __tablename__ = "registered_models"

    name: str = Field(primary_key=True)
    description: str = ""
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class ModelVersion(SQLModel, table=True):
    """Version ``version`` of a registered model: one checkpoint plus tags.

    A version registered from a checkpoint reads its model files there (``path`` is None); one
    made by removing adapters has its own sealed directory ``path``, the version it came from
    (``parent_id``), and its checkpoint is the one its weights descend from.
    """

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_name", "version", name="uq_model_versions_name_version"),)

    id: int | None = Field(default=None, primary_key=True)
    model_name: str = Field(foreign_key="registered_models.name", index=True)
    version: int
    checkpoint_id: int = Field(foreign_key="checkpoints.id", index=True)  # migration 0006
    tags_json: str = Field(default="{}", sa_type=Text)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    # migration 0004
    parent_id: int | None = Field(default=None, foreign_key="model_versions.id")
    path: str | None = Field(default=None, sa_type=Text)
    description: str = Field(default="", sa_column_kwargs={"server_default": ""})
    removed_adapters_json: str = Field(default="[]", sa_type=Text, sa_column_kwargs={"server_default": "[]"})
    excluded_corpora_json: str = Field(default="[]", sa_type=Text, sa_column_kwargs={"server_default": "[]"})


class AttestationRecord(SQLModel, table=True):
    """A signed attestation envelope about a checkpoint or a model version."""

    __tablename__ = "attestations"

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int | None = Field(default=None, foreign_key="checkpoints.id", index=True)
    model_version_id: int | None = Field(default=None, foreign_key="model_versions.id", index=True)
    subject_digest: str = Field(index=True)
    envelope_json: str = Field(sa_type=Text)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class LedgerRow(SQLModel, table=True):
    """How much of one corpus reached one parameter tensor in one trial (the lineage ledger)."""

    __tablename__ = "ledger_rows"
    __table_args__ = (
        Index("ix_ledger_rows_corpus_parameter", "corpus_id", "parameter"),
        Index("ix_ledger_rows_trial_parameter", "trial_id", "parameter"),
        Index("ix_ledger_rows_corpus_trial", "corpus_id", "trial_id", "checkpoint_id"),  # migration 0005
        Index("ix_ledger_rows_corpus_id", "corpus_id", "id"),  # migration 0009: newest row of a corpus
        Index("ix_ledger_rows_trial_id", "trial_id", "id"),  # and of a trial
    )

    id: int | None = Field(default=None, primary_key=True)
    trial_id: int = Field(foreign_key="trials.id")
    checkpoint_id: int | None = Field(default=None, foreign_key="checkpoints.id")
    corpus_id: str
    parameter: str
    layer_index: int | None = None
    examples: int = Field(sa_type=COUNT)
    tokens: int = Field(sa_type=COUNT)
    steps: int


class AuditEvent(SQLModel, table=True):
    """One link of the append-only, hash-chained audit log (see ``govray.tracking.audit``).

    ``seq`` is the chain position and the primary key, so two writers racing for the same
    position collide on it. ``at`` is ISO text so the hashed bytes never depend on a driver's
    datetime handling. ``experiment_id`` has no foreign key: the log outlives what it audits.
    """

    __tablename__ = "audit_events"

    seq: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    at: str
    event_type: str = Field(index=True)
    experiment_id: int | None = Field(default=None, index=True)
    actor: str
    payload_json: str = Field(sa_type=Text)
    prev_hash: str
    hash: str


def row_noun(table: type[SQLModel]) -> str:
    """What one row of ``table`` is called in messages: ``trial``, ``checkpoint``, ``model version``."""
    name = table.__name__.removesuffix("Record")
    return "".join(f" {c.lower()}" if c.isupper() else c for c in name).strip()
