"""Promises of checkpoint GC: it keeps exactly the union of experiment best,
trial best and trial latest; never deletes a live trial's latest, a registered version or a
protected checkpoint; deletes directories but keeps rows, attestations and an audit record."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from govray.config.experiment import CheckpointConfig
from govray.core.errors import GovrayError
from govray.platform.gc import GcPolicy, apply_gc, plan_gc
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.tracking.tables import (
    AttestationRecord,
    CheckpointStatus,
    MetricKind,
    ModelVersion,
    RegisteredModel,
    TrialState,
)
from tests.helpers.gc import LOSSES, METRIC, STEPS, Run


def new_run(store: TrackingStore, root: Path, name: str = "gc") -> Run:
    experiment = store.create_experiment(name, "{}", "digest", str(root))
    assert experiment.id is not None
    return Run(store, experiment.id, {}, {}, root)


@pytest.fixture
def run(store: TrackingStore, tmp_path: Path) -> Run:
    """Two completed trials, five checkpoints each, with the LOSSES of ``tests.helpers.gc``."""
    made = new_run(store, tmp_path / "checkpoints")
    for letter, losses in LOSSES.items():
        made.add_trial(letter)
        for step, loss in zip(STEPS, losses, strict=True):
            made.add_checkpoint(letter, step, loss)
    # Noise GC must ignore: a validation report at a step with no checkpoint, and a training
    # metric of the same name that would be the best of all.
    made.store.log_metrics(made.trials["b"], 45, MetricKind.VALIDATION, {METRIC: 0.01})
    made.store.log_metrics(made.trials["a"], 10, MetricKind.TRAINING, {METRIC: 0.0})
    return made


def register(store: TrackingStore, checkpoint_id: int, model: str = "digits", version: int = 2) -> None:
    with store.session() as session:
        if session.get(RegisteredModel, model) is None:
            session.add(RegisteredModel(name=model))
            session.flush()
        session.add(ModelVersion(model_name=model, version=version, checkpoint_id=checkpoint_id))


def gc_events(store: TrackingStore) -> list[dict[str, Any]]:
    return [
        json.loads(event.payload_json) for event in AuditLog(store).list(event_type=AuditEventType.GC_DELETED)
    ]


# -- what is kept ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "smaller_is_better", "kept"),
    [
        ((0, 1, 1), True, {"a40", "a50", "b30", "b50"}),
        ((2, 0, 0), True, {"b30", "a40"}),
        ((0, 0, 1), True, {"a50", "b50"}),
        ((1, 2, 1), True, {"b30", "a40", "a20", "b50", "a50"}),
        ((0, 0, 0), True, set()),
        ((1, 1, 0), False, {"a10", "b10"}),
        ((3, 2, 0), False, {"a10", "a30", "b10", "b40"}),
    ],
)
def test_kept_set_is_exactly_the_union_of_experiment_best_trial_best_and_trial_latest(
    run: Run, policy: tuple[int, int, int], smaller_is_better: bool, kept: set[str]
) -> None:
    experiment_best, trial_best, trial_latest = policy
    gc_policy = GcPolicy(
        save_experiment_best=experiment_best, save_trial_best=trial_best, save_trial_latest=trial_latest
    )

    assert run.gc(gc_policy, smaller_is_better=smaller_is_better) == kept
    assert run.active() == kept
    assert run.on_disk() == kept


def test_reasons_say_why_each_checkpoint_is_kept(run: Run) -> None:
    policy = GcPolicy(save_experiment_best=1, save_trial_best=1, save_trial_latest=1)
    plan = plan_gc(run.store, run.experiment_id, policy, metric=METRIC, smaller_is_better=True)

    a, b = run.trials["a"], run.trials["b"]
    assert {run.names({cid}).pop(): reasons for cid, reasons in plan.reasons.items()} == {
        "a40": [f"trial {a} best"],
        "a50": [f"trial {a} latest"],
        "b30": ["experiment best", f"trial {b} best"],
        "b50": [f"trial {b} latest"],
    }
    assert [record.id for record in plan.delete] == [
        run.ids[name] for name in ("a10", "a20", "a30", "b10", "b20", "b40")
    ]


def test_a_checkpoint_without_a_validation_metric_at_its_step_is_kept_only_as_latest(
    store: TrackingStore, tmp_path: Path
) -> None:
    run = new_run(store, tmp_path)
    run.add_trial("a")
    run.add_checkpoint("a", 10, 0.5)
    run.add_checkpoint("a", 20, None)
    run.add_checkpoint("a", 30, None)
    store.log_metrics(run.trials["a"], 30, MetricKind.TRAINING, {METRIC: 0.0})

    assert run.plan(GcPolicy(save_experiment_best=5, save_trial_best=5, save_trial_latest=0)) == {"a10"}
    assert run.plan(GcPolicy(save_experiment_best=0, save_trial_best=0, save_trial_latest=1)) == {"a30"}


def test_metric_ties_go_to_the_later_step_then_the_higher_id(store: TrackingStore, tmp_path: Path) -> None:
    run = new_run(store, tmp_path)
    run.add_trial("a")
    run.add_checkpoint("a", 10, 0.5)
    run.add_checkpoint("a", 20, 0.5)
    run.add_checkpoint("a", 30, 0.9)
    best = GcPolicy(save_experiment_best=0, save_trial_best=1, save_trial_latest=0)
    assert run.gc(best) == {"a20"}

    # Re-saved at the same step (after a resume, say): same metric, same step, the newer row wins.
    run.add_checkpoint("a", 20, None, name="a20-again")
    assert run.gc(best) == {"a20-again"}


def test_only_active_checkpoints_of_the_experiments_own_trials_are_considered(
    run: Run, tmp_path: Path
) -> None:
    other = new_run(run.store, tmp_path / "other", name="other")
    other.add_trial("z")
    other.add_checkpoint("z", 10, 0.0001)  # better than everything in `run`

    kept = run.gc(GcPolicy(save_experiment_best=1, save_trial_best=0, save_trial_latest=0))

    assert kept == {"b30"}
    assert other.active() == other.on_disk() == {"z10"}


def test_policy_comes_from_the_experiments_checkpoint_section() -> None:
    config = CheckpointConfig(period=50, save_experiment_best=3, save_trial_best=0, save_trial_latest=2)
    assert GcPolicy.from_config(config) == GcPolicy(
        save_experiment_best=3, save_trial_best=0, save_trial_latest=2
    )
    assert GcPolicy.from_config(CheckpointConfig()) == GcPolicy()


# -- what is never deleted -------------------------------------------------------------------

KEEP_NOTHING = GcPolicy(save_experiment_best=0, save_trial_best=0, save_trial_latest=0)


def test_a_registered_checkpoint_survives_a_policy_that_keeps_nothing(run: Run) -> None:
    register(run.store, run.ids["a10"])

    plan = plan_gc(run.store, run.experiment_id, KEEP_NOTHING, metric=METRIC, smaller_is_better=True)
    assert plan.reasons == {run.ids["a10"]: ["registered model digits:2"]}
    assert run.gc(KEEP_NOTHING) == {"a10"}
    assert run.active() == run.on_disk() == {"a10"}


@pytest.mark.parametrize("state", [TrialState.ACTIVE, TrialState.PAUSED, TrialState.PENDING])
def test_a_live_trials_latest_checkpoint_survives_a_policy_that_keeps_nothing(
    run: Run, state: TrialState
) -> None:
    run.store.set_trial_state(run.trials["a"], state)

    plan = plan_gc(run.store, run.experiment_id, KEEP_NOTHING, metric=METRIC, smaller_is_better=True)
    assert plan.reasons == {run.ids["a50"]: ["live trial latest"]}
    assert run.gc(KEEP_NOTHING) == {"a50"}
    assert run.active() == run.on_disk() == {"a50"}


def test_a_protected_checkpoint_survives_and_foreign_protected_ids_are_ignored(run: Run) -> None:
    protected = [run.ids["b20"], 10_000]

    assert run.gc(KEEP_NOTHING, protected=protected) == {"b20"}
    assert run.active() == run.on_disk() == {"b20"}


# -- how deletion is recorded ----------------------------------------------------------------


def test_deletion_removes_directories_keeps_rows_and_attestations_and_audits_each_once(run: Run) -> None:
    with run.store.session() as session:
        session.add(
            AttestationRecord(checkpoint_id=run.ids["a10"], subject_digest="sha256:a10", envelope_json="{}")
        )
    policy = GcPolicy(save_experiment_best=0, save_trial_best=1, save_trial_latest=1)

    kept = run.gc(policy)

    deleted = set(run.ids) - kept
    assert deleted == {"a10", "a20", "a30", "b10", "b20", "b40"}
    assert run.on_disk() == kept
    for name in deleted:
        record = run.record(name)
        assert record.state == CheckpointStatus.DELETED
        assert record.deleted_at is not None
    assert sum(len(checkpoints(run.store, trial_id)) for trial_id in run.trials.values()) == 10
    with run.store.session() as session:
        attestations = [
            (row.checkpoint_id, row.subject_digest) for row in session.exec(select(AttestationRecord))
        ]
    assert attestations == [(run.ids["a10"], "sha256:a10")]

    events = gc_events(run.store)
    assert sorted(event["checkpoint_id"] for event in events) == sorted(run.ids[name] for name in deleted)
    a10_event = next(event for event in events if event["checkpoint_id"] == run.ids["a10"])
    a10 = run.record("a10")
    assert a10_event == {
        "checkpoint_id": a10.id,
        "uuid": a10.uuid,
        "path": a10.path,
        "step": 10,
        "trial_id": run.trials["a"],
        "manifest_digest": a10.manifest_digest,
        "policy": {"save_experiment_best": 0, "save_trial_best": 1, "save_trial_latest": 1},
    }
    assert all(event.experiment_id == run.experiment_id for event in AuditLog(run.store).list())
    assert AuditLog(run.store).verify() == len(deleted)


def test_a_checkpoint_whose_directory_is_already_gone_is_still_marked_deleted(run: Run) -> None:
    for child in run.path("a10").iterdir():
        child.unlink()
    run.path("a10").rmdir()

    run.gc(GcPolicy(save_experiment_best=0, save_trial_best=0, save_trial_latest=1))

    assert run.record("a10").state == CheckpointStatus.DELETED
    assert run.active() == {"a50", "b50"}


def test_applying_twice_deletes_nothing_the_second_time(run: Run) -> None:
    policy = GcPolicy(save_experiment_best=1, save_trial_best=1, save_trial_latest=1)
    first = run.gc(policy)
    events = len(gc_events(run.store))

    second = apply_gc(run.store, run.experiment_id, policy, metric=METRIC, smaller_is_better=True)

    assert run.names(second.keep) == first
    assert second.delete == ()
    assert len(gc_events(run.store)) == events
    assert run.active() == run.on_disk() == first


def test_dry_run_returns_the_plan_and_changes_nothing(run: Run) -> None:
    policy = GcPolicy(save_experiment_best=0, save_trial_best=1, save_trial_latest=1)

    plan = apply_gc(run.store, run.experiment_id, policy, metric=METRIC, smaller_is_better=True, dry_run=True)

    assert run.names(plan.keep) == {"a40", "a50", "b30", "b50"}
    doomed = {record.id for record in plan.delete if record.id is not None}
    assert run.names(doomed) == {"a10", "a20", "a30", "b10", "b20", "b40"}
    assert run.active() == run.on_disk() == set(run.ids)
    assert AuditLog(run.store).list() == []


def test_a_deletion_that_fails_leaves_the_checkpoint_active_and_unaudited(run: Run) -> None:
    shutil.rmtree(run.path("a10"))
    run.path("a10").write_text("a file where a directory should be")  # rmtree refuses it

    with pytest.raises(
        GovrayError, match=rf"checkpoint {run.ids['a10']} \(trial {run.trials['a']}, step 10\)"
    ):
        run.gc(GcPolicy(save_experiment_best=0, save_trial_best=0, save_trial_latest=1))

    assert run.record("a10").state == CheckpointStatus.ACTIVE
    assert gc_events(run.store) == []
