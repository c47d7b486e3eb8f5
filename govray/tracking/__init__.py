"""Tracking: experiments, trials, metrics, lineage rows and the hash-chained audit log.

``TrackingStore.open(url)`` migrates the database (Alembic, ``migrations/``) and returns the store;
``AuditLog(store)`` appends and verifies governance events.
"""

from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.database import current_revision, upgrade
from govray.tracking.store import TrackingStore
from govray.tracking.tables import (
    AttestationRecord,
    AuditEvent,
    CheckpointRecord,
    CheckpointStatus,
    ControlRequest,
    CorpusRecord,
    DecisionKind,
    DecisionRecord,
    Experiment,
    ExperimentState,
    LedgerRow,
    Metric,
    MetricKind,
    ModelVersion,
    RegisteredModel,
    TrialRecord,
    TrialState,
)

__all__ = [
    "AttestationRecord",
    "AuditEvent",
    "AuditEventType",
    "AuditLog",
    "CheckpointRecord",
    "CheckpointStatus",
    "ControlRequest",
    "CorpusRecord",
    "DecisionKind",
    "DecisionRecord",
    "Experiment",
    "ExperimentState",
    "LedgerRow",
    "Metric",
    "MetricKind",
    "ModelVersion",
    "RegisteredModel",
    "TrackingStore",
    "TrialRecord",
    "TrialState",
    "current_revision",
    "upgrade",
]
