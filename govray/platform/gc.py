"""Checkpoint garbage collection: keep what the policy and governance need, delete the rest.

Determined's semantics: a checkpoint is kept when it is among the experiment's N best, its
trial's N best or its trial's N latest (the union of the three). Whatever the policy says, GC
never deletes the latest checkpoint of a live trial (it resumes from it; it also carries the
clean state a memorization rollback returns to), a checkpoint a registered model version points
at, or one the caller protects. Deleting removes the directory (and the run's frozen base file
once no checkpoint left refers to it) and marks the row ``deleted``; the row, its attestations
and one ``gc.deleted`` audit event remain as the record::

    policy = GcPolicy.from_config(config.checkpoint)
    plan = apply_gc(store, experiment_id, policy, metric="validation_loss",
                    smaller_is_better=True, protected=[checkpoint_id])
    plan.reasons[7]  # -> ["trial 3 best", "trial 3 latest"]

A checkpoint's metric is its trial's ``validation`` metric of that name at the checkpoint's
step; a checkpoint without one can only be kept as a latest or by protection.

An experiment's policy is its config's ``checkpoint:`` section until someone overrides it;
``set_gc_policy`` records the override, audits the change and applies it at once::

    set_gc_policy(store, experiment_id, GcPolicy(save_trial_best=3))  # -> the plan it carried out
    effective_gc_policy(store, experiment_id)                         # -> GcPolicy(save_trial_best=3)
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govray.config.experiment import CheckpointConfig, ExperimentConfig
from govray.core.errors import GovrayError, TrackingError, describe_validation_error
from govray.core.storage import Storage, open_storage
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import active_checkpoints, mark_deleted
from govray.tracking.store import TrackingStore
from govray.tracking.tables import LIVE_TRIAL_STATES, CheckpointRecord, Experiment


class GcPolicy(BaseModel):
    """How many checkpoints GC keeps (Determined's ``checkpoint_storage`` fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    save_experiment_best: int = Field(default=0, ge=0)  # best N of the whole experiment
    save_trial_best: int = Field(default=1, ge=0)  # best N of each trial
    save_trial_latest: int = Field(default=1, ge=0)  # latest N of each trial, by step

    @classmethod
    def from_config(cls, checkpoint: CheckpointConfig) -> GcPolicy:
        """The policy an experiment's ``checkpoint:`` section asks for."""
        return cls(
            save_experiment_best=checkpoint.save_experiment_best,
            save_trial_best=checkpoint.save_trial_best,
            save_trial_latest=checkpoint.save_trial_latest,
        )


@dataclass(frozen=True)
class GcPlan:
    """What GC keeps (with why, by checkpoint id) and what it deletes (by trial, then step)."""

    keep: frozenset[int]
    delete: tuple[CheckpointRecord, ...]
    reasons: dict[int, list[str]]


@dataclass(frozen=True)
class _Inventory:
    """One experiment's active checkpoints and the facts GC decides them by."""

    checkpoints: tuple[CheckpointRecord, ...]  # by trial, step, id
    live_trials: frozenset[int]
    values: dict[int, float]  # checkpoint id -> metric at its step (absent: none reported)
    registered: dict[int, list[str]]  # checkpoint id -> ["model:version", ...]


def plan_gc(
    store: TrackingStore,
    experiment_id: int,
    policy: GcPolicy,
    *,
    metric: str,
    smaller_is_better: bool,
    protected: Iterable[int] = (),
) -> GcPlan:
    """Decide which active checkpoints of an experiment to keep and which to delete.

    Ties on the metric go to the later step, then the higher id, so the plan is deterministic.
    ``protected`` ids outside the experiment's active checkpoints are ignored.
    """
    inventory = _inventory(store, experiment_id, metric)
    reasons: defaultdict[int, list[str]] = defaultdict(list)

    def keep(records: Iterable[CheckpointRecord], reason: str) -> None:
        for record in records:
            reasons[_checkpoint_id(record)].append(reason)

    experiment_best = _best_first(inventory.checkpoints, inventory.values, smaller_is_better)
    keep(experiment_best[: policy.save_experiment_best], "experiment best")
    for trial_id, records in _by_trial(inventory.checkpoints).items():
        best = _best_first(records, inventory.values, smaller_is_better)
        keep(best[: policy.save_trial_best], f"trial {trial_id} best")
        latest = _latest_first(records)
        keep(latest[: policy.save_trial_latest], f"trial {trial_id} latest")
        if trial_id in inventory.live_trials:
            keep(latest[:1], "live trial latest")
    for checkpoint_id, versions in inventory.registered.items():
        reasons[checkpoint_id].extend(f"registered model {version}" for version in versions)
    active = {_checkpoint_id(record) for record in inventory.checkpoints}
    for checkpoint_id in sorted(set(protected) & active):
        reasons[checkpoint_id].append("protected")

    doomed = tuple(record for record in inventory.checkpoints if _checkpoint_id(record) not in reasons)
    return GcPlan(keep=frozenset(reasons), delete=doomed, reasons=dict(reasons))


def apply_gc(
    store: TrackingStore,
    experiment_id: int,
    policy: GcPolicy,
    *,
    metric: str,
    smaller_is_better: bool,
    protected: Iterable[int] = (),
    dry_run: bool = False,
    storage: Storage | None = None,
) -> GcPlan:
    """Plan GC (see ``plan_gc``) and carry it out, unless ``dry_run``; return the plan. A driver
    that holds the experiment's ``storage`` passes it (else it is opened from the experiment row).

    Each deletion removes the directory, appends one ``gc.deleted`` audit event, then marks the
    row deleted. A failure part-way leaves that checkpoint active, so running GC again finishes
    the job (an already missing directory is fine); applying twice deletes nothing the second time.
    """
    plan = plan_gc(
        store, experiment_id, policy, metric=metric, smaller_is_better=smaller_is_better, protected=protected
    )
    if dry_run:
        return plan
    log = AuditLog(store)
    if storage is None:
        storage = open_storage(store.get_experiment(experiment_id).storage_path)
    for record in plan.delete:
        checkpoint_id = _checkpoint_id(record)
        try:
            remove_checkpoint_directory(storage, record.path)
        except OSError as exc:
            raise GovrayError(
                f"GC cannot delete checkpoint {checkpoint_id} (trial {record.trial_id}, step "
                f"{record.step}) at {record.path}: {exc}; it stays active"
            ) from exc
        # Audit before marking: a crash in between re-deletes (and re-audits) next time rather
        # than leaving a deletion nobody recorded.
        log.append(AuditEventType.GC_DELETED, _deletion_payload(record, policy), experiment_id=experiment_id)
        _mark_deleted(store, checkpoint_id)
    return plan


def effective_gc_policy(store: TrackingStore, experiment: int | str) -> GcPolicy:
    """The policy GC applies to an experiment (id or name): its override if one was set, else
    its config's ``checkpoint:`` section."""
    found = store.get_experiment(experiment)
    override = _override(found)
    return override if override is not None else _configured_policy(found)


def _configured_policy(experiment: Experiment) -> GcPolicy:
    try:
        return _policy_of_config(experiment.config_json)
    except ValidationError as exc:
        raise _invalid_config(experiment, exc) from None


@functools.lru_cache(maxsize=64)
def _policy_of_config(config_json: str) -> GcPolicy:
    # By the recorded config's text: GC runs at every checkpoint a search records, and validating
    # a whole ExperimentConfig each time cost a search's driver ~0.1 s a checkpoint.
    return GcPolicy.from_config(ExperimentConfig.model_validate_json(config_json).checkpoint)


def set_gc_policy(
    store: TrackingStore, experiment: int | str, policy: GcPolicy, actor: str | None = None
) -> GcPlan:
    """Make ``policy`` the experiment's GC policy and apply it now; return the plan carried out.

    Records the override, appends a ``gc.policy_changed`` audit event (old and new policy, and
    whether the old one was an override), then runs ``apply_gc`` with the metric the
    experiment's searcher optimises. An experiment whose recorded config does not validate is
    refused before anything changes.
    """
    found = store.get_experiment(experiment)
    config = _recorded_config(found)
    experiment_id = found.id
    assert experiment_id is not None  # read from the store
    override = _override(found)
    old = override if override is not None else GcPolicy.from_config(config.checkpoint)
    store.set_gc_policy(experiment_id, policy.model_dump_json())
    AuditLog(store).append(
        AuditEventType.GC_POLICY_CHANGED,
        {"old": old.model_dump(), "old_overridden": override is not None, "new": policy.model_dump()},
        experiment_id=experiment_id,
        actor=actor,
    )
    searcher = config.searcher
    return apply_gc(
        store, experiment_id, policy, metric=searcher.metric, smaller_is_better=searcher.smaller_is_better
    )


def remove_checkpoint_directory(storage: Storage, path: str) -> None:
    """Delete a checkpoint's directory, from object storage too where the experiment keeps its
    files there (``path`` is then its copy in this node's cache); one already gone is fine. Then
    the run's frozen base files no remaining checkpoint of the run refers to
    (``govray.train.checkpoints.base_file``): a base file outlives every checkpoint that refers to it, no
    more. The only place GC touches storage."""
    from govray.train.checkpoints.base_file import release_unreferenced  # loads torch: only when GC deletes

    storage.delete_directory(Path(path))
    release_unreferenced(Path(path).parent, storage)


def _inventory(store: TrackingStore, experiment_id: int, metric: str) -> _Inventory:
    store.get_experiment(experiment_id)  # an unknown id is a TrackingError, not an empty plan
    found = active_checkpoints(store, experiment_id, metric)
    live = frozenset(trial for trial, state in found.trial_states.items() if state in LIVE_TRIAL_STATES)
    # reports come in the order they were made: a step reported twice counts its last report
    at_step = {(trial, step): value for trial, step, value in found.reports}
    values = {
        _checkpoint_id(record): at_step[(record.trial_id, record.step)]
        for record in found.checkpoints
        if (record.trial_id, record.step) in at_step
    }
    registered: defaultdict[int, list[str]] = defaultdict(list)
    for version in found.versions:
        registered[version.checkpoint_id].append(f"{version.model_name}:{version.version}")
    return _Inventory(found.checkpoints, live, values, dict(registered))


def _best_first(
    records: Sequence[CheckpointRecord], values: dict[int, float], smaller_is_better: bool
) -> list[CheckpointRecord]:
    """The checkpoints that have a metric value, best first; ties go to the later step, then id."""
    sign = 1.0 if smaller_is_better else -1.0

    def rank(record: CheckpointRecord) -> tuple[float, int, int]:
        return sign * values[_checkpoint_id(record)], -record.step, -_checkpoint_id(record)

    return sorted((record for record in records if _checkpoint_id(record) in values), key=rank)


def _latest_first(records: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
    return sorted(records, key=lambda record: (-record.step, -_checkpoint_id(record)))


def _by_trial(records: Iterable[CheckpointRecord]) -> dict[int, list[CheckpointRecord]]:
    grouped: defaultdict[int, list[CheckpointRecord]] = defaultdict(list)
    for record in records:
        grouped[record.trial_id].append(record)
    return dict(sorted(grouped.items()))


def _checkpoint_id(record: CheckpointRecord) -> int:
    if record.id is None:
        raise GovrayError(f"checkpoint {record.uuid} has no id: GC only handles rows read from the store")
    return record.id


def _recorded_config(experiment: Experiment) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate_json(experiment.config_json)
    except ValidationError as exc:
        raise _invalid_config(experiment, exc) from None


def _invalid_config(experiment: Experiment, exc: ValidationError) -> TrackingError:
    return TrackingError(
        f"experiment {experiment.id} '{experiment.name}': its recorded config does not validate "
        f"({describe_validation_error(exc)})"
    )


def _override(experiment: Experiment) -> GcPolicy | None:
    """The GC policy set on the experiment after its creation, if any."""
    if experiment.gc_policy_json is None:
        return None
    try:
        return GcPolicy.model_validate_json(experiment.gc_policy_json)
    except ValidationError as exc:
        raise TrackingError(
            f"experiment {experiment.id} '{experiment.name}': its stored GC policy does not validate "
            f"({describe_validation_error(exc)})"
        ) from None


def _deletion_payload(record: CheckpointRecord, policy: GcPolicy) -> dict[str, object]:
    return {
        "checkpoint_id": record.id,
        "uuid": record.uuid,
        "path": record.path,
        "step": record.step,
        "trial_id": record.trial_id,
        "manifest_digest": record.manifest_digest,
        "policy": policy.model_dump(),
    }


def _mark_deleted(store: TrackingStore, checkpoint_id: int) -> None:
    if mark_deleted(store, checkpoint_id) is None:
        raise GovrayError(f"checkpoint {checkpoint_id} vanished from the tracking store during GC")
