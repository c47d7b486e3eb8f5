"""``StoreReader``: the read-only verbs over a tracking store (experiments, trials, metrics, corpora,
decisions, model versions, lineage, influence, audit events, attestations). The lineage app's
endpoints and pages and ``govray experiment describe`` read through it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import Engine, and_, func
from sqlalchemy.sql import Select
from sqlmodel import Session, col, select

from govray.provenance.statement_types import PROVENANCE_TYPE
from govray.queries import changes, ledger_rows
from govray.queries.changes import Topic
from govray.queries.documents import (
    attestation_view,
    checkpoint_view,
    experiment_view,
    json_object,
    metric_view,
    trial_view,
    version_view,
)
from govray.queries.errors import NotFoundError, QueryError
from govray.queries.views import (
    AttestationView,
    AuditEventView,
    CheckpointView,
    DecisionView,
    ExperimentDetail,
    ExperimentView,
    InfluenceItem,
    Lineage,
    MetricView,
    ModelVersionView,
    ModelView,
    Page,
    TrialDetail,
    TrialView,
    VersionRef,
    Window,
    page,
)
from govray.tracking.audit import AuditEventType, utc_timestamp
from govray.tracking.lineage import checkpoints_of
from govray.tracking.table_rows import corpora_of, decisions_of
from govray.tracking.tables import (
    AttestationRecord,
    AuditEvent,
    CheckpointRecord,
    CorpusRecord,
    Experiment,
    Metric,
    ModelVersion,
    RegisteredModel,
    TrialRecord,
    row_noun,
)

Query = TypeVar("Query", bound=Select[Any])
_Row = TypeVar("_Row", Experiment, TrialRecord, CheckpointRecord, AttestationRecord, ModelVersion)


class StoreReader:
    """Answers questions about one tracking store; never writes to it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.layer_names = ledger_rows.LayerNames()  # immutable coverage envelopes, parsed once

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine) as session:
            yield session

    # -- experiments, trials, metrics ------------------------------------------------------------

    def experiments(self, window: Window) -> Page[ExperimentView]:
        with self.session() as session:
            total = _count(session, select(Experiment))
            rows = session.exec(_sliced(select(Experiment).order_by(col(Experiment.id)), window))
            experiments = list(rows)
            counts = _trial_counts(session, [e.id for e in experiments if e.id is not None])
        items = [experiment_view(e, counts.get(e.id or 0, 0)) for e in experiments]
        return page(items, total, window)

    def experiment(self, experiment_id: int) -> ExperimentDetail:
        with self.session() as session:
            found = _get(session, Experiment, experiment_id)
            trials = _trial_counts(session, [experiment_id]).get(experiment_id, 0)
        view = experiment_view(found, trials)
        return ExperimentDetail(**view.model_dump(), config=json_object(found.config_json))

    def trials(self, experiment_id: int, window: Window) -> Page[TrialView]:
        with self.session() as session:
            _get(session, Experiment, experiment_id)
            query = select(TrialRecord).where(TrialRecord.experiment_id == experiment_id)
            total = _count(session, query)
            rows = list(session.exec(_sliced(query.order_by(col(TrialRecord.id)), window)))
        return page([trial_view(t) for t in rows], total, window)

    def trial(self, trial_id: int) -> TrialDetail:
        with self.session() as session:
            found = _get(session, TrialRecord, trial_id)
            saved = checkpoints_of(session, trial_id)
        source = json_object(found.source_checkpoint_json) if found.source_checkpoint_json else None
        return TrialDetail(
            **trial_view(found).model_dump(),
            source_checkpoint=source,
            checkpoints=[checkpoint_view(c) for c in saved],
        )

    def metrics(self, trial_id: int, window: Window, name: str | None = None) -> Page[MetricView]:
        """A trial's metrics by name then step (only ``name`` when given)."""
        with self.session() as session:
            _get(session, TrialRecord, trial_id)
            query = select(Metric).where(Metric.trial_id == trial_id)
            if name is not None:
                query = query.where(Metric.name == name)
            total = _count(session, query)
            order = (col(Metric.name), col(Metric.step), col(Metric.id))
            rows = list(session.exec(_sliced(query.order_by(*order), window)))
        return page([metric_view(m) for m in rows], total, window)

    def latest_metrics(self, trial_ids: Sequence[int]) -> dict[int, list[MetricView]]:
        """Per trial, each metric (kind and name) at the highest step it was reported — the last
        report of that step — in one query; a trial that reported nothing is absent."""
        last_step = (
            select(Metric.trial_id, Metric.kind, Metric.name, func.max(Metric.step).label("step"))
            .where(col(Metric.trial_id).in_(trial_ids))
            .group_by(col(Metric.trial_id), col(Metric.kind), col(Metric.name))
            .subquery()
        )
        at_last_step = and_(
            col(Metric.trial_id) == last_step.c.trial_id,
            col(Metric.kind) == last_step.c.kind,
            col(Metric.name) == last_step.c.name,
            col(Metric.step) == last_step.c.step,
        )
        with self.session() as session:
            rows = session.exec(select(Metric).join(last_step, at_last_step).order_by(col(Metric.id))).all()
        latest: dict[int, dict[tuple[str, str], MetricView]] = {}
        for row in rows:  # by id: a step reported twice counts its last report
            latest.setdefault(row.trial_id, {})[(row.kind, row.name)] = metric_view(row)
        return {trial_id: list(metrics.values()) for trial_id, metrics in latest.items()}

    def decisions(self, trial_id: int) -> list[DecisionView]:
        """A trial's recorded decisions, in order (none for an unknown trial)."""
        with self.session() as session:
            decided = decisions_of(session, trial_id)
        return [
            DecisionView(
                seq=d.seq, step=d.step, kind=d.kind, payload=json_object(d.payload_json), replayed=d.replayed
            )
            for d in decided
        ]

    def corpora(self, experiment_id: int) -> list[CorpusRecord]:
        """The corpora an experiment ingested, by id, as recorded (credentials as JSON text; none
        for an unknown experiment)."""
        with self.session() as session:
            return corpora_of(session, experiment_id)

    # -- the model registry ----------------------------------------------------------------------

    def models(self, window: Window) -> Page[ModelView]:
        with self.session() as session:
            total = _count(session, select(RegisteredModel))
            query = select(RegisteredModel).order_by(col(RegisteredModel.name))
            models = list(session.exec(_sliced(query, window)))
            names = [m.name for m in models]
            stats = session.exec(
                select(ModelVersion.model_name, func.count(), func.max(ModelVersion.version))
                .where(col(ModelVersion.model_name).in_(names))
                .group_by(col(ModelVersion.model_name))
            )
            versions = {name: (count, latest) for name, count, latest in stats}
        items = [
            ModelView(
                name=m.name,
                description=m.description,
                versions=versions.get(m.name, (0, None))[0],
                latest_version=versions.get(m.name, (0, None))[1],
                created_at=m.created_at,
            )
            for m in models
        ]
        return page(items, total, window)

    def versions(self, model_name: str, window: Window) -> Page[ModelVersionView]:
        with self.session() as session:
            if session.get(RegisteredModel, model_name) is None:
                raise NotFoundError(f"no registered model {model_name!r}")
            query = select(ModelVersion).where(ModelVersion.model_name == model_name)
            total = _count(session, query)
            rows = list(session.exec(_sliced(query.order_by(col(ModelVersion.version)), window)))
        return page([version_view(v) for v in rows], total, window)

    def version(self, model_name: str, version: int) -> ModelVersionView:
        with self.session() as session:
            return version_view(_find_version(session, model_name, version))

    def version_by_id(self, version_id: int) -> ModelVersionView:
        with self.session() as session:
            return version_view(_get(session, ModelVersion, version_id))

    def newest_versions(self, limit: int) -> list[VersionRef]:
        """The model versions registered last, newest first."""
        query = select(ModelVersion.model_name, ModelVersion.version).order_by(col(ModelVersion.id).desc())
        with self.session() as session:
            rows = session.exec(query.limit(limit)).all()
        return [VersionRef(model_name=name, version=version) for name, version in rows]

    # -- lineage ---------------------------------------------------------------------------------

    def checkpoint_lineage(self, checkpoint_id: int, layer: str | None = None) -> Lineage:
        """Per layer of a checkpoint, the corpora that directly reached it (only ``layer``, a name or
        an index, when given)."""
        with self.session() as session:
            checkpoint = _get(session, CheckpointRecord, checkpoint_id)
            return ledger_rows.lineage(session, checkpoint, self.layer_names, layer)

    def trial_lineage(self, trial_id: int, layer: str | None = None) -> Lineage:
        """The lineage of a trial's latest checkpoint: a running trial's so far, as of its step."""
        with self.session() as session:
            _get(session, TrialRecord, trial_id)
            checkpoint = ledger_rows.latest_checkpoint(session, trial_id)
            return ledger_rows.lineage(session, checkpoint, self.layer_names, layer)

    def version_lineage(self, model_name: str, version: int, layer: str | None = None) -> Lineage:
        """The lineage of a model version's files: its checkpoint's, without the adapters removed
        from it."""
        with self.session() as session:
            found = _find_version(session, model_name, version)
            checkpoint = _get(session, CheckpointRecord, found.checkpoint_id)
            return ledger_rows.lineage(
                session, checkpoint, self.layer_names, layer, version=version_view(found)
            )

    def influence(self, corpus_id: str, window: Window) -> Page[InfluenceItem]:
        """Every trial ledger (checkpoint), model version and layer that ``corpus_id`` reached."""
        with self.session() as session:
            return ledger_rows.influence(session, corpus_id, window, self.layer_names)

    # -- audit log and attestations --------------------------------------------------------------

    def audit_events(
        self,
        window: Window,
        experiment_id: int | None = None,
        event_type: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Page[AuditEventView]:
        """Audit events in chain order, filtered by experiment, type and ``since <= at < until``
        (a time without a zone is UTC)."""
        query = select(AuditEvent)
        if experiment_id is not None:
            query = query.where(AuditEvent.experiment_id == experiment_id)
        if event_type is not None:
            if event_type not in set(AuditEventType):
                known = ", ".join(member.value for member in AuditEventType)
                raise QueryError(f"unknown audit event type {event_type!r}; known: {known}")
            query = query.where(AuditEvent.event_type == event_type)
        if since is not None:
            query = query.where(col(AuditEvent.at) >= _timestamp(since, "since"))
        if until is not None:
            query = query.where(col(AuditEvent.at) < _timestamp(until, "until"))
        with self.session() as session:
            total = _count(session, query)
            rows = list(session.exec(_sliced(query.order_by(col(AuditEvent.seq)), window)))
        items = [
            AuditEventView(**e.model_dump(exclude={"payload_json"}), payload=json_object(e.payload_json))
            for e in rows
        ]
        return page(items, total, window)

    def attestations(self, checkpoint_id: int, window: Window) -> Page[AttestationView]:
        """The attestations stored about a checkpoint, oldest first."""
        with self.session() as session:
            _get(session, CheckpointRecord, checkpoint_id)
            query = select(AttestationRecord).where(AttestationRecord.checkpoint_id == checkpoint_id)
            total = _count(session, query)
            rows = list(session.exec(_sliced(query.order_by(col(AttestationRecord.id)), window)))
        return page([attestation_view(a) for a in rows], total, window)

    def attestation(self, attestation_id: int) -> AttestationRecord:
        """The stored attestation (its ``envelope_json`` is the DSSE envelope as signed)."""
        with self.session() as session:
            return _get(session, AttestationRecord, attestation_id)

    def provenance(
        self, *, model_version_id: int | None = None, checkpoint_id: int | None = None
    ) -> AttestationRecord | None:
        """The newest provenance attestation stored about a model version (when given), else about
        a checkpoint."""
        with self.session() as session:
            return ledger_rows.newest_attestation(
                session, PROVENANCE_TYPE, model_version_id=model_version_id, checkpoint_id=checkpoint_id
            )

    def checkpoint(self, checkpoint_id: int) -> CheckpointView:
        with self.session() as session:
            return checkpoint_view(_get(session, CheckpointRecord, checkpoint_id))

    def newest_final_checkpoints(self, limit: int) -> list[CheckpointView]:
        """Trials' last checkpoints (the ones their ledgers belong to), newest first, at most ``limit``."""
        with self.session() as session:
            return [checkpoint_view(c) for c in ledger_rows.newest_final_checkpoints(session, limit)]

    # -- what answers read ------------------------------------------------------------------------

    def stamps(self, topics: Iterable[Topic]) -> dict[Topic, Any]:
        """Per topic an answer read, a value that changes when it does (``govray.queries.changes``)."""
        with self.session() as session:
            return changes.stamps(session, topics)


def _get(session: Session, table: type[_Row], row_id: int) -> _Row:
    found = session.get(table, row_id)
    if found is None:
        raise NotFoundError(f"no {row_noun(table)} with id {row_id}")
    return found


def _find_version(session: Session, model_name: str, version: int) -> ModelVersion:
    query = select(ModelVersion).where(ModelVersion.model_name == model_name, ModelVersion.version == version)
    found = session.exec(query).first()
    if found is None:
        if session.get(RegisteredModel, model_name) is None:
            raise NotFoundError(f"no registered model {model_name!r}")
        raise NotFoundError(f"model {model_name!r} has no version {version}")
    return found


def _timestamp(moment: datetime, name: str) -> str:
    """``moment`` as the audit log writes times (a naive one is read as UTC, as the CLI does)."""
    try:
        return utc_timestamp(moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC))
    except OverflowError:
        raise QueryError(f"{name} {moment.isoformat()} is outside the times the audit log can hold") from None


def _sliced(query: Query, window: Window) -> Query:
    return query.offset(window.offset).limit(window.limit)


def _count(session: Session, query: Select[Any]) -> int:
    return int(session.exec(select(func.count()).select_from(query.subquery())).one())


def _trial_counts(session: Session, experiment_ids: list[int]) -> dict[int, int]:
    query = (
        select(TrialRecord.experiment_id, func.count())
        .where(col(TrialRecord.experiment_id).in_(experiment_ids))
        .group_by(col(TrialRecord.experiment_id))
    )
    return {experiment_id: count for experiment_id, count in session.exec(query)}
