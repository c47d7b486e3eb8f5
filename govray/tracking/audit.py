"""The append-only, hash-chained audit log of governance events.

Every event carries the hash of the one before it, so editing, removing or reordering a past
event breaks the chain at that event, and ``verify`` names it::

    log = AuditLog(store)
    log.append(AuditEventType.RUN_REFUSED, {"reason": "unsigned policy"}, experiment_id=3)
    log.verify()  # -> number of events checked, or TrackingError naming the first bad seq

``hash = sha256(canonical_json({seq, at, event_type, experiment_id, actor, payload, prev_hash}))``
with ``payload`` the parsed JSON document and the first event's ``prev_hash`` 64 zeros. (Cutting
events off the end leaves a shorter valid chain; compare ``verify()``'s count with one kept
elsewhere to detect that.)
"""

from __future__ import annotations

import builtins
import getpass
import json
import os
import random
import time
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from govray.core.canonical import canonical_json, sha256_hex
from govray.core.errors import TrackingError
from govray.tracking.store import TrackingStore
from govray.tracking.tables import AuditEvent

GENESIS_HASH = "0" * 64
MAX_APPEND_ATTEMPTS = 64
BACKOFF_STEP_S = 0.002


class AuditEventType(StrEnum):
    """The governance events the log records; nothing else is appended."""

    POLICY_UNSIGNED_ALLOWED = "policy.unsigned_allowed"
    POLICY_VERIFIED = "policy.verified"
    INGEST_REFUSED = "ingest.refused"
    INGEST_COMPLETED = "ingest.completed"
    EXPERIMENT_CREATED = "experiment.created"
    RUN_REFUSED = "run.refused"
    GC_DELETED = "gc.deleted"
    CHECKPOINT_RECOVERED = "checkpoint.recovered"  # on storage, its report lost at a worker's death
    CHECKPOINT_REMOVED = "checkpoint.removed"  # a partial or duplicate folder a killed worker left
    REGISTRY_CHANGED = "registry.changed"
    MEMORIZATION_FLAGGED = "memorization.flagged"
    MEMORIZATION_GATE = "memorization.gate"
    MEMORIZATION_ROLLBACK = "memorization.rollback"
    REPLAY_COMPLETED = "replay.completed"
    DATA_CHANGED = "data.changed"
    GC_POLICY_CHANGED = "gc.policy_changed"
    EXPERIMENT_REQUESTED = "experiment.requested"  # pause or kill asked by a user
    EXPERIMENT_FORKED = "experiment.forked"
    SEARCH_BEGAN = "search.began"  # the record a search's trials run (its sha256): a resume checks it


def default_actor() -> str:
    """The operating-system user running this process (``uid:N`` when it has no name)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid:{os.getuid()}"


def utc_timestamp(moment: datetime) -> str:
    """``moment`` as the fixed-width UTC ISO text stored in ``AuditEvent.at``.

    Fixed width (always microseconds, always ``+00:00``) makes text order equal time order.
    """
    if moment.tzinfo is None:
        raise TrackingError(f"naive datetime {moment.isoformat()} given; use a UTC-aware one")
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


def event_hash(event: AuditEvent) -> str:
    """The hash an event's content must have (raises ValueError if its payload is not JSON)."""
    content = {
        "seq": event.seq,
        "at": event.at,
        "event_type": event.event_type,
        "experiment_id": event.experiment_id,
        "actor": event.actor,
        "payload": json.loads(event.payload_json),
        "prev_hash": event.prev_hash,
    }
    return sha256_hex(canonical_json(content))


def chain_problem(event: AuditEvent, expected_seq: int, prev_hash: str) -> str | None:
    """What is wrong with ``event`` as the successor of a chain ending in ``prev_hash``."""
    if event.seq != expected_seq:
        return f"expected seq {expected_seq} but the next event is seq {event.seq} (missing)"
    try:
        content_hash = event_hash(event)
    except ValueError as exc:
        return f"payload is not valid JSON ({exc}); it was edited"
    if content_hash != event.hash:
        return f"content was edited: it hashes to {content_hash}, not the stored {event.hash}"
    if event.prev_hash != prev_hash:
        return f"broken link: prev_hash {event.prev_hash} is not the hash of seq {event.seq - 1}"
    return None


class AuditLog:
    """The audit log kept in a tracking store."""

    def __init__(self, store: TrackingStore) -> None:
        self.store = store

    def append(
        self,
        event_type: AuditEventType | str,
        payload: dict[str, Any],
        experiment_id: int | None = None,
        actor: str | None = None,
    ) -> AuditEvent:
        """Append one event at the end of the chain and return it.

        Writers racing for the same position collide on the ``seq`` primary key; the loser
        re-reads the end of the chain and tries again after a short random pause. On PostgreSQL,
        where many controllers share one server, appenders first queue on a table lock, so none
        races (or starves) at all; see ``_queue_behind_other_appenders``.
        """
        kind = _event_type(event_type)
        try:
            payload_json = canonical_json(payload).decode()
        except (TypeError, ValueError) as exc:
            raise TrackingError(f"audit payload of {kind.value!r} is not JSON: {exc}") from exc
        who = actor if actor is not None else default_actor()
        for attempt in range(MAX_APPEND_ATTEMPTS):
            try:
                with self.store.session() as session:
                    _queue_behind_other_appenders(session)
                    event = _next_event(session, kind, payload_json, experiment_id, who)
                    session.add(event)
                return event
            except IntegrityError:
                time.sleep(random.uniform(0, BACKOFF_STEP_S * (attempt + 1)))
        raise TrackingError(
            f"could not append {kind.value!r} to the audit log after {MAX_APPEND_ATTEMPTS} "
            "attempts: other writers kept taking the next seq"
        )

    def verify(self) -> int:
        """Check the whole chain from seq 1; return how many events verified.

        Raises TrackingError naming the first bad seq and what is wrong with it.
        """
        expected_seq, prev_hash = 1, GENESIS_HASH
        query = select(AuditEvent).order_by(col(AuditEvent.seq))
        with self.store.session() as session:
            for event in session.exec(query.execution_options(yield_per=1000)):
                problem = chain_problem(event, expected_seq, prev_hash)
                if problem is not None:
                    raise TrackingError(f"audit chain broken at seq {expected_seq}: {problem}")
                expected_seq, prev_hash = expected_seq + 1, event.hash
        return expected_seq - 1

    def list(
        self,
        experiment_id: int | None = None,
        event_type: AuditEventType | str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> builtins.list[AuditEvent]:
        """Events in chain order, filtered by experiment, type and ``since <= at < until``."""
        query = select(AuditEvent)
        if experiment_id is not None:
            query = query.where(AuditEvent.experiment_id == experiment_id)
        if event_type is not None:
            query = query.where(AuditEvent.event_type == _event_type(event_type).value)
        if since is not None:
            query = query.where(col(AuditEvent.at) >= utc_timestamp(since))
        if until is not None:
            query = query.where(col(AuditEvent.at) < utc_timestamp(until))
        with self.store.session() as session:
            return builtins.list(session.exec(query.order_by(col(AuditEvent.seq))))


def _event_type(value: AuditEventType | str) -> AuditEventType:
    try:
        return AuditEventType(value)
    except ValueError:
        known = ", ".join(member.value for member in AuditEventType)
        raise TrackingError(f"unknown audit event type {value!r}; known: {known}") from None


def _queue_behind_other_appenders(session: Session) -> None:
    """On PostgreSQL, take the audit table's append lock until this transaction ends.

    SHARE ROW EXCLUSIVE conflicts with itself and with writes, not with reads: appenders wait in
    turn (first come, first served) while verify, list and the lineage app read on. With 8
    writers the retry loop alone took up to 23 attempts for one append here, and the tail grows
    with the number of writers. SQLite lets one writer in at a time already.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"LOCK TABLE {AuditEvent.__tablename__} IN SHARE ROW EXCLUSIVE MODE"))


def _next_event(
    session: Session, kind: AuditEventType, payload_json: str, experiment_id: int | None, actor: str
) -> AuditEvent:
    last = session.exec(select(AuditEvent).order_by(col(AuditEvent.seq).desc()).limit(1)).first()
    event = AuditEvent(
        seq=1 if last is None else last.seq + 1,
        at=utc_timestamp(datetime.now(UTC)),
        event_type=kind.value,
        experiment_id=experiment_id,
        actor=actor,
        payload_json=payload_json,
        prev_hash=GENESIS_HASH if last is None else last.hash,
        hash="",
    )
    event.hash = event_hash(event)
    return event
