"""What the checkpoint-GC tests share: checkpoints of known losses in a store, an experiment config."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.config.experiment import ExperimentConfig
from govray.platform.gc import GcPolicy, apply_gc, plan_gc
from govray.tracking.lineage import record_checkpoint
from govray.tracking.store import TrackingStore
from govray.tracking.tables import CheckpointRecord, CheckpointStatus, MetricKind, TrialState
from tests.helpers.builders import BASE_CREDENTIAL

METRIC = "validation_loss"
STEPS = (10, 20, 30, 40, 50)
# validation_loss at each checkpoint step; best by hand: a40 < a20 < a50 < a30 < a10 and
# b30 < b50 < b20 < b40 < b10; over both: b30 < a40 < b50 < b20 < b40 < a20 < ...
LOSSES = {
    "a": (0.9, 0.5, 0.7, 0.3, 0.6),
    "b": (0.8, 0.4, 0.2, 0.45, 0.35),
}


@dataclass
class Run:
    """One experiment in a store, its trials by letter and checkpoints by name ("a20")."""

    store: TrackingStore
    experiment_id: int
    trials: dict[str, int]
    ids: dict[str, int]
    root: Path

    def names(self, ids: frozenset[int] | set[int]) -> set[str]:
        by_id = {checkpoint_id: name for name, checkpoint_id in self.ids.items()}
        return {by_id[checkpoint_id] for checkpoint_id in ids}

    def path(self, name: str) -> Path:
        return self.root / name

    def add_trial(self, letter: str, state: TrialState = TrialState.COMPLETED) -> int:
        trial = self.store.create_trial(self.experiment_id, "{}", seed=len(self.trials))
        assert trial.id is not None
        self.store.set_trial_state(trial.id, state)
        self.trials[letter] = trial.id
        return trial.id

    def add_checkpoint(self, letter: str, step: int, loss: float | None, name: str | None = None) -> int:
        name = name or f"{letter}{step}"
        directory = self.path(name)
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"weights of " + name.encode())
        record = record_checkpoint(self.store, self.trials[letter], str(directory), step)
        if loss is not None:
            self.store.log_metrics(self.trials[letter], step, MetricKind.VALIDATION, {METRIC: loss})
        assert record.id is not None
        self.ids[name] = record.id
        return record.id

    def plan(self, policy: GcPolicy) -> set[str]:
        """The names GC would keep (smaller is better), changing nothing."""
        plan = plan_gc(self.store, self.experiment_id, policy, metric=METRIC, smaller_is_better=True)
        return self.names(plan.keep)

    def gc(self, policy: GcPolicy, smaller_is_better: bool = True, protected: Iterable[int] = ()) -> set[str]:
        """Apply GC and return the names it kept."""
        plan = apply_gc(
            self.store,
            self.experiment_id,
            policy,
            metric=METRIC,
            smaller_is_better=smaller_is_better,
            protected=protected,
        )
        return self.names(plan.keep)

    def active(self) -> set[str]:
        return {name for name in self.ids if self.record(name).state == CheckpointStatus.ACTIVE}

    def on_disk(self) -> set[str]:
        return {name for name in self.ids if self.path(name).exists()}

    def record(self, name: str) -> CheckpointRecord:
        with self.store.session() as session:
            found = session.get(CheckpointRecord, self.ids[name])
        assert found is not None
        return found


def experiment_config(**overrides: Any) -> ExperimentConfig:
    """A valid experiment config; ``overrides`` replace top-level keys."""
    raw: dict[str, Any] = {
        "name": "gc-policy",
        "trial": "jobs.examples.digits.trial:DigitsTrial",
        "data": {
            "corpora": [{"id": "digits-public", "path": "/data/public.jsonl", "credential": BASE_CREDENTIAL}]
        },
        "policy": {"file": "/policies/digits.policy.yaml"},
        **overrides,
    }
    return ExperimentConfig.model_validate(raw)


def single(**fields: Any) -> dict[str, Any]:
    """A single-trial searcher section."""
    return {"name": "single", **fields}
