"""Lineage and influence from the ledger rows, aggregated in SQL.

A ledger row is (trial, checkpoint, corpus, tensor, layer index, examples, tokens, steps). The
driver stores each checkpoint's ledger as it records the checkpoint (rows keyed by its id), so a
running trial answers as of its latest checkpoint. Rows with no checkpoint id are a trial's ledger
stored once at its end by a run that seals no checkpoints (it signs nothing): the ledger of its
last report. A checkpoint whose ledger could not be stored when it was recorded has no rows until
its verified ``state.json`` is loaded (``LedgerNotStored`` says so).

Rows are grouped per (corpus, layer) in the database — a base tensor by its layer index, an
adapter tensor (``adapter/NAME/...``) by its adapter — over the indexes on ``(trial_id,
parameter)`` and ``(corpus_id, parameter)``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import ColumnElement, func
from sqlmodel import Session, col, select

from govray.core.dsse import Envelope
from govray.core.errors import SignatureError
from govray.governance.routing import layer_label
from govray.provenance.statement_types import COVERAGE_TYPE
from govray.queries.errors import LedgerNotStored, NotFoundError
from govray.queries.sql_tensors import adapter_of, base_layer_of
from govray.queries.views import (
    CorpusCounts,
    InfluenceItem,
    LayerLineage,
    LayerReach,
    Lineage,
    ModelVersionView,
    Page,
    VersionRef,
    Window,
    page,
)
from govray.tracking.lineage import as_of
from govray.tracking.tables import (
    LIVE_TRIAL_STATES,
    AttestationRecord,
    CheckpointRecord,
    CheckpointStatus,
    LedgerRow,
    ModelVersion,
    TrialRecord,
)

NAME_CACHE_SIZE = 256


@dataclass(frozen=True)
class _Group:
    """One aggregated (corpus, layer) group of ledger rows."""

    corpus_id: str
    index: int | None
    adapter: str | None
    examples: int
    tokens: int
    steps: int
    tensors: int
    sample_tensor: str  # one tensor of the group, to look its layer's name up


def _group_columns() -> tuple[Any, ...]:
    """Group keys: the corpus, a base tensor's layer index, an adapter tensor's adapter."""
    tensor, layer = col(LedgerRow.parameter), col(LedgerRow.layer_index)
    return (col(LedgerRow.corpus_id), base_layer_of(tensor, layer), adapter_of(tensor))


def _aggregates() -> tuple[ColumnElement[Any], ...]:
    return (
        func.max(LedgerRow.examples),
        func.max(LedgerRow.tokens),
        func.max(LedgerRow.steps),
        func.count(),
        func.min(LedgerRow.parameter),
    )


class LayerNames:
    """Layer names by tensor, read from the signed coverage attestation of a checkpoint (the store
    keeps only layer indexes), or of another checkpoint of its trial (one model, one naming) when
    it has none of its own. Envelopes never change, so each is parsed once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the app answers from several threads
        self._by_checkpoint: OrderedDict[int, dict[str, str]] = OrderedDict()

    def of(self, session: Session, checkpoint_id: int | None) -> dict[str, str]:
        if checkpoint_id is None:
            return {}
        with self._lock:
            if (known := self._by_checkpoint.get(checkpoint_id)) is not None:
                self._by_checkpoint.move_to_end(checkpoint_id)
                return known
        names = self._read(session, checkpoint_id)
        if names is None:
            attested = self._attested_sibling(session, checkpoint_id)
            # not attested (yet), nor any checkpoint of its trial: layers are named by index
            return self.of(session, attested) if attested is not None else {}
        with self._lock:
            self._by_checkpoint[checkpoint_id] = names
            if len(self._by_checkpoint) > NAME_CACHE_SIZE:
                self._by_checkpoint.popitem(last=False)
        return names

    @staticmethod
    def _attested_sibling(session: Session, checkpoint_id: int) -> int | None:
        """The newest checkpoint of the same trial with an attestation stored about it."""
        trial = select(CheckpointRecord.trial_id).where(CheckpointRecord.id == checkpoint_id)
        siblings = select(CheckpointRecord.id).where(col(CheckpointRecord.trial_id).in_(trial))
        query = (
            select(AttestationRecord.checkpoint_id)
            .where(col(AttestationRecord.checkpoint_id).in_(siblings))
            .order_by(col(AttestationRecord.id).desc())
            .limit(1)
        )
        found = session.exec(query).first()
        return found if found != checkpoint_id else None

    @staticmethod
    def _read(session: Session, checkpoint_id: int) -> dict[str, str] | None:
        coverage = newest_attestation(session, COVERAGE_TYPE, checkpoint_id=checkpoint_id)
        if coverage is None:
            return None
        entries = statement_of(coverage.envelope_json).get("predicate", {}).get("ledger", [])
        return {e["tensor"]: e["layer"] for e in entries if isinstance(e, dict) and "layer" in e}


def newest_attestation(
    session: Session,
    predicate_type: str,
    *,
    model_version_id: int | None = None,
    checkpoint_id: int | None = None,
) -> AttestationRecord | None:
    """The newest attestation of ``predicate_type`` stored about a model version (when given),
    else about a checkpoint."""
    if model_version_id is not None:
        about = AttestationRecord.model_version_id == model_version_id
    else:
        about = AttestationRecord.checkpoint_id == checkpoint_id
    query = select(AttestationRecord).where(about).order_by(col(AttestationRecord.id).desc())
    for record in session.exec(query):
        if statement_of(record.envelope_json).get("predicateType") == predicate_type:
            return record
    return None


def _layer_name(group: _Group, names: dict[str, str]) -> str:
    layer = None if group.index is None else names.get(group.sample_tensor, f"layer {group.index}")
    return layer_label(layer, group.adapter)


def _layer_order(group: _Group) -> tuple[int, int, str]:
    # layers in model order, then what lies outside them, then adapters by name
    if group.adapter is not None:
        return (2, 0, group.adapter)
    return (0, group.index, "") if group.index is not None else (1, 0, "")


def _groups(rows: Iterable[Sequence[Any]]) -> list[_Group]:
    return [_Group(*row) for row in rows]


def final_checkpoints(session: Session, trial_ids: Iterable[int]) -> dict[int, CheckpointRecord]:
    """Each trial's last checkpoint (highest step, then newest) — the one its ledger belongs to."""
    query = select(CheckpointRecord).where(col(CheckpointRecord.trial_id).in_(list(trial_ids)))
    last: dict[int, CheckpointRecord] = {}
    for checkpoint in session.exec(query.order_by(col(CheckpointRecord.step), col(CheckpointRecord.id))):
        last[checkpoint.trial_id] = checkpoint
    return last


def newest_final_checkpoints(session: Session, limit: int) -> list[CheckpointRecord]:
    """``final_checkpoints`` of the trials that saved one last, newest first, at most ``limit``."""
    last = (
        select(CheckpointRecord.trial_id, func.max(CheckpointRecord.step).label("step"))
        .group_by(col(CheckpointRecord.trial_id))
        .subquery()
    )
    at_last = (last.c.trial_id == CheckpointRecord.trial_id) & (last.c.step == CheckpointRecord.step)
    query = select(CheckpointRecord).join(last, at_last).order_by(col(CheckpointRecord.id).desc())
    final: dict[int, CheckpointRecord] = {}
    for checkpoint in session.exec(query.limit(2 * limit)):  # a step saved twice: its newer row
        final.setdefault(checkpoint.trial_id, checkpoint)
    return list(final.values())[:limit]


def lineage(
    session: Session,
    checkpoint: CheckpointRecord,
    layer_names: LayerNames,
    layer: str | None,
    *,
    version: ModelVersionView | None = None,
) -> Lineage:
    """Per layer of ``checkpoint`` (or of a model version made from it, which lacks the adapters
    removed from it), the corpora that directly reached it."""
    assert checkpoint.id is not None
    trial = session.get(TrialRecord, checkpoint.trial_id)
    assert trial is not None and trial.id is not None
    own = col(LedgerRow.checkpoint_id) == checkpoint.id
    source: Literal["checkpoint", "trial"] = "checkpoint"
    if session.exec(select(LedgerRow.id).where(LedgerRow.trial_id == trial.id, own).limit(1)).first() is None:
        own, source = col(LedgerRow.checkpoint_id).is_(None), "trial"
        final = final_checkpoints(session, [trial.id])[trial.id]
        recorded = select(LedgerRow.id).where(LedgerRow.trial_id == trial.id, own).limit(1)
        if final.id != checkpoint.id or session.exec(recorded).first() is None:
            raise _not_stored(checkpoint)
    columns = _group_columns()
    query = select(*columns, *_aggregates()).where(LedgerRow.trial_id == trial.id, own).group_by(*columns)
    removed = version.removed_adapters if version is not None else []
    groups = [g for g in _groups(session.exec(query)) if g.adapter is None or g.adapter not in removed]
    names = layer_names.of(session, checkpoint.id)
    layers: dict[str, LayerLineage] = {}
    for group in sorted(groups, key=lambda g: (_layer_order(g), g.corpus_id)):
        name = _layer_name(group, names)
        entry = layers.setdefault(name, LayerLineage(layer=name, index=group.index, corpora=[]))
        entry.corpora.append(
            CorpusCounts(
                corpus_id=group.corpus_id,
                examples=group.examples,
                tokens=group.tokens,
                steps=group.steps,
                tensors=group.tensors,
            )
        )
    selected = list(layers.values())
    if layer is not None:
        selected = [entry for entry in selected if layer in (entry.layer, str(entry.index))]
        if not selected:
            known = ", ".join(layers) or "none"
            raise NotFoundError(
                f"checkpoint {checkpoint.id} has no layer {layer!r} in its lineage (layers: {known})"
            )
    return Lineage(
        checkpoint_id=checkpoint.id,
        trial_id=trial.id,
        experiment_id=trial.experiment_id,
        step=checkpoint.step,
        trial_state=trial.state,
        running=trial.state in LIVE_TRIAL_STATES,
        as_of=as_of(checkpoint.step, trial.state),
        ledger=source,
        model=VersionRef(model_name=version.model_name, version=version.version) if version else None,
        layers=selected,
    )


def _not_stored(checkpoint: CheckpointRecord) -> NotFoundError:
    where = f"checkpoint {checkpoint.id} (step {checkpoint.step} of trial {checkpoint.trial_id})"
    if checkpoint.state == CheckpointStatus.DELETED.value:
        return NotFoundError(
            f"{where} was deleted by GC, and its ledger with it (no version or attestation cites it)"
        )
    return LedgerNotStored(
        f"{where} has no ledger in the tracking store: it could not be stored when the checkpoint "
        f"was recorded; POST /api/checkpoints/{checkpoint.id}/ledger (with the write token) stores it from "
        "its verified state.json, or says why it cannot",
        checkpoint_id=checkpoint.id or 0,
    )


def latest_checkpoint(session: Session, trial_id: int) -> CheckpointRecord:
    """A trial's latest recorded checkpoint (what its lineage is as of)."""
    final = final_checkpoints(session, [trial_id]).get(trial_id)
    if final is None:
        raise NotFoundError(f"trial {trial_id} has recorded no checkpoint yet: it has no lineage so far")
    return final


def influence(
    session: Session, corpus_id: str, window: Window, layer_names: LayerNames
) -> Page[InfluenceItem]:
    """Every trial ledger ``corpus_id`` reached (by trial, then checkpoint), with the layers it
    reached there and the model versions made from that checkpoint that still hold them."""
    reached = (
        select(LedgerRow.trial_id, LedgerRow.checkpoint_id).where(LedgerRow.corpus_id == corpus_id).distinct()
    )
    total = int(session.exec(select(func.count()).select_from(reached.subquery())).one())
    if total == 0:
        raise NotFoundError(f"corpus {corpus_id!r} reached no tensor of any trial in the tracking store")
    # A trial's own ledger (no checkpoint) first, on every database (their NULL orders differ).
    order = (col(LedgerRow.trial_id), col(LedgerRow.checkpoint_id).nulls_first())
    pairs = list(session.exec(reached.order_by(*order).offset(window.offset).limit(window.limit)))
    if not pairs:
        return page([], total, window)
    trial_ids = sorted({trial_id for trial_id, _ in pairs})
    columns = (col(LedgerRow.trial_id), col(LedgerRow.checkpoint_id), *_group_columns())
    query = (
        select(*columns, *_aggregates())
        .where(LedgerRow.corpus_id == corpus_id, col(LedgerRow.trial_id).in_(trial_ids))
        .group_by(*columns)
    )
    by_pair: dict[tuple[int, int | None], list[_Group]] = {pair: [] for pair in pairs}
    for trial_id, checkpoint_id, *group in session.exec(query):
        if (trial_id, checkpoint_id) in by_pair:  # (a NULL checkpoint id cannot be matched in SQL)
            by_pair[trial_id, checkpoint_id].append(_Group(*group))
    trials = select(TrialRecord.id, TrialRecord.experiment_id, TrialRecord.state)
    found = {
        trial_id: (experiment, state)
        for trial_id, experiment, state in session.exec(trials.where(col(TrialRecord.id).in_(trial_ids)))
    }
    finals = final_checkpoints(session, trial_ids)
    resolved = {pair: pair[1] if pair[1] is not None else _id(finals.get(pair[0])) for pair in pairs}
    checkpoint_ids = [c for c in resolved.values() if c is not None]
    saved = select(CheckpointRecord.id, CheckpointRecord.step).where(
        col(CheckpointRecord.id).in_(checkpoint_ids)
    )
    steps = dict(session.exec(saved).all())
    made = select(ModelVersion).where(col(ModelVersion.checkpoint_id).in_(checkpoint_ids))
    versions = list(session.exec(made))
    items = []
    for pair in pairs:
        checkpoint_id = resolved[pair]
        names = layer_names.of(session, checkpoint_id)
        groups = sorted(by_pair[pair], key=_layer_order)
        items.append(
            InfluenceItem(
                trial_id=pair[0],
                experiment_id=found[pair[0]][0],
                checkpoint_id=checkpoint_id,
                step=steps.get(checkpoint_id) if checkpoint_id is not None else None,
                trial_state=found[pair[0]][1],
                running=found[pair[0]][1] in LIVE_TRIAL_STATES,
                model_versions=[
                    VersionRef(model_name=v.model_name, version=v.version)
                    for v in versions
                    if v.checkpoint_id == checkpoint_id and _holds_any(v, groups)
                ],
                layers=[
                    LayerReach(
                        layer=_layer_name(g, names),
                        index=g.index,
                        examples=g.examples,
                        tokens=g.tokens,
                        steps=g.steps,
                        tensors=g.tensors,
                    )
                    for g in groups
                ],
            )
        )
    return page(items, total, window)


def _id(checkpoint: CheckpointRecord | None) -> int | None:
    return checkpoint.id if checkpoint is not None else None


def _holds_any(version: ModelVersion, groups: list[_Group]) -> bool:
    """Whether the version still carries a layer the corpus reached (not only removed adapters)."""
    removed = set(json.loads(version.removed_adapters_json))
    return any(group.adapter is None or group.adapter not in removed for group in groups)


def statement_of(envelope_json: str) -> dict[str, Any]:
    """The in-toto statement inside a stored envelope, NOT verified (``{}`` when unreadable): for
    naming and sorting only; trust what ``govray.provenance.attest.verify_attestation`` returns."""
    try:
        statement = json.loads(Envelope.model_validate_json(envelope_json).payload_bytes())
    except (ValueError, SignatureError):
        return {}
    return statement if isinstance(statement, dict) else {}
