"""One experiment as the tracking store knows it, as a document: ``govray experiment describe``.

The same ``ExperimentDescription`` is printed as tables or, with ``--json``, as JSON::

    description = describe_experiment(store, "digits-governed")   # id or name, newest of a name
    description.trials[0].validation["validation_loss"].value     # its latest report
    description.model_dump_json(indent=2)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict
from sqlalchemy import and_, func
from sqlmodel import col, select

from govray.gc import GcPolicy, effective_gc_policy
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Metric, MetricKind, Trial

_FROZEN = ConfigDict(frozen=True)


class CorpusDescription(BaseModel):
    model_config = _FROZEN

    corpus_id: str
    role: str
    rows: int
    fingerprint: str


class LatestMetric(BaseModel):
    """A metric's value at the latest step it was reported (the last report of that step)."""

    model_config = _FROZEN

    step: int
    value: float


class CheckpointDescription(BaseModel):
    model_config = _FROZEN

    id: int
    step: int
    state: str  # active or deleted (by GC; the row stays)
    path: str


class DecisionDescription(BaseModel):
    model_config = _FROZEN

    seq: int
    step: int
    kind: str
    payload: dict[str, Any]
    replayed: bool  # applied from the source trial's record rather than computed


class TrialDescription(BaseModel):
    model_config = _FROZEN

    id: int
    state: str
    ray_run_name: str | None
    seed: int
    kind: str  # original, or replay (a counterfactual rerun of trial replay_of)
    replay_of: int | None
    cloned_from: int | None
    source_checkpoint: Any  # the checkpoint it started from, as recorded; None: from scratch
    last_step: int | None  # the highest step of any metric it reported
    training_loss: LatestMetric | None
    validation: dict[str, LatestMetric]
    checkpoints: list[CheckpointDescription]  # by step
    decisions: list[DecisionDescription]  # in order


class ExperimentDescription(BaseModel):
    model_config = _FROZEN

    id: int
    name: str
    state: str
    requested: str | None  # a pause or kill its driver has not acted on yet
    parent_id: int | None
    parent_name: str | None
    created_at: datetime
    updated_at: datetime
    config_digest: str
    policy_digest: str | None
    gc_policy: GcPolicy  # what GC applies now
    gc_policy_overridden: bool  # set after creation, not the config's checkpoint section
    corpora: list[CorpusDescription]
    trials: list[TrialDescription]


# trial id -> (kind, name) -> its latest report
LatestByTrial = dict[int, dict[tuple[str, str], LatestMetric]]


def describe_experiment(store: TrackingStore, experiment: int | str) -> ExperimentDescription:
    """Everything the store records about an experiment (by id or name), trials oldest first."""
    found = store.get_experiment(experiment)
    assert found.id is not None  # read from the store
    parent = store.get_experiment(found.parent_id) if found.parent_id is not None else None
    trials = store.list_trials(found.id)
    latest = _latest_metrics(store, trials)
    return ExperimentDescription(
        id=found.id,
        name=found.name,
        state=found.state,
        requested=found.requested,
        parent_id=found.parent_id,
        parent_name=parent.name if parent is not None else None,
        created_at=found.created_at,
        updated_at=found.updated_at,
        config_digest=found.config_digest,
        policy_digest=found.policy_digest,
        gc_policy=effective_gc_policy(store, found.id),
        gc_policy_overridden=found.gc_policy_json is not None,
        corpora=[
            CorpusDescription.model_validate(corpus, from_attributes=True)
            for corpus in store.list_corpora(found.id)
        ],
        trials=[_describe_trial(store, trial, latest) for trial in trials],
    )


def _describe_trial(store: TrackingStore, trial: Trial, latest: LatestByTrial) -> TrialDescription:
    assert trial.id is not None  # read from the store
    mine = latest.get(trial.id, {})
    source = trial.source_checkpoint_json
    return TrialDescription(
        id=trial.id,
        state=trial.state,
        ray_run_name=trial.ray_run_name,
        seed=trial.seed,
        kind=trial.kind,
        replay_of=trial.replay_of,
        cloned_from=trial.cloned_from,
        source_checkpoint=json.loads(source) if source is not None else None,
        last_step=max((metric.step for metric in mine.values()), default=None),
        training_loss=mine.get((MetricKind.TRAINING.value, "training_loss")),
        validation={
            name: metric for (kind, name), metric in sorted(mine.items()) if kind == MetricKind.VALIDATION
        },
        checkpoints=[
            CheckpointDescription.model_validate(record, from_attributes=True)
            for record in checkpoints(store, trial.id)
        ],
        decisions=[
            DecisionDescription(
                seq=decision.seq,
                step=decision.step,
                kind=decision.kind,
                payload=json.loads(decision.payload_json),
                replayed=decision.replayed,
            )
            for decision in store.decisions(trial.id)
        ],
    )


def _latest_metrics(store: TrackingStore, trials: Sequence[Trial]) -> LatestByTrial:
    """Per trial, per (kind, name): the value at the highest step reported (one query)."""
    trial_ids = [trial.id for trial in trials]
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
    with store.session() as session:
        rows = session.exec(select(Metric).join(last_step, at_last_step).order_by(col(Metric.id))).all()
    latest: LatestByTrial = {}
    for row in rows:  # by id: a step reported twice counts its last report
        latest.setdefault(row.trial_id, {})[(row.kind, row.name)] = LatestMetric(
            step=row.step, value=row.value
        )
    return latest
