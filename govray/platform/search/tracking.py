"""The search's rows in the tracking store, written by the driver alone (a Tune ``Callback``).

Each Tune trial gets a ``RunRecorder`` (one owner per row): its trial row (found by run name when
a restored search meets it again; created with the search's reproducibility record, as a run's
trial is, so any trial can be replayed), states, reports, checkpoints, decisions, ledgers and
attestations; checkpoint GC runs over every trial's recorded checkpoints. Its ``PlacementGuard``
frees the placement group of each N-worker trial that stops running (Ray would keep it).
"""

from __future__ import annotations

import json
from typing import Any

import ray.tune

from govray.config.experiment import ExperimentConfig
from govray.core.storage import Storage
from govray.platform.run.recorder import GcSettings, RunRecorder
from govray.platform.run.runner import last_step
from govray.platform.search.placement_guard import PlacementGuard
from govray.platform.search.tune_trial import trial_run_name
from govray.signer.attesting import attest_trial_end
from govray.tracking.store import TrackingStore
from govray.tracking.tables import DecisionKind, TrialState
from govray.tracking.tensorboard import TensorBoardLog, tensorboard_dir
from govray.train.checkpoints.files import checkpoint_step
from govray.train.run.session import LAST_KEY, tune_reports


class SearchTracking(ray.tune.Callback):
    """On the driver: the search's trials in the tracking store, each through its ``RunRecorder``
    (one owner per row)."""

    def __init__(
        self,
        database_url: str,
        config: ExperimentConfig,
        storage: Storage,
        layers: dict[str, int | None],
        gc: GcSettings,
        reproducibility: str,
    ) -> None:
        self.database_url = database_url
        self.reproducibility = reproducibility  # the search's record (JSON), kept by every trial row
        self.experiment_id = gc.experiment_id
        self.config = config
        self.storage = storage
        self.layers = layers
        self.gc = gc
        self._store: TrackingStore | None = None
        self.recorders: dict[str, RunRecorder] = {}  # Tune trial id → its trial's recorder
        self.guard = PlacementGuard()

    @property
    def store(self) -> TrackingStore:
        if self._store is None:
            self._store = TrackingStore.open(self.database_url)
        return self._store

    def recorder(self, trial: Any) -> RunRecorder:
        """The trial's recorder; its row is created on first sight (a restored search finds its
        rows by run name)."""
        if trial.trial_id in self.recorders:
            return self.recorders[trial.trial_id]
        run_name = trial_run_name(self.config, trial.trial_id)
        known = [t for t in self.store.list_trials(self.experiment_id) if t.ray_run_name == run_name]
        if known:
            row_id = known[0].id
        else:
            hparams = {name: trial.config[name] for name in self.config.hyperparameters}
            created = self.store.create_trial(self.experiment_id, json.dumps(hparams, sort_keys=True), seed=0)
            row_id = created.id
            assert row_id is not None
            self.store.set_trial_reproducibility(row_id, self.reproducibility)  # what a replay reruns
            self.store.set_trial_state(row_id, TrialState.ACTIVE, ray_run_name=run_name)
        assert row_id is not None
        root = self.storage.root
        self.recorders[trial.trial_id] = RunRecorder(
            self.store,
            row_id,
            self.layers,
            self.gc,
            events=TensorBoardLog(tensorboard_dir(root, run_name)),
            storage=self.storage,
        )
        return self.recorders[trial.trial_id]

    def row(self, trial: Any) -> int:
        return self.recorder(trial).trial_id

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.store.set_trial_state(self.row(trial), TrialState.ACTIVE)

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        self.guard.note(trial.trial_id, result)
        recorder = self.recorder(trial)
        for report in tune_reports(result):
            recorder.record_once(report)  # a restarted trial re-reports the steps after its checkpoint

    def on_checkpoint(
        self, iteration: int, trials: list[Any], trial: Any, checkpoint: Any, **info: Any
    ) -> None:
        # Tune's copy, by its path in this node's cache (recorded with the stored manifest's digest)
        path = self.storage.cached(checkpoint.path)
        self.recorder(trial).record_checkpoint(str(path), checkpoint_step(path))

    def collect_garbage(self) -> None:
        RunRecorder.collect_all(self.store, self.gc, self.storage)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        # A paused trial (PBT) or one that errored: its run's group goes too.
        self.guard.sweep(t.trial_id for t in trials if t.status == "RUNNING")

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self.guard.release_all()

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.guard.release(trial.trial_id)  # ASHA's stop: Tune dropped the trial's actor mid-run
        row_id = self.row(trial)
        if not trial.last_result.get(LAST_KEY):  # stopped by the scheduler first: a recorded early stop
            seq = len(self.store.decisions(row_id))
            step = last_step(self.store, row_id)
            decision = {
                "seq": seq,
                "step": step,
                "kind": DecisionKind.EARLY_STOP.value,
                "reason": "scheduler",
                "metric": self.config.searcher.metric,
                "observed": None,
            }
            self.store.record_decisions(row_id, [decision], replayed=False)
        attested = attest_trial_end(self.store, row_id)  # its last checkpoint, signed provenance and coverage
        if attested is not None:  # kept next to the checkpoint, in object storage too
            self.storage.upload(attested.provenance, attested.coverage)
        self.store.set_trial_state(row_id, TrialState.COMPLETED)
        self._close_events(trial)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.guard.release(trial.trial_id)
        self.store.set_trial_state(self.row(trial), TrialState.ERRORED)
        self._close_events(trial)

    def _close_events(self, trial: Any) -> None:
        if (recorder := self.recorders.get(trial.trial_id)) is not None and recorder.events is not None:
            recorder.events.publish(self.storage)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None, "recorders": {}}
