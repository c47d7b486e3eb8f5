"""Storage and tracking store agree about a run, whatever its workers' deaths did.

Ray Train V2 holds one unread report per worker and collects them at its next poll: a report
queued by a worker group that dies first is dropped, though its checkpoint folder is already on
storage (rank 0 uploads it before reporting). A killed worker may also leave a partial folder.
``reconcile_run`` settles what a run left on storage against the store, by these rules:

- a folder that verifies and is not recorded is recorded (``checkpoint.recovered``), and the
  report it was reported with (``report.json``, signed in its manifest) is recorded too when
  that step has none: no report a worker made is lost;
- a folder that verifies but repeats a recorded step (a step re-run after a restart) is removed
  (``checkpoint.removed``, reason ``duplicate``): one checkpoint per step;
- a folder that does not verify (a partial upload, a tampered file) is removed, naming why
  (``checkpoint.removed``);
- a folder whose record GC marked deleted but which is still there is deleted again.
- a recorded checkpoint without its ledger rows (a driver killed between recording it and
  storing them) has its ledger stored from its verified state.

It runs when a run (re)starts and when it ends (the driver: removals allowed, nothing writes),
and at every checkpoint a live run reports (the controller: only recording, only below the
reported step, since the run may be writing newer folders). Resume, in the workers, follows one
rule of its own: the newest checkpoint that verifies (``newest_verified_checkpoint``).

Example::

    done = reconcile_run(store, trial_id, run_dir, trust, record_report=record, storage=storage)
    done.recorded  # -> (10,): the step-10 checkpoint and report, lost at a worker's death
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.core.keys import TrustConfig
from govray.core.storage import Storage
from govray.platform.run.ledgers import Layers, record_checkpoint_ledger, store_checkpoint_ledger
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import checkpoint_ledger_rows, checkpoints
from govray.tracking.store import TrackingStore
from govray.tracking.tables import CheckpointStatus
from govray.train.checkpoints.files import CheckpointError
from govray.train.checkpoints.folders import checkpoint_directories, checkpoint_report, present_checkpoint

RecordReport = Callable[[int, dict[str, Any]], None]  # (step, report) → stored in the store


@dataclass(frozen=True)
class Reconciliation:
    """What one reconciliation changed: steps recorded, folders removed (with why)."""

    recorded: tuple[int, ...] = ()
    removed: tuple[tuple[str, str], ...] = ()  # (folder, reason)


def reconcile_run(
    store: TrackingStore,
    trial_id: int,
    run_dir: Path,
    trust: TrustConfig,
    *,
    record_report: RecordReport,
    storage: Storage,
    below_step: int | None = None,
    layers: Layers | None = None,
) -> Reconciliation:
    """Record every verified, unrecorded checkpoint folder of the trial's run (and its report);
    remove duplicates and folders that do not verify. With ``below_step`` (a live run) only
    folders of earlier steps are recorded and nothing is removed. Each checkpoint recorded has its
    ledger stored (``layers``: tensor → layer; None: from the checkpoint's run spec)."""
    live = below_step is not None
    records = checkpoints(store, trial_id)
    by_name = {Path(record.path).name: record for record in records}
    steps = {record.step: record for record in records}
    experiment_id = store.get_trial(trial_id).experiment_id
    log = AuditLog(store)
    recorded: list[int] = []
    removed: list[tuple[str, str]] = []

    def remove(directory: Path, reason: str, **payload: Any) -> None:
        storage.delete_directory(directory)
        log.append(
            AuditEventType.CHECKPOINT_REMOVED,
            {"trial_id": trial_id, "path": str(directory), "reason": reason, **payload},
            experiment_id=experiment_id,
        )
        removed.append((str(directory), reason))

    for directory in checkpoint_directories(run_dir, storage):
        known = by_name.get(directory.name)
        if known is not None:
            if known.state == CheckpointStatus.DELETED.value and not live:
                remove(directory, "deleted by GC, still on storage", checkpoint_id=known.id)
            elif not live and known.id is not None and not checkpoint_ledger_rows(store, known.id):
                _store_missing_ledger(store, known.id, directory, trust, storage)
            continue
        try:
            step = present_checkpoint(directory, trust, storage).step
        except CheckpointError as error:
            if not live:
                remove(directory, f"does not verify: {error}")
            continue
        if live and step >= below_step:  # type: ignore[operator]  # live: below_step is set
            continue
        twin = steps.get(step)
        if twin is not None:
            if not live:
                remove(directory, "duplicate", step=step, checkpoint_id=twin.id)
            continue
        record_report(step, checkpoint_report(directory))
        record = record_checkpoint_ledger(store, trial_id, str(directory), step, layers, trust)
        steps[step] = by_name[directory.name] = record
        log.append(
            AuditEventType.CHECKPOINT_RECOVERED,
            {"trial_id": trial_id, "path": str(directory), "step": step},
            experiment_id=experiment_id,
        )
        recorded.append(step)
    return Reconciliation(tuple(recorded), tuple(removed))


def _store_missing_ledger(
    store: TrackingStore, checkpoint_id: int, directory: Path, trust: TrustConfig, storage: Storage
) -> None:
    """The ledger of a recorded checkpoint whose rows a driver killed between recording it and
    storing them left out, stored from its verified state (left alone when it no longer verifies:
    the run's end falls back to an earlier checkpoint's)."""
    try:
        present_checkpoint(directory, trust, storage)  # (fetched into this node's cache if only there)
        store_checkpoint_ledger(store, checkpoint_id, trust)
    except CheckpointError:
        return
