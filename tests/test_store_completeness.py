"""The store stays complete when workers die: every checkpoint folder on storage is recorded (or
removed, audited), every report is stored once, and resume takes the newest verified checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from govray.core.keys import platform_key, platform_trust
from govray.core.storage import open_storage
from govray.platform.run.recorder import GcSettings, RunRecorder
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import checkpoints, ledger_rows, record_checkpoint
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import (
    MODEL_FILE,
    REPORT_FILE,
    STATE_FILE,
    checkpoint_step,
    verify_checkpoint,
)
from govray.train.checkpoints.folders import checkpoint_directories, newest_verified_checkpoint
from govray.train.run.reports import StepReport
from jobs.examples.digits.golden import GOLDEN_REPORT_EVERY, GOLDEN_STEPS
from tests.helpers.golden import GoldenRun
from tests.helpers.killed_run import run_killing_a_worker

REPORTED_STEPS = list(range(GOLDEN_REPORT_EVERY, GOLDEN_STEPS + 1, GOLDEN_REPORT_EVERY))


def trust() -> Any:
    return platform_trust(platform_key())


def by_step(run_dir: Path) -> dict[int, Path]:
    return {checkpoint_step(directory): directory for directory in checkpoint_directories(run_dir)}


@pytest.fixture
def run_copy(golden_run: GoldenRun, tmp_path: Path) -> Path:
    """The golden run's Ray Train directory (checkpoints of steps 10, 20, 30), copied."""
    copy = tmp_path / "storage" / "ray" / golden_run.outcome.run_dir.name
    shutil.copytree(golden_run.outcome.run_dir, copy)
    return copy


def fresh_recorder(
    golden_run: GoldenRun, run_copy: Path, tmp_path: Path, name: str
) -> tuple[TrackingStore, int, int, RunRecorder]:
    """A store of the test's own with one experiment and trial, and the run's recorder over
    ``run_copy``: (store, experiment id, trial id, recorder)."""
    store = TrackingStore.open(f"sqlite:///{tmp_path / 'tracking.db'}")
    storage_path = str(tmp_path / "storage")
    experiment = store.create_experiment(name, golden_run.config.model_dump_json(), "d", storage_path)
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=0)
    assert trial.id is not None
    recorder = RunRecorder(
        store,
        trial.id,
        golden_run.checked.routing.tensor_layers(),
        GcSettings(experiment.id, "validation_loss", smaller_is_better=True),
        storage=open_storage(storage_path),
        run_dir=str(run_copy),
        trust=trust(),
    )
    return store, experiment.id, trial.id, recorder


def test_every_checkpoint_carries_the_report_it_was_reported_with(golden_run: GoldenRun) -> None:
    store, trial_id = golden_run.store, golden_run.outcome.trial_id
    for step, directory in by_step(golden_run.outcome.run_dir).items():
        verify_checkpoint(directory, trust())  # report.json is signed in the manifest
        report = StepReport.parse(json.loads((directory / REPORT_FILE).read_text()))
        assert report.step == step
        stored = {m.name: m.value for m in store.metrics(trial_id) if m.step == step}
        assert stored["training_loss"] == report.metrics["training_loss"]
        assert stored["validation_loss"] == report.metrics["validation_loss"]


def test_resume_takes_the_newest_checkpoint_that_verifies(run_copy: Path) -> None:
    folders = by_step(run_copy)
    assert newest_verified_checkpoint(run_copy, trust()) == folders[30]
    # A newer folder a killed worker only half uploaded is passed over, and so is a tampered one.
    partial = run_copy / "checkpoint_9999-partial"
    shutil.copytree(folders[30], partial)
    (partial / MODEL_FILE).unlink()
    state = folders[30] / STATE_FILE
    state.write_text(state.read_text().replace('"step": 30', '"step": 31'))
    assert newest_verified_checkpoint(run_copy, trust()) == folders[20]
    (run_copy / "checkpoint_empty").mkdir()  # no manifest at all: not a checkpoint yet
    assert newest_verified_checkpoint(run_copy, trust()) == folders[20]


def test_reconciliation_records_lost_reports_and_removes_partial_and_duplicate_folders(
    golden_run: GoldenRun, run_copy: Path, tmp_path: Path
) -> None:
    """Ray delivered only the step-10 report; the step-20 and step-30 reports died with a worker
    (their folders are on storage), a partial and a duplicate folder lie beside them."""
    store, experiment_id, trial_id, callback = fresh_recorder(golden_run, run_copy, tmp_path, "lost-reports")
    folders = by_step(run_copy)
    partial, duplicate = run_copy / "checkpoint_zz-partial", run_copy / "checkpoint_zz-duplicate"
    shutil.copytree(folders[30], partial)
    (partial / MODEL_FILE).unlink()
    shutil.copytree(folders[10], duplicate)
    delivered = StepReport.parse(json.loads((folders[10] / REPORT_FILE).read_text()))
    callback.record(delivered.model_copy(update={"checkpoint": str(folders[10])}))

    # Live (at the step-20 report of a restarted group) it records the lost step-10... here none:
    # only folders below the reported step, and it removes nothing while workers may write.
    live = callback.reconcile(below_step=20)
    assert live.recorded == () and live.removed == ()
    assert partial.is_dir() and duplicate.is_dir()

    done = callback.reconcile()
    assert done.recorded == (20, 30)
    assert {(Path(path).name, reason.split(":")[0]) for path, reason in done.removed} == {
        (partial.name, "does not verify"),
        (duplicate.name, "duplicate"),
    }
    assert MODEL_FILE in dict(done.removed)[str(partial)]  # the reason names the missing file
    assert sorted(path.name for path in checkpoint_directories(run_copy)) == sorted(
        folder.name for folder in folders.values()
    )
    assert [(c.step, Path(c.path).name) for c in checkpoints(store, trial_id)] == [
        (step, folders[step].name) for step in REPORTED_STEPS
    ]
    # The lost reports are stored from the checkpoints, exactly what the golden run stored.
    original = golden_run.store
    for name in ("training_loss", "validation_loss", "examples", "objective"):
        mine = [(m.step, m.value) for m in store.metrics(trial_id, name)]
        theirs = [(m.step, m.value) for m in original.metrics(golden_run.outcome.trial_id, name)]
        assert mine == theirs, name
    ledger = {(r.corpus_id, r.parameter, r.examples, r.steps) for r in ledger_rows(store, trial_id)}
    golden = {
        (r.corpus_id, r.parameter, r.examples, r.steps)
        for r in ledger_rows(original, golden_run.outcome.trial_id)
    }
    assert ledger == golden and ledger
    log = AuditLog(store)
    recovered = log.list(experiment_id, AuditEventType.CHECKPOINT_RECOVERED)
    assert [json.loads(event.payload_json)["step"] for event in recovered] == [20, 30]
    assert len(log.list(experiment_id, AuditEventType.CHECKPOINT_REMOVED)) == 2
    # Settled: a second reconciliation changes nothing.
    again = callback.reconcile()
    assert again.recorded == () and again.removed == ()
    assert log.verify() == 4
    store.close()


def test_a_checkpoint_recorded_without_its_ledger_has_it_stored_when_the_run_settles(
    golden_run: GoldenRun, run_copy: Path, tmp_path: Path
) -> None:
    """A driver killed between recording a checkpoint and storing its ledger left a record without
    rows: the run's next start (or end) stores them from the verified state, and the trial's
    ledger is the golden run's."""
    store, _, trial_id, recorder = fresh_recorder(golden_run, run_copy, tmp_path, "no-ledger")
    for step, folder in by_step(run_copy).items():
        record_checkpoint(store, trial_id, str(folder), step)  # (killed before the ledger went in)
    assert ledger_rows(store, trial_id) == []
    assert recorder.reconcile().recorded == ()  # nothing new recorded ...
    ledger = {(r.corpus_id, r.parameter, r.examples, r.steps) for r in ledger_rows(store, trial_id)}
    golden = {
        (r.corpus_id, r.parameter, r.examples, r.steps)
        for r in ledger_rows(golden_run.store, golden_run.outcome.trial_id)
    }
    assert ledger == golden and ledger  # ... and the ledger stored
    store.close()


def test_a_folder_gc_deleted_but_left_on_storage_is_deleted_again(
    golden_run: GoldenRun, run_copy: Path, tmp_path: Path
) -> None:
    store = TrackingStore.open(f"sqlite:///{tmp_path / 'tracking.db'}")
    storage_path = str(tmp_path / "storage")
    experiment = store.create_experiment(
        "gc-leftover", golden_run.config.model_dump_json(), "d", storage_path
    )
    trial = store.create_trial(experiment.id or 0, "{}", seed=0)
    folders = by_step(run_copy)
    for step, folder in folders.items():
        record_checkpoint(store, trial.id or 0, str(folder), step)
    from govray.platform.gc import _mark_deleted

    _mark_deleted(store, checkpoints(store, trial.id or 0)[0].id or 0)  # GC crashed before the rmtree
    callback = RunRecorder(
        store,
        trial.id or 0,
        {},
        GcSettings(experiment.id or 0, "validation_loss", smaller_is_better=True),
        storage=open_storage(storage_path),
        run_dir=str(run_copy),
        trust=trust(),
    )
    done = callback.reconcile()
    assert done.recorded == () and [Path(path).name for path, _ in done.removed] == [folders[10].name]
    assert not folders[10].exists() and folders[20].exists()
    store.close()


# --- workers killed at random moments of a real run ---------------------------------------------


# Seed 0 (the kill that loses a report) in the slow tier (a whole killed Ray run, ~50 s); more
# seeds with the cluster tier.
@pytest.mark.parametrize(
    "seed",
    [
        pytest.param(0, marks=pytest.mark.slow),
        pytest.param(1, marks=pytest.mark.cluster),
        pytest.param(2, marks=pytest.mark.cluster),
    ],
)
def test_killed_workers_leave_a_complete_store_and_identical_weights(
    golden_run: GoldenRun, golden_example: Path, seed: int
) -> None:
    killed, how = run_killing_a_worker(golden_run, golden_example, seed)
    store, trial_id, run_dir = killed.store, killed.outcome.trial_id, killed.outcome.run_dir
    original = by_step(golden_run.outcome.run_dir)[GOLDEN_STEPS]
    final = by_step(run_dir)[GOLDEN_STEPS]
    for name in (MODEL_FILE, "adapter-pii-lora.safetensors", "optimizer.safetensors", "optimizer.json"):
        assert (original / name).read_bytes() == (final / name).read_bytes(), f"{how}: {name}"
    assert (
        json.loads((original / STATE_FILE).read_text())["ledger"]
        == json.loads((final / STATE_FILE).read_text())["ledger"]
    )
    # Every reported step's metrics, once each.
    for name in ("examples", "training_loss", "validation_loss"):
        assert [m.step for m in store.metrics(trial_id, name)] == REPORTED_STEPS, f"{how}: {name}"
    # Every checkpoint folder on storage is recorded, one per step, nothing else is left there.
    on_storage = sorted(path.name for path in checkpoint_directories(run_dir))
    recorded = checkpoints(store, trial_id)
    assert sorted(Path(c.path).name for c in recorded) == on_storage, how
    assert [c.step for c in recorded] == REPORTED_STEPS, how
    assert all(c.state == "active" for c in recorded)
    assert AuditLog(store).verify() > 0
    experiment_id = store.get_trial(trial_id).experiment_id
    recovered = [
        json.loads(event.payload_json)
        for event in AuditLog(store).list(experiment_id, AuditEventType.CHECKPOINT_RECOVERED)
        if json.loads(event.payload_json)["trial_id"] == trial_id
    ]
    # (each recovered checkpoint's report is among the metrics checked above: every checkpoint keeps one)
    assert all(event["step"] in REPORTED_STEPS for event in recovered)
    print(
        f"seed {seed} ({how}): reports recovered from checkpoints at steps {[e['step'] for e in recovered]}"
    )
