"""A trial's state across its checkpoints: the governed step's weights, optimizer and ledger, the
controller's decisions and clean states, and where the run came from.

``TrialRun.save`` seals a signed checkpoint of all of it; ``restore`` resumes from one (the same
run, or a PBT clone continuing its donor); ``start_from`` begins a new run from another's weights
and ledger (fork, ``--from-checkpoint``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from govray.core.storage import Storage
from govray.governance.adapter_files import save_adapter
from govray.governance.memorization import MemorizationReport
from govray.train.checkpoints.base_file import FrozenBase
from govray.train.checkpoints.files import (
    MODEL_FILE,
    REPORT_FILE,
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    seal_checkpoint,
    sharding_layout,
)
from govray.train.checkpoints.folders import fetch_referenced
from govray.train.checkpoints.manifest import TrainedUnder, continued_history, continued_lineage
from govray.train.context import WorkerContext
from govray.train.control.controller import Controller
from govray.train.control.decisions import GateDecision, RollbackDecision
from govray.train.parallel.layouts import CleanState, Parts
from govray.train.reproduce.record import use_deterministic_mode
from govray.train.runspec import RUN_SPEC_FILE, RunSpec
from govray.train.step.governed import GovernedStep
from govray.train.step.ledger import Ledger
from govray.train.trial import make_trial


class TrialRun:
    """One worker's whole trial: the governed step, its controller, and the run's provenance."""

    def __init__(self, context: WorkerContext, governed: GovernedStep) -> None:
        spec = context.spec
        self.context = context
        self.governed = governed
        self.control: Controller[CleanState] = Controller(
            spec.lr_schedule, spec.early_stopping, spec.policy.memorization, spec.recorded_decisions
        )
        governed.scaling.scaler = self.control.scaler  # fp16's skips are the controller's decisions
        # The last checkpoint this run wrote or resumed from: under FSDP it holds the clean states
        # a rollback returns to (its own state, or the copies it carries of earlier ones).
        self.latest: tuple[Path, int] | None = None  # (folder, step)
        # The run ``latest``'s signed manifest must name (None: a folder handed over, ``own_run``).
        self.latest_run: str | None = None
        self.base = FrozenBase(spec.run_dir, context.storage)  # a frozen base is written once per run
        self.source: dict[str, Any] = {}  # the checkpoint a fork started from
        self.restored_from_run = ""  # the run that wrote the checkpoint this one resumed from
        self.last_report: MemorizationReport | None = None
        self.run_name = spec.run_name or Path(spec.run_dir).name
        self.layout = context.parallel.layout  # who writes checkpoints, where clean states live
        # What the layout writes and reads checkpoints with (never this run).
        self.parts = Parts(
            governed.model,
            governed.optimizer,
            governed.governor.parameters,
            context.parallel.sharding(),
            context.worker,
            context.storage,
            context.trust,
        )
        # [from_step, workers]: the world sizes the run trained on (summation order follows them).
        self.world_history: list[tuple[int, int]] = [(0, governed.worker.world_size)]
        # Who trained the state under which hyperparameters (a PBT clone continues its donor's).
        self.hparams_history = [TrainedUnder(from_step=0, run=self.run_name, hparams=spec.hparams)]

    @property
    def spec(self) -> RunSpec:
        return self.context.spec

    @property
    def storage(self) -> Storage:
        return self.context.storage

    @classmethod
    def open(cls, context: WorkerContext) -> TrialRun:
        """The trial the context's spec names, built for its worker (in deterministic mode if its
        settings say so)."""
        spec = context.spec
        use_deterministic_mode(spec.settings, context.worker.device)  # before the model is built
        return cls(context, GovernedStep(context, make_trial(spec.trial, spec.hparams, spec.settings)))

    @property
    def cloned_from_run(self) -> str | None:
        """A PBT clone: the run whose state this one continued."""
        return self.restored_from_run if self.restored_from_run not in ("", self.run_name) else None

    # -- decisions carried out ---------------------------------------------------------------------

    def rescheduled(self) -> None:
        self.governed.schedule = self.governed.scheduled(self.control.schedule_events())

    def gate(self, decisions: list[GateDecision]) -> None:
        self.control.gate(decisions)
        self.rescheduled()

    def roll_back(self, decision: RollbackDecision) -> None:
        """Back to the clean state at ``to_step`` (kept in memory, and in every checkpoint written
        since); the LR settings stay those in force now (a plateau cut is not undone)."""
        clean = self.control.rollback_target(decision)
        governed = self.governed
        governed.load_optimizer_state(self.layout.roll_back(self.parts, clean, self.latest, self.latest_run))
        governed.ledger = Ledger.from_json(clean.ledger)
        governed.take_hyperparameters()
        if self.control.plateau is not None:
            self.governed.set_lr_scale(self.control.lr_scale)
        self.rescheduled()

    def act_on_memorization(
        self, steps_done: int, report: MemorizationReport
    ) -> list[GateDecision | RollbackDecision]:
        """The controller's memorization decisions after this validation, carried out: roll back
        to the clean state, gate the flagged corpora; then the clean state moves on."""
        self.last_report = report
        gated = {gate.corpus_id for gate in self.control.gates}
        made = self.control.after_memorization(steps_done, report)
        for decision in made:
            if isinstance(decision, RollbackDecision):
                self.roll_back(decision)
        self.gate([d for d in made if isinstance(d, GateDecision)])
        self.control.settle_clean(steps_done, report, gated, made, self.governed.clean_state)
        return made

    def keep_clean(self, steps_done: int) -> None:
        self.control.keep_clean(steps_done, self.governed.clean_state)

    # -- checkpoints -------------------------------------------------------------------------------

    def checkpoint_state(self, steps_done: int) -> CheckpointState:
        schedule = self.governed.schedule
        return CheckpointState(
            step=steps_done,
            epoch=schedule.locate(steps_done)[0],
            seed=self.spec.seed,
            trial_seed=self.spec.trial_seed,
            schedule=schedule.to_json(),
            schedule_digest=schedule.digest(),
            policy_digest=self.spec.policy_digest,
            config_digest=self.spec.config_digest,
            ledger=self.governed.ledger.to_json(),
            adapters=list(self.governed.model.adapter_names()),
            reproducibility=self.spec.reproducibility,
            sharding=self.governed.parallel.sharding(),
            **self.control.state(),
            clean_ledgers={
                str(step): snap.ledger for step, snap in self.control.earlier_clean_states(steps_done)
            },
            memorization=self.last_report.model_dump(mode="json") if self.last_report else {},
            source=self.source,
            run=self.run_name,
            world_history=self.world_history,
            hparams_history=self.hparams_history,
        )

    def save(self, directory: Path, steps_done: int, report: Mapping[str, Any]) -> None:
        """Base and adapter weights, optimizer and governance state, and the ``report`` this
        checkpoint goes with, signed (the context's signer, asked by rank 0), as the run's layout
        writes them (``train.layouts``: under FSDP every rank calls it and writes its shards)."""
        directory.mkdir(parents=True, exist_ok=True)
        earlier = self.control.earlier_clean_states(steps_done)
        self.layout.save(
            self.parts,
            directory,
            lambda shards: self._seal(directory, steps_done, report, shards),
            earlier,
            self.latest,
        )
        self.latest, self.latest_run = (directory, steps_done), directory.resolve().parent.name

    def _seal(
        self, directory: Path, steps_done: int, report: Mapping[str, Any], shards: Sequence[str] | None
    ) -> None:
        """Rank 0: everything but the shards, then the signed manifest (``shards``: every rank's
        shard files, fetched here from object storage where this node lacks one: the signer
        hashes every file of the checkpoint itself)."""
        if self.context.worker.rank != 0:
            return
        model = self.governed.model
        referenced = self.layout.write_model(self.parts, self.base, directory)
        for adapter in model.adapter_names():
            save_adapter(model, adapter, directory / f"adapter-{adapter}.safetensors")
        self.layout.write_clean_states(
            self.parts, directory, self.control.earlier_clean_states(steps_done), self.latest
        )
        (directory / RUN_SPEC_FILE).write_bytes(self.spec.file_bytes())
        (directory / REPORT_FILE).write_text(json.dumps(dict(report), indent=1, sort_keys=True))
        for name in shards or ():
            self.context.storage.fetch(directory / name)
        optimizer = self.layout.optimizer_state(self.governed.optimizer.state_dict())
        seal_checkpoint(
            directory,
            optimizer,
            self.checkpoint_state(steps_done),
            self.context.signer,
            referenced,
            sharded=shards is not None,
        )

    def _check_schedule(self, directory: Path, state: CheckpointState) -> None:
        schedule = self.governed.schedule
        if state.schedule.get("version") != schedule.version:
            raise CheckpointError(
                f"{directory}: written on schedule version {state.schedule.get('version')}, this run "
                f"is on version {schedule.version}"
            )
        if state.schedule_digest != schedule.digest():
            raise CheckpointError(
                f"{directory}: its schedule inputs differ from this run's (a different run?)"
            )

    def restore(self, directory: Path, of_run: str | None = None) -> int:
        """Resume from a verified checkpoint (as the run's layout reads it: under FSDP each rank
        its own part, every rank refusing if any did); returns the steps it had completed.
        ``of_run``: the run its signed manifest must name (``layouts.own_run``)."""
        loaded = self.layout.load(self.parts, directory, of_run)
        self.control.restore(loaded.state)
        self._continue_world(loaded.state)
        self.rescheduled()
        self._check_schedule(directory, loaded.state)
        governed = self.governed
        governed.load_weights(directory, loaded.manifest)
        self.base.resumed(directory, governed.model)
        governed.load_optimizer_state(loaded.optimizer_state)
        governed.take_hyperparameters()
        governed.ledger = Ledger.from_json(loaded.state.ledger)
        self.source = loaded.state.source
        self.restored_from_run = loaded.state.run
        self._continue_lineage(loaded.state)
        if self.control.plateau is not None and loaded.state.plateau:
            governed.set_lr_scale(self.control.lr_scale)
        if loaded.state.memorization:
            self.last_report = MemorizationReport.model_validate(loaded.state.memorization)
        self.latest, self.latest_run = (directory, loaded.state.step), of_run
        self.control.clean_states = self.layout.clean_states(loaded)
        if self.control.clean_step == loaded.state.step or self.control.replayed_rollbacks is not None:
            self.keep_clean(loaded.state.step)  # this checkpoint is itself the (or a recorded) target
            if loaded.state.step in self.control.clean_states:
                self._refuse_clean_elsewhere(directory, loaded.state)
        return loaded.state.step

    def _continue_world(self, state: CheckpointState) -> None:
        """The checkpoint's schedule continues (its slots per step, whatever this world's size:
        ``train.rounds``), and this world size joins its history if it changed
        (:func:`continued_history`)."""
        slots = int(state.schedule["world_size"])
        self.governed.resume_slots(slots)
        history = [(int(step), int(workers)) for step, workers in state.world_history]
        self.world_history = continued_history(history, state.step, self.governed.worker.world_size)

    def _continue_lineage(self, state: CheckpointState) -> None:
        """This run and its hyperparameters continue the checkpoint's history from its step (a
        resume of its own: nothing changes; a PBT clone: its donor's entries, then its own)."""
        entry = TrainedUnder(from_step=state.step, run=self.run_name, hparams=self.spec.hparams)
        self.hparams_history = continued_lineage(list(state.hparams_history), state.step, entry)

    def _refuse_clean_elsewhere(self, directory: Path, state: CheckpointState) -> None:
        """The layout refuses clean states it cannot keep (FSDP: another layout's shard files)."""
        written = sharding_layout(state.sharding)
        self.layout.refuse_clean_elsewhere(directory, written, self.parts.own_layout)

    def start_from(self, directory: Path) -> None:
        """Begin at step 0 from another run's verified checkpoint: its weights (base, and adapters
        both runs have) and its ledger — what reached the weights stays on the record. The
        optimizer starts fresh; the source is kept in every checkpoint of this run."""
        fetch_referenced(directory, self.storage)
        loaded = load_checkpoint(directory, self.context.trust)
        try:
            self.governed.load_weights(directory, loaded.manifest, adapters_present_only=True)
        except RuntimeError as error:
            raise CheckpointError(
                f"{directory / MODEL_FILE} does not fit this trial's model: {error}"
            ) from None
        self.governed.ledger = Ledger.from_json(loaded.state.ledger)
        self.source = {
            "path": str(directory),
            "manifest_sha256": loaded.manifest_digest,
            "signer": loaded.signer,
            "step": loaded.state.step,
            "config_digest": loaded.state.config_digest,
            "policy_digest": loaded.state.policy_digest,
            **self.spec.start_model,
        }
