"""One experiment as the tracking store knows it, as a document: ``govray experiment describe``.

It is read through the query layer (``govray.queries.StoreReader``) that answers the lineage app's
HTTP endpoints, so a trial, checkpoint or metric reads the same on the command line and over HTTP.
The same ``ExperimentDescription`` is printed as tables or, with ``--json``, as JSON::

    description = describe_experiment(store, "digits-governed")   # id or name, newest of a name
    description.trials[0].validation["validation_loss"].value     # its latest report
    description.model_dump_json(indent=2)
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from govray.platform.gc import GcPolicy, effective_gc_policy
from govray.queries import MAX_LIMIT, StoreReader, Window
from govray.queries.views import DecisionView, MetricView, TrialDetail, TrialView
from govray.tracking.store import TrackingStore
from govray.tracking.tables import MetricKind

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
    decisions: list[DecisionView]  # in order (a ``preempted`` one: a node's notice, sealed)
    # [(from_step, workers), ...]: the world sizes it trained on; more than one entry: resized
    # (an elastic run, or a resume on another world size). Empty: not recorded.
    world_history: list[tuple[int, int]] = []

    @property
    def resizes(self) -> int:
        return max(len(self.world_history) - 1, 0)


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


def describe_experiment(store: TrackingStore, experiment: int | str) -> ExperimentDescription:
    """Everything the store records about an experiment (by id or name), trials oldest first."""
    found = store.get_experiment(experiment)  # an id or the newest of a name, as every command reads it
    assert found.id is not None  # read from the store
    reader = StoreReader(store.engine)
    shown = reader.experiment(found.id)
    parent = reader.experiment(shown.parent_id) if shown.parent_id is not None else None
    trials = [reader.trial(trial.id) for trial in _trials(reader, found.id)]
    latest = reader.latest_metrics([trial.id for trial in trials])
    return ExperimentDescription(
        id=shown.id,
        name=shown.name,
        state=shown.state,
        requested=found.requested,  # the driver's business, not in the lineage app's view
        parent_id=shown.parent_id,
        parent_name=parent.name if parent is not None else None,
        created_at=shown.created_at,
        updated_at=shown.updated_at,
        config_digest=shown.config_digest,
        policy_digest=shown.policy_digest,
        gc_policy=effective_gc_policy(store, found.id),
        gc_policy_overridden=found.gc_policy_json is not None,
        corpora=[
            CorpusDescription.model_validate(corpus, from_attributes=True)
            for corpus in reader.corpora(found.id)
        ],
        trials=[
            _describe_trial(reader, trial, latest.get(trial.id, []), store.get_trial(trial.id).world_history)
            for trial in trials
        ],
    )


def _trials(reader: StoreReader, experiment_id: int) -> list[TrialView]:
    """Every trial of the experiment, oldest first, page by page."""
    trials: list[TrialView] = []
    while True:
        listed = reader.trials(experiment_id, Window(offset=len(trials), limit=MAX_LIMIT))
        trials.extend(listed.items)
        if not listed.items or len(trials) >= listed.total:
            return trials


def _describe_trial(
    reader: StoreReader, trial: TrialDetail, reported: list[MetricView], world_history: list[tuple[int, int]]
) -> TrialDescription:
    latest = {(m.kind, m.name): LatestMetric(step=m.step, value=m.value) for m in reported}
    return TrialDescription(
        id=trial.id,
        state=trial.state,
        ray_run_name=trial.ray_run_name,
        seed=trial.seed,
        kind=trial.kind,
        replay_of=trial.replay_of,
        cloned_from=trial.cloned_from,
        source_checkpoint=trial.source_checkpoint,
        last_step=max((metric.step for metric in latest.values()), default=None),
        training_loss=latest.get((MetricKind.TRAINING.value, "training_loss")),
        validation={
            name: metric for (kind, name), metric in sorted(latest.items()) if kind == MetricKind.VALIDATION
        },
        checkpoints=[
            CheckpointDescription.model_validate(checkpoint, from_attributes=True)
            for checkpoint in trial.checkpoints
        ],
        decisions=reader.decisions(trial.id),
        world_history=world_history,
    )
