"""What an answer read, and whether that has changed since: a cache keeps an answer across commits
that touched none of it.

An answer names what it read as ``Topic``s; ``stamps`` reads a small value per topic that changes
whenever what the topic covers changes (counts and largest ids of append-mostly rows, and the
states that answers show):

- ``trial N``: the trial's state, its checkpoints (recorded, deleted by GC) and its ledger rows —
  not its metrics, so a report that only records metrics leaves its lineage cached;
- ``checkpoint N``: the attestations stored about it (they name its layers);
- ``corpus C``: its ledger rows in every trial (a new row, or any checkpoint deleted by GC) and its
  ingests;
- ``experiment N``: its trials and their states;
- ``versions``: every model version (registering one changes which versions an answer lists);
- ``anything``: an answer whose reads are not tracked: any commit makes it stale.

A finished trial's rows never change, and neither does a registered version's lineage, so their
answers stay cached while other trials train::

    reads = lineage_reads(answer)                 # {trial 3, checkpoint 12}
    before = stamps(session, reads)
    ... later, after commits ...
    stamps(session, reads) == before              # True: the cached answer still holds
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import case, func
from sqlmodel import Session, col, select

from govray.queries.views import InfluenceItem, Lineage, Page
from govray.tracking.tables import (
    AttestationRecord,
    CheckpointRecord,
    CheckpointStatus,
    CorpusRecord,
    LedgerRow,
    ModelVersion,
    TrialRecord,
)

if TYPE_CHECKING:  # a row's reach is computed elsewhere (it reads the schedule: pyarrow, torch)
    from govray.provenance.row_reach import RowReach


class Topic(NamedTuple):
    """Something an answer read: ``(kind, key)``, e.g. ``("trial", 3)``."""

    kind: str
    key: int | str = ""


ANYTHING = Topic("anything")
VERSIONS = Topic("versions")
UNTRACKED = frozenset({ANYTHING})


def trial(trial_id: int) -> Topic:
    return Topic("trial", trial_id)


def checkpoint(checkpoint_id: int) -> Topic:
    return Topic("checkpoint", checkpoint_id)


def corpus(corpus_id: str) -> Topic:
    return Topic("corpus", corpus_id)


def experiment(experiment_id: int) -> Topic:
    return Topic("experiment", experiment_id)


def lineage_reads(answer: Lineage) -> frozenset[Topic]:
    """A checkpoint's, trial's or version's lineage: its trial and checkpoint (a version's row,
    adapters removed included, never changes)."""
    return frozenset({trial(answer.trial_id), checkpoint(answer.checkpoint_id)})


def influence_reads(corpus_id: str, answer: Page[InfluenceItem]) -> frozenset[Topic]:
    """A corpus's influence page: its ledger rows, the trials and checkpoints listed, the registry."""
    reads = {corpus(corpus_id), VERSIONS}
    reads |= {trial(item.trial_id) for item in answer.items}
    reads |= {checkpoint(item.checkpoint_id) for item in answer.items if item.checkpoint_id is not None}
    return frozenset(reads)


def row_reads(answer: RowReach) -> frozenset[Topic]:
    """A row lookup: the corpus's ingests, the experiments that ingested it and their trials
    (whose latest checkpoint the answer is as of), the registry."""
    reads = {corpus(answer.corpus_id), VERSIONS}
    reads |= {experiment(item.experiment_id) for item in answer.trials}
    reads |= {trial(item.trial_id) for item in answer.trials}
    return frozenset(reads)


def stamps(session: Session, topics: Iterable[Topic]) -> dict[Topic, Any]:
    """Per topic, a value that changes when what it covers changes (``anything``: never equal)."""
    by_kind: dict[str, set[Any]] = {}
    for topic in topics:
        by_kind.setdefault(topic.kind, set()).add(topic.key)
    found: dict[Topic, Any] = {}
    for kind, keys in by_kind.items():
        if kind == ANYTHING.kind:
            found[ANYTHING] = object()  # equal to nothing but itself
        elif kind == VERSIONS.kind:
            found[VERSIONS] = tuple(session.exec(select(func.count(), func.max(ModelVersion.id))).one())
        else:
            values = _STAMPERS[kind](session, sorted(keys))
            found.update({Topic(kind, key): values.get(key) for key in keys})
    return found


def _trials(session: Session, ids: list[int]) -> dict[int, Any]:
    # The newest ledger row of each trial: one seek per trial on the (trial, id) index, in one query.
    newest = select(func.max(LedgerRow.id)).where(LedgerRow.trial_id == TrialRecord.id).scalar_subquery()
    states = {
        trial_id: (state, row)
        for trial_id, state, row in session.exec(
            select(TrialRecord.id, TrialRecord.state, newest).where(col(TrialRecord.id).in_(ids))
        )
    }
    deleted = case((col(CheckpointRecord.state) == CheckpointStatus.DELETED.value, 1), else_=0)
    saved = _grouped(
        session,
        select(CheckpointRecord.trial_id, func.count(), func.max(CheckpointRecord.id), func.sum(deleted))
        .where(col(CheckpointRecord.trial_id).in_(ids))
        .group_by(col(CheckpointRecord.trial_id)),
    )
    return {key: (states.get(key), saved.get(key)) for key in ids}


def _checkpoints(session: Session, ids: list[int]) -> dict[int, Any]:
    return _grouped(
        session,
        select(AttestationRecord.checkpoint_id, func.count(), func.max(AttestationRecord.id))
        .where(col(AttestationRecord.checkpoint_id).in_(ids))
        .group_by(col(AttestationRecord.checkpoint_id)),
    )


def _corpora(session: Session, ids: list[str]) -> dict[str, Any]:
    # The newest ledger row of each corpus: one seek each on the (corpus, id) index (counting a
    # corpus's rows would read them all after every commit).
    named = select(CorpusRecord.corpus_id).where(col(CorpusRecord.corpus_id).in_(ids)).distinct().subquery()
    newest = select(func.max(LedgerRow.id)).where(LedgerRow.corpus_id == named.c.corpus_id).scalar_subquery()
    rows = dict(session.exec(select(named.c.corpus_id, newest)).all())
    # GC drops a deleted checkpoint's rows; an answer about a corpus may have counted them.
    deleted = session.exec(
        select(func.count()).where(col(CheckpointRecord.state) == CheckpointStatus.DELETED.value)
    ).one()
    ingests = _grouped(
        session,
        select(CorpusRecord.corpus_id, func.count(), func.max(CorpusRecord.id))
        .where(col(CorpusRecord.corpus_id).in_(ids))
        .group_by(col(CorpusRecord.corpus_id)),
    )
    return {key: (rows.get(key), deleted, ingests.get(key)) for key in ids}


def _experiments(session: Session, ids: list[int]) -> dict[int, Any]:
    trials: dict[int, list[tuple[int | None, str]]] = {}
    query = select(TrialRecord.experiment_id, TrialRecord.id, TrialRecord.state)
    for experiment_id, trial_id, state in session.exec(
        query.where(col(TrialRecord.experiment_id).in_(ids)).order_by(col(TrialRecord.id))
    ):
        trials.setdefault(experiment_id, []).append((trial_id, state))
    return {key: tuple(trials.get(key, ())) for key in ids}


def _grouped(session: Session, query: Any) -> dict[Any, tuple[Any, ...]]:
    return {key: tuple(rest) for key, *rest in session.exec(query)}


_STAMPERS: dict[str, Callable[[Session, list[Any]], dict[Any, Any]]] = {
    "trial": _trials,
    "checkpoint": _checkpoints,
    "corpus": _corpora,
    "experiment": _experiments,
}
