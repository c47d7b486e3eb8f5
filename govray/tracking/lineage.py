"""Lineage in the tracking store: the checkpoints of a trial (recorded, found by path, marked
deleted by GC) and which corpus reached which tensor.

Each recorded checkpoint has its own ledger rows (``checkpoint_id`` set): what had reached each
tensor by its step. Rows without a checkpoint id are a trial's ledger recorded at its end by a run
that seals no checkpoint. GC deleting a checkpoint drops its rows
unless a registered version or an attestation points at it, or it is its trial's latest (the
trial's ledger): a trial keeps at most (its checkpoints GC keeps + those it attested or
registered + 1) x corpora x tensors rows, however long it runs."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import insert
from sqlmodel import Session, col, delete, select

from govray.core.canonical import file_sha256
from govray.core.errors import TrackingError
from govray.core.identifiers import MAX_ID
from govray.tracking.store import TrackingStore
from govray.tracking.tables import (
    LIVE_TRIAL_STATES,
    AttestationRecord,
    CheckpointRecord,
    CheckpointStatus,
    LedgerRow,
    Metric,
    MetricKind,
    ModelVersion,
    TrialRecord,
    utcnow,
)

LedgerTuple = tuple[str, str, int | None, int, int, int]  # (corpus, tensor, layer, examples, tokens, steps)


def record_ledger(
    store: TrackingStore,
    trial_id: int,
    rows: Iterable[LedgerTuple],
    checkpoint_id: int | None = None,
) -> int:
    """Replace the trial's ledger (for ``checkpoint_id``) with ``(corpus, tensor, layer, examples,
    tokens, steps)`` rows, inserted in bulk; returns how many were written."""
    records = [
        {
            "trial_id": trial_id,
            "checkpoint_id": checkpoint_id,
            "corpus_id": corpus,
            "parameter": tensor,
            "layer_index": layer,
            "examples": examples,
            "tokens": tokens,
            "steps": steps,
        }
        for corpus, tensor, layer, examples, tokens, steps in rows
    ]
    held_by = col(LedgerRow.checkpoint_id)  # PostgreSQL, unlike SQLite, has no "IS <id>"
    same_checkpoint = held_by.is_(None) if checkpoint_id is None else held_by == checkpoint_id
    with store.session() as session:
        session.exec(delete(LedgerRow).where(col(LedgerRow.trial_id) == trial_id, same_checkpoint))
        if records:
            session.execute(insert(LedgerRow), records)
    return len(records)


def ledger_rows(store: TrackingStore, trial_id: int) -> list[LedgerRow]:
    """A trial's ledger, by corpus then tensor: the one recorded at its end (no checkpoint id), else
    the ledger of its latest checkpoint that has one stored (none: no rows)."""
    with store.session() as session:
        by_trial = col(LedgerRow.trial_id) == trial_id
        held_by = col(LedgerRow.checkpoint_id)
        rows = _ordered(session, select(LedgerRow).where(by_trial, held_by.is_(None)))
        if rows:
            return rows
        with_ledger = select(LedgerRow.checkpoint_id).where(by_trial, held_by.is_not(None)).distinct()
        latest = session.exec(
            select(CheckpointRecord.id)
            .where(col(CheckpointRecord.id).in_(with_ledger))
            .order_by(col(CheckpointRecord.step).desc(), col(CheckpointRecord.id).desc())
            .limit(1)
        ).first()
        return [] if latest is None else _ordered(session, select(LedgerRow).where(held_by == latest))


def checkpoint_ledger_rows(store: TrackingStore, checkpoint_id: int) -> list[LedgerRow]:
    """The ledger rows stored for one checkpoint, by corpus then tensor (none: not stored)."""
    with store.session() as session:
        return _ordered(session, select(LedgerRow).where(col(LedgerRow.checkpoint_id) == checkpoint_id))


def _ordered(session: Session, query: Any) -> list[LedgerRow]:
    return list(session.exec(query.order_by(col(LedgerRow.corpus_id), col(LedgerRow.parameter))))


def as_of(step: int, trial_state: str) -> str:
    """``as of step N (running)``: what an answer about a trial's weights reflects."""
    return f"as of step {step} ({'running' if trial_state in LIVE_TRIAL_STATES else trial_state})"


def record_checkpoint(store: TrackingStore, trial_id: int, path: str, step: int) -> CheckpointRecord:
    """Record a persisted checkpoint (its manifest digest read from storage)."""
    manifest = Path(path) / "manifest.json"
    digest = file_sha256(manifest) if manifest.exists() else ""
    record = CheckpointRecord(
        trial_id=trial_id,
        uuid=uuid.uuid4().hex,
        path=path,
        step=step,
        manifest_digest=digest,
        state="active",
        metrics_json="{}",
    )
    with store.session() as session:
        session.add(record)
    return record


def checkpoint_record(store: TrackingStore, checkpoint_id: int) -> CheckpointRecord:
    """The recorded checkpoint with this id."""
    with store.session() as session:
        found = session.get(CheckpointRecord, checkpoint_id) if 1 <= checkpoint_id <= MAX_ID else None
    if found is None:
        raise TrackingError(f"no checkpoint with id {checkpoint_id} in the tracking store")
    return found


def checkpoints(store: TrackingStore, trial_id: int) -> list[CheckpointRecord]:
    """A trial's checkpoints, by step."""
    with store.session() as session:
        return checkpoints_of(session, trial_id)


def checkpoints_of(session: Session, trial_id: int) -> list[CheckpointRecord]:
    """``checkpoints`` in a session of the caller's (the query layer reads with its own)."""
    query = select(CheckpointRecord).where(CheckpointRecord.trial_id == trial_id)
    return list(session.exec(query.order_by(col(CheckpointRecord.step), col(CheckpointRecord.id))))


def final_checkpoint_record(store: TrackingStore, trial_id: int) -> CheckpointRecord | None:
    """The trial's newest checkpoint GC kept (GC never deletes a trial's latest): a run's in its
    Ray Train run directory, a search trial's the copy Ray Tune keeps, at the step it ended at
    (an ASHA stop's, whatever its workers did after it)."""
    kept = [c for c in checkpoints(store, trial_id) if c.state == CheckpointStatus.ACTIVE.value]
    return kept[-1] if kept else None


def checkpoint_at(store: TrackingStore, checkpoint: Path) -> CheckpointRecord | None:
    """The recorded checkpoint whose directory is ``checkpoint`` (both paths resolved), if any."""
    wanted = checkpoint.resolve()
    with store.session() as session:
        for record in session.exec(select(CheckpointRecord)):
            if Path(record.path).resolve() == wanted:
                return record
    return None


def trial_of(store: TrackingStore, checkpoint: Path) -> TrialRecord | None:
    """The trial that saved ``checkpoint``, when the tracking store recorded it under this path
    (as given or resolved)."""
    wanted = {str(checkpoint), str(checkpoint.resolve())}
    with store.session() as session:
        query = select(TrialRecord).join(
            CheckpointRecord, col(CheckpointRecord.trial_id) == col(TrialRecord.id)
        )
        return session.exec(query.where(col(CheckpointRecord.path).in_(wanted))).first()


@dataclass(frozen=True)
class ActiveCheckpoints:
    """One experiment's active checkpoints and the facts checkpoint GC decides them by, read in
    one transaction."""

    checkpoints: tuple[CheckpointRecord, ...]  # by trial, step, id
    trial_states: dict[int, str]  # every trial of the experiment
    # (trial, step, value) of the validation metric GC ranks by at these checkpoints' steps, in the
    # order reported (a step reported twice: its last report comes last)
    reports: tuple[tuple[int, int, float], ...]
    versions: tuple[ModelVersion, ...]  # registered versions of these checkpoints, by model, version


def active_checkpoints(store: TrackingStore, experiment_id: int, metric: str) -> ActiveCheckpoints:
    """An experiment's active checkpoints, its trials' states, its trials' validation reports of
    ``metric`` and the model versions registered from those checkpoints."""
    in_experiment = col(TrialRecord.experiment_id) == experiment_id
    is_active = col(CheckpointRecord.state) == CheckpointStatus.ACTIVE.value
    with store.session() as session:
        trials = session.exec(select(TrialRecord.id, TrialRecord.state).where(in_experiment))
        states = {trial_id: state for trial_id, state in trials if trial_id is not None}
        records = session.exec(
            select(CheckpointRecord)
            .join(TrialRecord, col(TrialRecord.id) == col(CheckpointRecord.trial_id))
            .where(in_experiment, is_active)
            .order_by(col(CheckpointRecord.trial_id), col(CheckpointRecord.step), col(CheckpointRecord.id))
        ).all()
        # Only the reports at active checkpoints' steps, as plain rows: GC runs at every checkpoint
        # a search records, and every validation row of the experiment as an ORM object cost a
        # search's driver more with each trial.
        at_checkpoint = (col(CheckpointRecord.trial_id) == col(Metric.trial_id)) & (
            col(CheckpointRecord.step) == col(Metric.step)
        )
        reported = session.exec(
            select(Metric.trial_id, Metric.step, Metric.value)
            .join(CheckpointRecord, at_checkpoint)
            .join(TrialRecord, col(TrialRecord.id) == col(Metric.trial_id))
            .where(
                in_experiment,
                is_active,
                Metric.kind == MetricKind.VALIDATION.value,
                Metric.name == metric,
            )
            .order_by(col(Metric.id))
        ).all()
        versions = session.exec(
            select(ModelVersion)
            .join(CheckpointRecord, col(CheckpointRecord.id) == col(ModelVersion.checkpoint_id))
            .join(TrialRecord, col(TrialRecord.id) == col(CheckpointRecord.trial_id))
            .where(in_experiment, is_active)
            .order_by(col(ModelVersion.model_name), col(ModelVersion.version))
        ).all()
    return ActiveCheckpoints(
        tuple(records), states, tuple((t, step, value) for t, step, value in reported), tuple(versions)
    )


def mark_deleted(store: TrackingStore, checkpoint_id: int) -> CheckpointRecord | None:
    """Mark a checkpoint deleted by GC (its row stays, as the record); None if there is no such row.

    Its ledger rows go too, in the same transaction, unless a registered version or an attestation
    points at the checkpoint or it is its trial's latest (the trial's ledger)."""
    with store.session() as session:
        record = session.get(CheckpointRecord, checkpoint_id)
        if record is not None:
            record.state = CheckpointStatus.DELETED.value
            record.deleted_at = utcnow()
            session.add(record)
            if not _ledger_needed(session, record):
                session.exec(delete(LedgerRow).where(col(LedgerRow.checkpoint_id) == checkpoint_id))
    return record


def _ledger_needed(session: Session, record: CheckpointRecord) -> bool:
    """Whether a checkpoint's ledger rows outlive its files: a version or an attestation cites it,
    or it is its trial's latest checkpoint."""
    cited = (
        select(ModelVersion.id).where(ModelVersion.checkpoint_id == record.id),
        select(AttestationRecord.id).where(AttestationRecord.checkpoint_id == record.id),
    )
    if any(session.exec(query.limit(1)).first() is not None for query in cited):
        return True
    latest = checkpoints_of(session, record.trial_id)
    return bool(latest) and latest[-1].id == record.id


def record_attestation(
    store: TrackingStore, checkpoint_id: int | None, subject_digest: str, envelope_json: str
) -> AttestationRecord:
    """Store a signed attestation envelope about a checkpoint (keyed by its base model's digest)."""
    record = AttestationRecord(
        checkpoint_id=checkpoint_id, subject_digest=subject_digest, envelope_json=envelope_json
    )
    with store.session() as session:
        session.add(record)
    return record


def attestations(store: TrackingStore, checkpoint_id: int) -> list[AttestationRecord]:
    with store.session() as session:
        query = select(AttestationRecord).where(AttestationRecord.checkpoint_id == checkpoint_id)
        return list(session.exec(query.order_by(col(AttestationRecord.id))))
