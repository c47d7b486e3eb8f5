"""Promises of an experiment's GC policy after creation: the config's checkpoint section until
overridden; an override is stored, audited (old and new) and applied at once with the metric the
experiment's searcher optimises; a refused change changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from govray.config.experiment import ExperimentConfig
from govray.core.errors import TrackingError
from govray.platform.gc import GcPolicy, effective_gc_policy, set_gc_policy
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore
from tests.helpers.gc import LOSSES, METRIC, STEPS, Run, experiment_config, single


def configured_run(store: TrackingStore, root: Path, config: ExperimentConfig) -> Run:
    """Trials a and b with tests.helpers.gc's LOSSES, in an experiment recorded with ``config``."""
    experiment = store.create_experiment(config.name, config.model_dump_json(), "digest", str(root))
    assert experiment.id is not None
    run = Run(store, experiment.id, {}, {}, root)
    for letter, losses in LOSSES.items():
        run.add_trial(letter)
        for step, loss in zip(STEPS, losses, strict=True):
            run.add_checkpoint(letter, step, loss)
    return run


def policy_events(store: TrackingStore) -> list[tuple[str, int | None, dict[str, Any]]]:
    return [
        (event.actor, event.experiment_id, json.loads(event.payload_json))
        for event in AuditLog(store).list(event_type=AuditEventType.GC_POLICY_CHANGED)
    ]


def test_the_effective_policy_is_the_configs_checkpoint_section_until_overridden(
    store: TrackingStore, tmp_path: Path
) -> None:
    config = experiment_config(
        checkpoint={"save_experiment_best": 2, "save_trial_best": 0, "save_trial_latest": 3}
    )
    experiment = store.create_experiment(config.name, config.model_dump_json(), "digest", str(tmp_path))
    assert experiment.id is not None

    from_config = GcPolicy(save_experiment_best=2, save_trial_best=0, save_trial_latest=3)
    assert effective_gc_policy(store, experiment.id) == from_config
    assert effective_gc_policy(store, "gc-policy") == from_config

    override = GcPolicy(save_experiment_best=0, save_trial_best=4, save_trial_latest=1)
    store.set_gc_policy(experiment.id, override.model_dump_json())
    assert effective_gc_policy(store, experiment.id) == override

    store.set_gc_policy(experiment.id, None)
    assert effective_gc_policy(store, experiment.id) == from_config


def test_setting_a_policy_stores_audits_and_applies_it_at_once(store: TrackingStore, tmp_path: Path) -> None:
    run = configured_run(store, tmp_path / "checkpoints", experiment_config(searcher=single(metric=METRIC)))
    new = GcPolicy(save_experiment_best=1, save_trial_best=0, save_trial_latest=0)

    plan = set_gc_policy(store, run.experiment_id, new, actor="alice")

    assert run.names(plan.keep) == {"b30"}
    assert run.active() == run.on_disk() == {"b30"}
    assert effective_gc_policy(store, run.experiment_id) == new
    assert policy_events(store) == [
        (
            "alice",
            run.experiment_id,
            {
                "old": {"save_experiment_best": 0, "save_trial_best": 1, "save_trial_latest": 1},
                "old_overridden": False,
                "new": {"save_experiment_best": 1, "save_trial_best": 0, "save_trial_latest": 0},
            },
        )
    ]
    kinds = [event.event_type for event in AuditLog(store).list(experiment_id=run.experiment_id)]
    assert kinds == [AuditEventType.GC_POLICY_CHANGED] + [AuditEventType.GC_DELETED] * 9


def test_a_second_change_records_the_first_override_as_the_old_policy(
    store: TrackingStore, tmp_path: Path
) -> None:
    run = configured_run(store, tmp_path / "checkpoints", experiment_config(searcher=single(metric=METRIC)))
    first = GcPolicy(save_experiment_best=0, save_trial_best=2, save_trial_latest=1)
    second = GcPolicy(save_experiment_best=0, save_trial_best=1, save_trial_latest=1)

    assert run.names(set_gc_policy(store, "gc-policy", first).keep) == {"a40", "a20", "a50", "b30", "b50"}
    assert run.names(set_gc_policy(store, "gc-policy", second).keep) == {"a40", "a50", "b30", "b50"}

    (_, _, payload), (_, _, again) = policy_events(store)
    assert payload["old_overridden"] is False
    assert again == {"old": first.model_dump(), "old_overridden": True, "new": second.model_dump()}


@pytest.mark.parametrize(
    ("searcher", "kept"),
    [
        (single(metric=METRIC, smaller_is_better=False), {"a10", "b10"}),
        (single(metric=METRIC, smaller_is_better=True), {"a40", "b30"}),
        (single(metric="accuracy"), set()),  # no checkpoint has that metric: none is anyone's best
    ],
)
def test_the_change_is_applied_with_the_searchers_metric_and_direction(
    store: TrackingStore, tmp_path: Path, searcher: dict[str, Any], kept: set[str]
) -> None:
    run = configured_run(store, tmp_path / "checkpoints", experiment_config(searcher=searcher))
    best_only = GcPolicy(save_experiment_best=0, save_trial_best=1, save_trial_latest=0)

    assert run.names(set_gc_policy(store, run.experiment_id, best_only).keep) == kept
    assert run.active() == kept


def test_an_experiment_whose_recorded_config_does_not_validate_is_refused_before_anything_changes(
    store: TrackingStore, tmp_path: Path
) -> None:
    experiment = store.create_experiment("broken", "{}", "digest", str(tmp_path))
    assert experiment.id is not None
    run = Run(store, experiment.id, {}, {}, tmp_path / "checkpoints")
    run.add_trial("a")
    run.add_checkpoint("a", 10, 0.5)
    run.add_checkpoint("a", 20, 0.4)

    with pytest.raises(
        TrackingError, match=r"experiment \d+ 'broken': its recorded config does not validate"
    ):
        set_gc_policy(store, experiment.id, GcPolicy(save_trial_best=0, save_trial_latest=0))

    assert store.get_experiment(experiment.id).gc_policy_json is None
    assert AuditLog(store).list() == []
    assert run.active() == run.on_disk() == {"a10", "a20"}
