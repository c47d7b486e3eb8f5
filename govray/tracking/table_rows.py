"""The rows the tracking store writes, built and checked before they reach the database, and its
reads in a session of the caller's (the query layer reads with its own).

The checks give errors for people: an unknown state names the allowed ones, a NaN metric names
the trial, step and metrics, a decision re-reported differently names both.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import ValidationError
from sqlmodel import Session, col, select

from govray.core.errors import TrackingError
from govray.core.identifiers import MAX_ID
from govray.tracking.tables import (
    ControlRequest,
    CorpusRecord,
    DecisionKind,
    DecisionRecord,
    Experiment,
    ExperimentState,
    Metric,
    MetricKind,
    TrialRecord,
    TrialState,
    row_noun,
    utcnow,
)

StateEnum = TypeVar("StateEnum", ExperimentState, TrialState, MetricKind, ControlRequest, DecisionKind)
Row = TypeVar("Row", Experiment, TrialRecord)

# What a caller describes about a corpus; the store fills in the rest.
CORPUS_FIELDS = frozenset(CorpusRecord.model_fields) - {"id", "experiment_id", "created_at"}


def add_decisions(
    session: Session,
    trial_id: int,
    decisions: Iterable[Mapping[str, Any]],
    replayed: bool,
    superseding: bool = False,
) -> int:
    """``TrackingStore.record_decisions`` in ``session``: the decisions not yet stored, added
    (``superseding``: the trial's rows made exactly ``decisions``, those of a state that replaced
    the one the rows were of)."""
    added = 0
    require(session, TrialRecord, trial_id)
    known = {
        row.seq: row
        for row in session.exec(select(DecisionRecord).where(DecisionRecord.trial_id == trial_id))
    }
    decisions = list(decisions)
    if superseding:
        kept = {int(decision["seq"]): decision for decision in decisions}
        for seq, row in list(known.items()):
            if seq not in kept or _payload_of(kept[seq]) != (row.step, row.kind, row.payload_json):
                session.delete(row)
                del known[seq]
        session.flush()
    for decision in decisions:
        step, kind, payload_json = _payload_of(decision)
        row = DecisionRecord(
            trial_id=trial_id,
            seq=int(decision["seq"]),
            step=step,
            kind=kind,
            payload_json=payload_json,
            replayed=replayed,
        )
        if row.seq in known:
            old = known[row.seq]
            if (old.step, old.kind, old.payload_json) != (row.step, row.kind, row.payload_json):
                raise TrackingError(
                    f"trial {trial_id} decision {row.seq} differs from the recorded one "
                    f"(step {old.step} {old.kind} vs step {row.step} {row.kind})"
                )
            continue
        session.add(row)
        known[row.seq] = row
        added += 1
    return added


def _payload_of(decision: Mapping[str, Any]) -> tuple[int, str, str]:
    """(step, kind, payload JSON) of a decision as its row stores them."""
    payload = {k: v for k, v in decision.items() if k not in ("seq", "step", "kind")}
    return (
        int(decision["step"]),
        member(DecisionKind, decision["kind"]).value,
        json.dumps(payload, sort_keys=True),
    )


def corpora_of(session: Session, experiment_id: int) -> list[CorpusRecord]:
    """``TrackingStore.list_corpora``."""
    query = select(CorpusRecord).where(CorpusRecord.experiment_id == experiment_id)
    return list(session.exec(query.order_by(col(CorpusRecord.corpus_id))))


def decisions_of(session: Session, trial_id: int) -> list[DecisionRecord]:
    """``TrackingStore.decisions``."""
    query = select(DecisionRecord).where(DecisionRecord.trial_id == trial_id)
    return list(session.exec(query.order_by(col(DecisionRecord.seq))))


def member(enum: type[StateEnum], value: StateEnum | str) -> StateEnum:
    """``value`` as a member of ``enum``; an unknown one is refused, naming the allowed values."""
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(member.value for member in enum)
        raise TrackingError(f"unknown {enum.__name__} {value!r}; expected one of: {allowed}") from None


def require(session: Session, table: type[Row], row_id: int) -> Row:
    """Row ``row_id`` of ``table``; a missing one is refused, naming it."""
    found = session.get(table, row_id) if 1 <= row_id <= MAX_ID else None  # beyond: no SQL integer
    if found is None:
        raise TrackingError(f"no {row_noun(table)} with id {row_id} in the tracking store")
    return found


def corpus_record(experiment_id: int, record: Mapping[str, Any]) -> CorpusRecord:
    """The corpus row a caller describes, checked: only ``CORPUS_FIELDS``, valid values."""
    unknown = set(record) - CORPUS_FIELDS
    if unknown:
        raise TrackingError(f"corpus record has unexpected fields: {', '.join(sorted(unknown))}")
    try:
        return CorpusRecord.model_validate({**record, "experiment_id": experiment_id})
    except ValidationError as exc:
        corpus = record.get("corpus_id", "?")
        raise TrackingError(f"corpus record {corpus!r} is invalid: {exc}") from exc


def metric_rows(
    trial_id: int, step: int, kind: MetricKind | str, values: Mapping[str, float]
) -> list[Metric]:
    """The metric rows of one report's scalars of one ``kind``; NaN is refused, naming them."""
    metric_kind = member(MetricKind, kind).value
    if nans := sorted(name for name, value in values.items() if math.isnan(value)):
        raise TrackingError(f"trial {trial_id} reported NaN at step {step} for: {', '.join(nans)}")
    now = utcnow()
    return [
        Metric(trial_id=trial_id, step=step, kind=metric_kind, name=name, value=float(value), recorded_at=now)
        for name, value in values.items()
    ]


def advance(
    session: Session, trial_id: int, step: int, stop_reason: str | None, cloned_from: int | None
) -> TrialRecord:
    """A trial's progress after a report at ``step`` (its stop and its PBT donor, when given)."""
    trial = require(session, TrialRecord, trial_id)
    trial.last_step = max(trial.last_step or 0, step)
    if stop_reason is not None:
        trial.stop_reason = stop_reason
    if cloned_from is not None:
        require(session, TrialRecord, cloned_from)
        trial.cloned_from = cloned_from
    session.add(trial)
    return trial
