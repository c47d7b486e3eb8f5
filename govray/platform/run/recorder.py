"""The one writer of a running trial's rows: ``RunRecorder``, on the driver.

A Ray Train run's driver hands it the reports its ``ReportSink`` queued (and, in-process, each
report as it is made); a search's Tune callback hands it the reports each Tune result relays and
each Tune checkpoint. It stores each step's report once (a restarted worker group re-runs the
steps after its checkpoint), the trial's progress as state (last step, why it stopped, the trial a
PBT clone continued), the decisions and their audit events, the ledger, each checkpoint, then
applies checkpoint GC; and it settles the run's checkpoint folders against the store
(``govray.platform.run.reconcile``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.core.keys import TrustConfig
from govray.core.storage import Storage
from govray.platform.gc import apply_gc, effective_gc_policy
from govray.platform.run.ledgers import ledger_tuples, record_checkpoint_ledger
from govray.platform.run.reconcile import Reconciliation, reconcile_run
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import record_ledger
from govray.tracking.store import TrackingStore
from govray.tracking.tensorboard import TensorBoardLog
from govray.train.checkpoints.files import CheckpointError
from govray.train.run.reports import StepReport
from govray.train.step.ledger import Ledger

logger = logging.getLogger(__name__)
MEMORIZATION_EVENTS = {
    "gate": AuditEventType.MEMORIZATION_GATE,
    "rollback": AuditEventType.MEMORIZATION_ROLLBACK,
}


@dataclass(frozen=True)
class GcSettings:
    """What checkpoint GC needs as the run goes (Ray keeps every checkpoint). The policy is read
    at every checkpoint: ``govray experiment set gc-policy`` applies mid-run."""

    experiment_id: int
    metric: str
    smaller_is_better: bool
    as_it_goes: bool = True  # False under PBT: a donor's earlier checkpoint may still be cloned


class RunRecorder:
    """Records one trial's reports and checkpoints in the tracking store (one owner per row)."""

    def __init__(
        self,
        store: TrackingStore,
        trial_id: int,
        layers: dict[str, int | None],
        gc: GcSettings,
        *,
        replaying: bool = False,
        events: TensorBoardLog | None = None,
        storage: Storage | None = None,
        run_dir: str = "",
        trust: TrustConfig | None = None,
    ) -> None:
        self.store = store
        self.trial_id = trial_id
        self.layers = layers  # tensor name → layer, for the ledger rows
        self.gc = gc
        self.replaying = replaying  # decisions reported are the source trial's, applied
        self.events = events
        self.storage = storage  # the experiment's (on object storage: by cache paths)
        self.run_dir = run_dir  # with ``trust``: the run's checkpoint folders are reconciled
        self.trust = trust
        self.reported = store.reported_steps(trial_id)  # steps whose report is in the store
        self.latest: StepReport | None = None  # the newest report recorded
        self.world_history = store.get_trial(trial_id).world_history  # [(from_step, workers), ...]

    def record(self, report: StepReport) -> None:
        """One report, and the checkpoint it carries (after recording what earlier reports lost at
        a worker's death left on storage)."""
        if report.checkpoint is not None and self.run_dir and self.trust is not None:
            self.reconcile(below_step=report.step)
        self.record_world(report)
        self.record_once(report)
        if report.checkpoint is not None:
            path = self.storage.cached(report.checkpoint) if self.storage is not None else report.checkpoint
            self.record_checkpoint(str(path), report.step)

    def record_world(self, report: StepReport) -> None:
        """Keep the world sizes the trial trained on as its live reports say them. Live reports
        arrive in the order their attempts ran (a restarted worker group reports after the one it
        replaced ended), so the latest is right even when it is shorter: a restart from a checkpoint
        written before a resize discards the steps trained since on the other world size. (What
        reconcile recovers from storage is older: it leaves the history alone.)"""
        history = list(report.world_history)
        if history and history != self.world_history:
            self.store.set_trial_world_history(self.trial_id, history)
            self.world_history = history

    def record_once(self, report: StepReport) -> None:
        """Store one report unless its step's report is already there. Its metric rows go last,
        in one transaction with the trial's progress: they mark the report recorded, so a driver
        that dies before them leaves the report to be recorded whole again (decisions, ledger and
        checkpoint rows are idempotent)."""
        if report.step in self.reported:
            return
        store, trial_id = self.store, self.trial_id
        training = {"epoch": float(report.epoch)}
        validation: dict[str, float] = {}
        for name, value in report.metrics.items():
            if value == value:  # NaN: not storable, and means "no rows" here
                (validation if name.startswith("validation_") else training)[name] = value
        if self.events is not None:
            self.events.write(report.step, {**training, **validation})
        if report.decisions:
            decisions = [decision.model_dump(mode="json") for decision in report.decisions]
            known = {decision.seq for decision in store.decisions(trial_id)}
            # A clone's report carries its state's decisions (its donor's first): they supersede the row's.
            clone = report.cloned_from_run is not None
            store.record_decisions(trial_id, decisions, replayed=self.replaying, superseding=clone)
            for decision in decisions:
                if decision["seq"] not in known and decision["kind"] in MEMORIZATION_EVENTS:
                    self._audit(
                        MEMORIZATION_EVENTS[decision["kind"]], {**decision, "replayed": self.replaying}
                    )
        if report.flagged is not None:
            self._audit(
                AuditEventType.MEMORIZATION_FLAGGED, {"step": report.step, **report.flagged.model_dump()}
            )
        if report.ledger is not None and report.checkpoint is None:  # else: stored with the checkpoint
            record_ledger(store, trial_id, ledger_tuples(Ledger.from_json(report.ledger), self.layers))
        scalars = {"training": training, **({"validation": validation} if validation else {})}
        donor = self._donor(report.cloned_from_run)
        store.record_report(trial_id, report.step, scalars, report.stop, donor)
        self.reported.add(report.step)
        self.latest = report

    def rewrite_events(self) -> None:
        """Start this driver's TensorBoard file with every report the store holds (a resumed run:
        the file of the driver that recorded them may be on a node that is gone)."""
        if self.events is None:
            return
        by_step: dict[int, dict[str, float]] = {}
        for metric in self.store.metrics(self.trial_id):
            by_step.setdefault(metric.step, {})[metric.name] = metric.value
        for step in sorted(by_step):
            self.events.write(step, by_step[step])

    def record_checkpoint(self, path: str, step: int) -> None:
        """Record a checkpoint and its ledger (what lineage answers as of its step). A ledger that
        does not verify is not stored; a lineage request for the checkpoint then says why."""
        try:
            record_checkpoint_ledger(self.store, self.trial_id, path, step, self.layers, self.trust)
        except CheckpointError as error:
            logger.warning(
                "checkpoint at step %d of trial %d: ledger not stored: %s", step, self.trial_id, error
            )
        if self.gc.as_it_goes:
            self.collect_garbage()

    def reconcile(self, below_step: int | None = None) -> Reconciliation:
        """Settle the run's checkpoint folders against the store (``govray.platform.run.reconcile``); live
        (``below_step`` given) it only records folders of earlier steps."""
        assert self.trust is not None and self.storage is not None
        return reconcile_run(
            self.store,
            self.trial_id,
            Path(self.run_dir),
            self.trust,
            record_report=lambda step, report: self.record_once(StepReport.parse({"step": step, **report})),
            storage=self.storage,
            below_step=below_step,
            layers=self.layers,
        )

    def settle(self) -> None:
        """When a run starts, resumes or ends: every checkpoint it left recorded (with reports a
        worker's death lost), no partial or duplicate folder left behind, then GC over what is
        now recorded — also when nothing new was recorded: a driver killed between recording a
        checkpoint and collecting garbage left that GC undone (GC is idempotent). Under PBT (no
        GC as it goes) only when checkpoints were recovered, as before."""
        if self.reconcile().recorded or self.gc.as_it_goes:
            self.collect_garbage()

    def collect_garbage(self) -> None:
        self.collect_all(self.store, self.gc, self.storage)

    @staticmethod
    def collect_all(store: TrackingStore, gc: GcSettings, storage: Storage | None = None) -> None:
        """Apply the experiment's checkpoint GC policy over every trial's recorded checkpoints
        (in ``storage``, the experiment's, when the caller holds it)."""
        apply_gc(
            store,
            gc.experiment_id,
            effective_gc_policy(store, gc.experiment_id),
            metric=gc.metric,
            smaller_is_better=gc.smaller_is_better,
            storage=storage,
        )

    def _donor(self, run_name: str | None) -> int | None:
        if run_name is None:
            return None
        experiment_id = self.store.get_trial(self.trial_id).experiment_id
        donors = [t.id for t in self.store.list_trials(experiment_id) if t.ray_run_name == run_name]
        return donors[0] if donors else None

    def _audit(self, kind: AuditEventType, payload: dict[str, Any]) -> None:
        experiment_id = self.store.get_trial(self.trial_id).experiment_id
        AuditLog(self.store).append(kind, {"trial_id": self.trial_id, **payload}, experiment_id=experiment_id)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a RunRecorder stays on the driver")
