"""The governed training loop that runs on every Ray Train worker (or in-process, one worker).

The step, top to bottom::

    slots = step_slots(schedule, step)            # the schedule: one route and its rows per worker
    seed per (experiment, trial, step, rank)      # no RNG stream carried across steps
    activate the slot's adapter (or none)         # base weights never see another route's adapter
    losses = trial.loss(model, batch)             # per-example losses
    losses.sum().backward()                       # DDP comm hook: mask, scale 1/|S|, allreduce
    governor.finish_step()                        # grad None where no slot may update; NaN; clip
    optimizer.step()
    ledger.record_step(slots, routing)            # what reached which tensor, from the schedule
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from govray.adapters import GovernedModel, load_adapter, save_adapter, save_base
from govray.allreduce import GradientGovernor, governed_allreduce_hook, parameters_by_name
from govray.canaries import CanaryProbe
from govray.checkpoint import (
    MODEL_FILE,
    REPORT_FILE,
    RUN_SPEC_FILE,
    CheckpointError,
    CheckpointState,
    load_checkpoint,
    load_clean_states,
    newest_verified_checkpoint,
    save_clean_state,
    seal_checkpoint,
)
from govray.config import EarlyStoppingPolicy, PlateauSchedule
from govray.data.shards import ShardSet
from govray.decisions import (
    DecisionError,
    EarlyStopDecision,
    EarlyStopping,
    EarlyStopState,
    GateDecision,
    LrDecision,
    Plateau,
    PlateauState,
    RecordedDecision,
    RollbackDecision,
)
from govray.harness.dashboard import GovernanceMetrics
from govray.harness.probe import MemorizationProbe
from govray.harness.trial import Trial, importable, make_trial
from govray.harness.worker import RouteRows, Worker, all_reduce_sums
from govray.keys import SigningKey, TrustConfig
from govray.ledger import Ledger
from govray.logs import WorkerLog
from govray.memorization import (
    MemorizationReport,
    MemorizationThresholds,
    memorization_report,
    objective,
)
from govray.policy import DepthPolicy
from govray.reproducibility import CodeSnapshot, use_recorded_code
from govray.routing import RoutingTable, resolve_routes
from govray.runtime import ray_node_id
from govray.schedule import ScheduleEvent, ScheduleSpec, derive_seed, route_counts, step_slots
from govray.storage import StorageError, open_storage
from govray.training import TrainingSettings

Report = Callable[[dict[str, Any], str | None], None]  # (metrics, checkpoint directory or None)
REPLAY_ONLY = EarlyStoppingPolicy(patience=1)  # settings of a rule that only replays a record
STOP_CODES = {"pause": 1, "kill": 2}  # what the driver writes in the control file
STOP_NAMES = {code: name for name, code in STOP_CODES.items()}


class RunSpec(BaseModel):
    """Everything a worker needs, as JSON (it crosses process and node boundaries)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trial: str
    hparams: dict[str, Any]
    # The experiment's training settings with hparams applied; None in a spec written before
    # they were recorded (the trial resolves hparams over the defaults, as it did then).
    settings: TrainingSettings | None = None
    policy: DepthPolicy
    shard_root: str
    seed: int
    trial_seed: int
    max_steps: int
    report_every: int
    threads: int = 1
    excluded_corpora: tuple[str, ...] = ()
    code_dir: str = ""  # the driver's working directory: where the trial's module is importable
    # code_dir is the trial's recorded code snapshot (replay, resume): verified, imported from there.
    recorded_code: bool = False
    checkpoint_period: int = 100  # steps between signed checkpoints (and one at the end)
    platform_key: str = ""  # path of the platform's private key on the worker's node (signs checkpoints)
    trust: TrustConfig = TrustConfig()  # platform keys whose checkpoints a resume accepts
    config_digest: str = ""
    policy_digest: str = ""
    run_dir: str = ""  # in local mode (no Ray Train controller) checkpoints are written here
    reproducibility: dict[str, Any] = {}  # the trial's ReproducibilityRecord, kept in every checkpoint
    validation_period: int | None = None  # steps between validations (each saves a checkpoint)
    lr_schedule: PlateauSchedule | None = None
    # A replay applies its source trial's decisions instead of taking its own.
    recorded_decisions: tuple[RecordedDecision, ...] | None = None
    early_stopping: EarlyStoppingPolicy | None = None
    # Rank 0 reads a pause/kill request from this file at every step boundary (the driver writes it).
    control_file: str = ""
    control_period: int = 5  # steps between looks (a broadcast costs ~0.3 ms on 2 CPU workers)
    # Start (not resume) from this checkpoint's weights and ledger: fork / --from-checkpoint.
    start_checkpoint: str = ""
    # ... when that checkpoint is a registered model version: its uri, and its provenance
    # attestation's file name and sha256 (the run's attestation lists it as a dependency).
    start_model: dict[str, str] = {}
    log_dir: str = ""  # each rank appends to LOG_DIR/rank-N.log
    # Object storage (s3://...) whose node-local cache holds shard_root, run_dir and control_file:
    # workers fetch from it what their node lacks, and local mode uploads its checkpoints to it.
    storage: str = ""
    run_name: str = ""  # the trial's run (a search trial's segments and scratch dirs share it)
    experiment: str = ""  # the experiment's name (a tag of the exported governance metrics)
    # Start from this verified checkpoint's full state (Ray's own checkpoint comes first): a Tune
    # trial restored, or a PBT clone continuing its donor.
    resume_checkpoint: str = ""
    # The search objective, reported at every validation: metric + lambda * memorization_score.
    objective_metric: str = "validation_loss"
    smaller_is_better: bool = True
    memorization_lambda: float = 0.0
    canaries: dict[str, CanaryProbe] = Field(default_factory=dict)  # corpus → its canaries


@dataclass(frozen=True)
class _Snapshot:
    """A clean state kept in memory: what a rollback restores."""

    step: int
    weights: dict[str, torch.Tensor]  # GovernedModel.state_dict(): base and adapters
    optimizer: dict[str, Any]
    ledger: dict[str, Any]


def allowed_route_sets(model: GovernedModel, table: RoutingTable) -> list[frozenset[str]]:
    """For every trainable tensor of ``model`` (in order), the routes that may update it."""
    by_id: dict[int, frozenset[str]] = {
        id(parameter): frozenset(table.routes_updating(name))
        for name, parameter in model.base.named_parameters()
    }
    for route, adapter in table.adapter_names.items():
        for parameter in model.adapter_parameters(adapter):
            by_id[id(parameter)] = frozenset({route})
    return [by_id[id(parameter)] for _, parameter in parameters_by_name(model)]


class GovernedTraining:
    """Model, optimizer, governor and ledger of one worker; ``step()`` is one governed step."""

    def __init__(self, spec: RunSpec, worker: Worker) -> None:
        self.spec = spec
        self.worker = worker
        self.trial: Trial = make_trial(spec.trial, spec.hparams, spec.settings)
        torch.manual_seed(derive_seed(spec.seed, spec.trial_seed, "init"))
        base = self.trial.build_model()
        self.routing = resolve_routes(spec.policy, base, self.trial.layers(base))
        self.model = GovernedModel(
            base, self.routing, spec.policy.adapters, seed=derive_seed(spec.seed, "adapters")
        )
        self.shards = ShardSet.fetch(Path(spec.shard_root), spec.storage)
        self.gates: list[GateDecision] = []
        self.rollbacks: list[RollbackDecision] = []
        self.schedule = self._schedule()
        self.rows = RouteRows(self.shards)
        self.tokens = self.rows.tokens(self.trial)
        named = parameters_by_name(self.model)
        self.governor = GradientGovernor(named, allowed_route_sets(self.model, self.routing))
        self.forward: nn.Module = self.model
        if worker.distributed:
            ddp = DistributedDataParallel(
                self.model,
                broadcast_buffers=False,  # running statistics are refused by routing, never synced
                find_unused_parameters=bool(self.routing.adapter_names),  # inactive adapters
            )
            ddp.register_comm_hook(self.governor, governed_allreduce_hook)
            self.forward = ddp
        self.trainable = [parameter for _, parameter in named]
        self.optimizer = self.trial.build_optimizer(self.trainable)
        for group in self.optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])  # decisions scale it
        recorded = spec.recorded_decisions
        lr_record = None if recorded is None else [d for d in recorded if isinstance(d, LrDecision)]
        stop_record = None if recorded is None else [d for d in recorded if isinstance(d, EarlyStopDecision)]
        self.plateau = Plateau(spec.lr_schedule, recorded=lr_record) if spec.lr_schedule else None
        # A replay stops where its source stopped, also when a scheduler (ASHA) made that call.
        self.early = (
            EarlyStopping(spec.early_stopping or REPLAY_ONLY, recorded=stop_record)
            if spec.early_stopping or stop_record
            else None
        )
        self.gate_record = None if recorded is None else [d for d in recorded if isinstance(d, GateDecision)]
        self.rollback_record = (
            None if recorded is None else [d for d in recorded if isinstance(d, RollbackDecision)]
        )
        # Rollback targets: the last clean state (a replay keeps those its record goes back to).
        self.snapshots: dict[int, _Snapshot] = {}
        self.clean_step: int | None = None
        self.last_report: MemorizationReport | None = None
        self.probe = MemorizationProbe(
            self.trial,
            self.model,
            self.routing,
            self.shards,
            self.rows,
            spec.policy,
            spec.canaries,
            derive_seed(spec.seed, spec.trial_seed),
            worker,
        )
        self.ledger = Ledger()
        self.source: dict[str, Any] = {}
        self._stop_check: tuple[torch.Tensor, Any] | None = None
        self.restored_from_run = ""  # the run that wrote the checkpoint this one resumed from
        self.run_name = spec.run_name or Path(spec.run_dir).name
        # Rank 0 sees every slot of every step: it alone exports the dashboard's counters.
        self.exported = GovernanceMetrics(spec.experiment, self.run_name) if worker.rank == 0 else None

    def step(self, step: int) -> tuple[float, int]:
        """One governed step; returns this worker's (loss sum, examples)."""
        # Every few steps rank 0 looks for a pause/kill request; ``stop_request()`` answers after the step.
        checks = (step + 1) % self.spec.control_period == 0
        self._stop_check = self._start_stop_check() if checks else None
        slots = step_slots(self.schedule, step)
        mine = slots[self.worker.rank]
        torch.manual_seed(derive_seed(self.spec.seed, self.spec.trial_seed, step, self.worker.rank))
        route = None if mine.empty else mine.route
        self.governor.begin_step(step, route, route_counts(slots))
        adapter = self.routing.adapter_names.get(route) if route is not None else None
        self.model.train()
        with self.model.active(adapter):
            batch = self.trial.collate(self.rows.take(mine))
            losses = self.trial.loss(self.forward, batch)
            losses.sum().backward()
        if not self.worker.distributed:
            self.governor.govern_local()
        self.governor.finish_step(self.trial.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ledger.record_step(slots, self.routing, self.tokens)
        if self.exported is not None:
            self.exported.record_step(slots, self.governor.masked_fraction())
        return float(losses.detach().sum()), len(mine.rows)

    def checkpoint_state(self, steps_done: int) -> CheckpointState:
        return CheckpointState(
            step=steps_done,
            epoch=self.schedule.locate(steps_done)[0],
            seed=self.spec.seed,
            trial_seed=self.spec.trial_seed,
            schedule=self.schedule.to_json(),
            schedule_digest=self.schedule.digest(),
            policy_digest=self.spec.policy_digest,
            config_digest=self.spec.config_digest,
            ledger=self.ledger.to_json(),
            adapters=list(self.model.adapter_names()),
            reproducibility=self.spec.reproducibility,
            plateau=self.plateau.state.model_dump(mode="json") if self.plateau else {},
            early_stopping=self.early.state.model_dump(mode="json") if self.early else {},
            gates=[gate.model_dump(mode="json") for gate in self.gates],
            rollbacks=[rollback.model_dump(mode="json") for rollback in self.rollbacks],
            clean_step=self.clean_step,
            clean_ledgers={str(snap.step): snap.ledger for snap in self._earlier_snapshots(steps_done)},
            memorization=self.last_report.model_dump(mode="json") if self.last_report else {},
            source=self.source,
            run=self.run_name,
        )

    def save_checkpoint(
        self, directory: Path, steps_done: int, key: SigningKey, report: Mapping[str, Any]
    ) -> None:
        """Base and adapter weights, optimizer and governance state, and the ``report`` this
        checkpoint goes with, signed by the platform key."""
        directory.mkdir(parents=True, exist_ok=True)
        save_base(self.model, directory / MODEL_FILE)
        for adapter in self.model.adapter_names():
            save_adapter(self.model, adapter, directory / f"adapter-{adapter}.safetensors")
        for snapshot in self._earlier_snapshots(steps_done):  # rollback targets survive a resume
            save_clean_state(directory, snapshot.step, snapshot.weights, snapshot.optimizer)
        (directory / RUN_SPEC_FILE).write_text(self.spec.model_dump_json(indent=1))
        (directory / REPORT_FILE).write_text(json.dumps(dict(report), indent=1, sort_keys=True))
        seal_checkpoint(directory, self.optimizer.state_dict(), self.checkpoint_state(steps_done), key)

    def _earlier_snapshots(self, steps_done: int) -> list[_Snapshot]:
        return [snapshot for step, snapshot in sorted(self.snapshots.items()) if step != steps_done]

    def _schedule(self) -> ScheduleSpec:
        """The run's schedule with its gates and rollbacks as events (a gate only empties later
        slots; a rollback changes no slot)."""
        events = [ScheduleEvent(step=gate.step, kind="gate", corpus_id=gate.corpus_id) for gate in self.gates]
        events += [ScheduleEvent(step=r.step, kind="rollback", to_step=r.to_step) for r in self.rollbacks]
        return ScheduleSpec.from_manifest(
            self.shards.manifest,
            seed=derive_seed(self.spec.seed, self.spec.trial_seed, "schedule"),
            world_size=self.worker.world_size,
            batch_size=self.trial.batch_size,
            excluded_corpora=self.spec.excluded_corpora,
            events=events,
        )

    def gate(self, decisions: Sequence[GateDecision]) -> None:
        self.gates.extend(decisions)
        self.schedule = self._schedule()

    def restore(self, directory: Path) -> int:
        """Resume from a verified checkpoint; returns the number of steps it had completed."""
        loaded = load_checkpoint(directory, self.spec.trust)
        self.gates = [GateDecision.model_validate(gate) for gate in loaded.state.gates]
        self.rollbacks = [RollbackDecision.model_validate(rollback) for rollback in loaded.state.rollbacks]
        self.schedule = self._schedule()
        if loaded.state.schedule_digest != self.schedule.digest():
            raise CheckpointError(
                f"{directory}: its schedule inputs differ from this run's (a different run?)"
            )
        self._load_weights(directory)
        self.optimizer.load_state_dict(loaded.optimizer_state)
        self._take_hyperparameters()
        self.ledger = Ledger.from_json(loaded.state.ledger)
        self.source = loaded.state.source
        self.restored_from_run = loaded.state.run
        if self.plateau is not None and loaded.state.plateau:
            self.plateau.state = PlateauState.model_validate(loaded.state.plateau)
            self._apply_lr_scale()
        if self.early is not None and loaded.state.early_stopping:
            self.early.state = EarlyStopState.model_validate(loaded.state.early_stopping)
        if loaded.state.memorization:
            self.last_report = MemorizationReport.model_validate(loaded.state.memorization)
        self.clean_step = loaded.state.clean_step
        self.snapshots = {
            step: _Snapshot(step, weights, optimizer, loaded.state.clean_ledgers[str(step)])
            for step, (weights, optimizer) in load_clean_states(loaded).items()
        }
        if self.clean_step == loaded.state.step or self.rollback_record is not None:
            self.keep_clean(loaded.state.step)  # this checkpoint is itself the (or a recorded) target
        return loaded.state.step

    def _take_hyperparameters(self) -> None:
        """After a restore: optimizer state from the checkpoint, settings (lr, betas, decay) from
        this trial's hyperparameters — the same values on a plain resume, a PBT clone's mutated
        ones when it continues its donor."""
        fresh = self.trial.build_optimizer(self.trainable)
        for restored, configured in zip(self.optimizer.param_groups, fresh.param_groups, strict=True):
            for name, value in configured.items():
                if name != "params":
                    restored[name] = value
            restored["initial_lr"] = configured["lr"]

    def start_from(self, directory: Path) -> None:
        """Begin at step 0 from another run's verified checkpoint: its weights (base, and adapters
        both runs have) and its ledger — what reached the weights stays on the record. The
        optimizer starts fresh; the source is kept in every checkpoint of this run."""
        loaded = load_checkpoint(directory, self.spec.trust)
        try:
            self.model.base.load_state_dict(load_file(str(directory / MODEL_FILE)), strict=True)
        except RuntimeError as error:
            raise CheckpointError(
                f"{directory / MODEL_FILE} does not fit this trial's model: {error}"
            ) from None
        for adapter in self.model.adapter_names():
            if (directory / f"adapter-{adapter}.safetensors").is_file():
                load_adapter(self.model, adapter, directory / f"adapter-{adapter}.safetensors")
        self.ledger = Ledger.from_json(loaded.state.ledger)
        self.source = {
            "path": str(directory),
            "manifest_sha256": loaded.manifest_digest,
            "signer": loaded.signer,
            "step": loaded.state.step,
            "config_digest": loaded.state.config_digest,
            "policy_digest": loaded.state.policy_digest,
            **self.spec.start_model,
        }

    @property
    def decisions(self) -> list[LrDecision | EarlyStopDecision | GateDecision | RollbackDecision]:
        """Every decision taken (or applied) so far, in order."""
        taken: list[LrDecision | EarlyStopDecision | GateDecision | RollbackDecision] = [
            *self.gates,
            *self.rollbacks,
        ]
        if self.plateau is not None:
            taken.extend(self.plateau.decisions)
        if self.early is not None and self.early.decision is not None:
            taken.append(self.early.decision)
        return sorted(taken, key=lambda decision: decision.seq)

    def observe_memorization(
        self, steps_done: int, report: MemorizationReport
    ) -> list[GateDecision | RollbackDecision]:
        """The policy's action on corpora this validation flagged (those not gated already):
        ``gate`` stops routing them from here on; ``rollback`` first restores the last clean state,
        then gates them. A replay does what its source did at this step, whatever its own flags.
        A validation that leaves no ungated corpus flagged (or is rolled back) is the new clean
        state."""
        self.last_report = report
        gated = {gate.corpus_id for gate in self.gates}
        made: list[GateDecision | RollbackDecision] = []
        if self.gate_record is not None and self.rollback_record is not None:
            recorded: list[GateDecision | RollbackDecision] = [*self.rollback_record, *self.gate_record]
            applied = {gate.seq for gate in self.gates} | {rollback.seq for rollback in self.rollbacks}
            if missed := [d for d in recorded if d.step < steps_done and d.seq not in applied]:
                raise DecisionError(
                    f"recorded decisions {[d.seq for d in missed]} were missed by this replay"
                )
            due = sorted((d for d in recorded if d.step == steps_done), key=lambda d: d.seq)
            made = [d.model_copy(update={"score": None}) for d in due]
        else:
            flagged = [corpus for corpus in report.flagged if corpus not in gated]
            action = report.action if flagged else "flag"
            seq = len(self.decisions)
            if action == "rollback":
                target = self._rollback_target(steps_done)
                score = max(report.corpora[corpus].score for corpus in flagged)
                made.append(
                    RollbackDecision(seq=seq, step=steps_done, to_step=target, corpora=flagged, score=score)
                )
            if action in ("gate", "rollback"):
                made += [
                    GateDecision(
                        seq=seq + len(made) + index,
                        step=steps_done,
                        corpus_id=corpus,
                        score=report.corpora[corpus].score,
                    )
                    for index, corpus in enumerate(flagged)
                ]
        for decision in made:
            if isinstance(decision, RollbackDecision):
                self._roll_back(decision)
        self.gate([d for d in made if isinstance(d, GateDecision)])
        clean = not [corpus for corpus in report.flagged if corpus not in gated] or any(
            isinstance(d, RollbackDecision) for d in made
        )
        if clean or self.rollback_record is not None:
            self.keep_clean(steps_done)
        return made

    def _rollback_target(self, steps_done: int) -> int:
        if self.clean_step is None:
            raise DecisionError(
                f"memorization rollback after step {steps_done}: no clean checkpoint to go back to"
            )
        return self.clean_step

    @property
    def rolls_back(self) -> bool:
        """Whether this run may roll back (so keeps its clean state in memory)."""
        if self.rollback_record is not None:
            return bool(self.rollback_record)
        thresholds = self.spec.policy.memorization
        return thresholds is not None and thresholds.action == "rollback"

    def keep_clean(self, steps_done: int) -> None:
        """Remember this state as the rollback target. A replay keeps every state its record goes
        back to, whatever its own measures say."""
        if self.rollback_record is not None:
            if any(r.to_step == steps_done for r in self.rollback_record):
                self.snapshots[steps_done] = self._snapshot(steps_done)
            return
        self.clean_step = steps_done
        if self.rolls_back:
            self.snapshots = {steps_done: self._snapshot(steps_done)}

    def _snapshot(self, steps_done: int) -> _Snapshot:
        return _Snapshot(
            step=steps_done,
            weights={name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()},
            optimizer=copy.deepcopy(self.optimizer.state_dict()),
            ledger=self.ledger.to_json(),
        )

    def _roll_back(self, decision: RollbackDecision) -> None:
        """Weights, adapters, optimizer state and ledger of the clean state at ``to_step`` (kept in
        memory, and in every checkpoint written since, so a resumed run has it too); the LR
        settings stay those in force now (a plateau cut is not undone)."""
        snapshot = self.snapshots.get(decision.to_step)
        if snapshot is None:
            raise DecisionError(
                f"memorization rollback after step {decision.step}: the clean state of step "
                f"{decision.to_step} was not kept (this run's checkpoints predate the rollback policy?)"
            )
        self.model.load_state_dict(snapshot.weights, strict=True)
        self.optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
        self.ledger = Ledger.from_json(snapshot.ledger)
        self._take_hyperparameters()
        if self.plateau is not None:
            self._apply_lr_scale()
        self.rollbacks.append(decision)
        self.schedule = self._schedule()

    def _load_weights(self, directory: Path) -> None:
        self.model.base.load_state_dict(load_file(str(directory / MODEL_FILE)), strict=True)
        for adapter in self.model.adapter_names():
            load_adapter(self.model, adapter, directory / f"adapter-{adapter}.safetensors")

    def observe(
        self, steps_done: int, validation: Mapping[str, float]
    ) -> list[LrDecision | EarlyStopDecision]:
        """Take (or, in a replay, apply the recorded) decisions due after a validation."""
        made: list[LrDecision | EarlyStopDecision] = []
        if self.plateau is not None:
            lr = self.plateau.observe(steps_done, validation, seq=len(self.decisions))
            if lr is not None:
                self._apply_lr_scale()
                made.append(lr)
        if self.early is not None and self.early.decision is None:
            stop = self.early.observe(steps_done, validation, seq=len(self.decisions))
            if stop is not None:
                made.append(stop)
        return made

    @property
    def stopped_early(self) -> bool:
        return self.early is not None and self.early.decision is not None

    def check_decisions_applied(self, steps_done: int) -> None:
        if self.plateau is not None and (missed := self.plateau.unapplied(steps_done)):
            raise DecisionError(
                f"the replay never reached recorded decisions {[d.seq for d in missed]} "
                f"(steps {[d.step for d in missed]})"
            )

    def _apply_lr_scale(self) -> None:
        assert self.plateau is not None
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.plateau.scale

    def _start_stop_check(self) -> tuple[torch.Tensor, Any]:
        """Rank 0 reads the control file; the broadcast of its answer runs while the step computes."""
        code = 0
        if self.worker.rank == 0 and self.spec.control_file:
            try:
                code = STOP_CODES.get(Path(self.spec.control_file).read_text().strip(), 0)
            except FileNotFoundError:
                code = 0
        flag = torch.tensor([code], dtype=torch.int64)
        work = dist.broadcast(flag, src=0, async_op=True) if self.worker.distributed else None
        return flag, work

    def stop_request(self) -> str | None:
        """``pause`` or ``kill`` if the driver asked before the last step began (looked at every
        ``control_period`` steps); every rank gets rank 0's answer, so all stop at the same step
        boundary."""
        if self._stop_check is None:
            return None
        flag, work = self._stop_check
        if work is not None:
            work.wait()
        return STOP_NAMES.get(int(flag.item()))

    def memorization(self) -> MemorizationReport:
        """This validation's memorization measures (``probe.MemorizationProbe``), scored by the
        policy's thresholds (or the defaults)."""
        thresholds = self.spec.policy.memorization or MemorizationThresholds()
        report = memorization_report(self.probe.measure(), thresholds)
        if self.exported is not None:
            self.exported.record_memorization(report)
        return report

    def objective(self, metrics: Mapping[str, float], report: MemorizationReport) -> float:
        """The search objective: the searcher's metric penalized by the memorization score."""
        if self.spec.objective_metric not in metrics:
            raise DecisionError(
                f"the searcher's metric {self.spec.objective_metric!r} was not reported; "
                f"validation reported: {', '.join(sorted(metrics))}"
            )
        return objective(
            float(metrics[self.spec.objective_metric]),
            report.score,
            self.spec.memorization_lambda,
            self.spec.smaller_is_better,
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation metrics of the base model (adapters inactive) over every holdout row, split
        across workers and summed; also per corpus (``validation_loss/CORPUS``)."""
        self.model.eval()
        sums: dict[str, float] = {}
        for corpus in self.shards.manifest.holdout:
            table = self.shards.holdout_table(corpus)
            mine = self.worker.mine(table)
            values = self.trial.evaluate(self.model, self.trial.collate(mine))
            for name, per_example in values.items():
                total = float(per_example.double().sum())
                sums[name] = sums.get(name, 0.0) + total
                sums[f"{name}/{corpus}"] = total
            sums["count"] = sums.get("count", 0.0) + mine.num_rows
            sums[f"count/{corpus}"] = float(mine.num_rows)
        totals = all_reduce_sums(sums, self.worker)
        metrics = {}
        for key, value in totals.items():
            if key.startswith("count"):
                continue
            name, _, corpus = key.partition("/")
            count = totals[f"count/{corpus}"] if corpus else totals["count"]
            metrics[f"validation_{key}"] = value / count if count else float("nan")
        return metrics


def train_worker(config: dict[str, Any], on_report: Report | None = None, ray_train: bool = True) -> None:
    """``train_loop_per_worker`` for Ray Train: the whole governed run of one worker.

    After a failure Ray Train restarts every worker; each resumes from the latest checkpoint and
    recomputes the schedule from there (per-step randomness needs no RNG state). A pause request
    checkpoints at the next step boundary and returns; a kill request returns without one.
    Without ``ray_train`` (a Ray Tune trial, where Ray refuses Ray Train's session API) only
    ``on_report`` hears the reports and ``spec.resume_checkpoint`` is the resume point. Each
    rank logs to ``STORAGE/logs/RUN/rank-N.log`` (``govray trial logs``); a Ray worker process
    also tees its stdout and stderr there.
    """
    spec = RunSpec.model_validate(config)
    if spec.recorded_code:
        snapshot = CodeSnapshot.model_validate(spec.reproducibility["code"])
        use_recorded_code(snapshot, Path(spec.code_dir), open_storage(spec.storage) if spec.storage else None)
    else:
        importable(spec.code_dir)  # Ray Train moves workers into the run directory
    torch.set_num_threads(spec.threads)
    worker = Worker.detect()
    if not spec.log_dir:
        _train_steps(spec, worker, None, on_report, ray_train)
        return
    path = Path(spec.log_dir) / f"rank-{worker.rank}.log"
    if spec.storage:  # a resumed run appends to what this rank wrote on another node
        open_storage(spec.storage).pull_growing(path)
    log = WorkerLog(path, worker.rank)
    # In local mode the worker is the driver, whose terminal shows a progress bar: no tee.
    with log, log.capture() if on_report is None else contextlib.nullcontext():
        try:
            _train_steps(spec, worker, log, on_report, ray_train)
        except BaseException:
            log.write(traceback.format_exc())
            raise
        finally:
            _publish_log(log, spec.storage)


def _publish_log(log: WorkerLog | None, storage: str) -> None:
    """Copy a rank's log to object storage (at each checkpoint and at the end), where ``govray
    trial logs`` reads every node's ranks; a failed copy is noted in the log, never fatal."""
    if log is None or not storage:
        return
    try:
        open_storage(storage).upload(log.path)
    except StorageError as error:
        log.write(f"could not copy this log to {storage}: {error}")


def _train_steps(
    spec: RunSpec, worker: Worker, log: WorkerLog | None, on_report: Report | None, ray_train: bool
) -> None:
    def note(message: str) -> None:
        if log is not None:
            log.write(message)

    training = GovernedTraining(spec, worker)
    start = 0
    resume_from = _resume_checkpoint(spec, ray_train)
    if resume_from is not None:
        with resume_from.as_directory() as directory:
            start = training.restore(Path(directory))
        note(f"resumed from a verified checkpoint at step {start}")
    elif spec.start_checkpoint:
        training.start_from(Path(spec.start_checkpoint))
        note(f"starting from checkpoint {spec.start_checkpoint} (its step {training.source['step']})")
    if resume_from is None:
        training.keep_clean(0)  # the starting weights are the first rollback target
    node = ray_node_id()
    note(
        f"rank {worker.rank} of {worker.world_size}{f' on Ray node {node}' if node else ''}: "
        f"steps {start + 1}..{spec.max_steps}, "
        f"policy {spec.policy.name} v{spec.policy.version}, excluded corpora {list(spec.excluded_corpora)}"
    )
    key = SigningKey.load(Path(spec.platform_key)) if worker.rank == 0 and spec.platform_key else None
    finished = training.stopped_early or start >= spec.max_steps
    if finished and training.restored_from_run not in ("", training.run_name):
        _report_finished_clone(training, start, key, on_report, ray_train, note)
        return
    if training.stopped_early:
        note(f"the checkpoint at step {start} is after the trial's early stop: nothing left to train")
        return
    loss_sum, examples = 0.0, 0
    for step in range(start, spec.max_steps):
        step_loss, step_examples = training.step(step)
        loss_sum, examples = loss_sum + step_loss, examples + step_examples
        done = step + 1
        last = done == spec.max_steps
        stop = training.stop_request()
        if last:
            stop = None  # the run is over anyway
        validate = last or bool(spec.validation_period and done % spec.validation_period == 0)
        save = validate or done % spec.checkpoint_period == 0 or stop == "pause"
        if done % spec.report_every and not save and stop is None:
            continue
        totals = all_reduce_sums({"loss": loss_sum, "examples": float(examples)}, worker)
        metrics: dict[str, Any] = {
            "step": done,
            "epoch": training.schedule.locate(step)[0],
            "training_loss": totals["loss"] / totals["examples"] if totals["examples"] else float("nan"),
            "examples": int(totals["examples"]),
        }
        loss_sum, examples = 0.0, 0
        if validate:
            validation, report = training.evaluate(), training.memorization()
            validation, report = _memorization_actions(training, done, validation, report, metrics, note)
            metrics.update(_measured(validation, report))
            metrics["objective"] = training.objective(validation, report)
            for decision in training.observe(done, validation):
                seen = "replayed from the record" if decision.observed is None else f"{decision.observed:.6g}"
                if isinstance(decision, LrDecision):
                    what = f"learning rate x{decision.previous_scale:g} -> x{decision.scale:g}"
                elif isinstance(decision, EarlyStopDecision):
                    what = f"early stop ({decision.reason})"
                note(f"decision {decision.seq}: {what} after step {done} ({decision.metric} {seen})")
            if training.decisions:
                metrics["decisions"] = json.dumps([d.model_dump(mode="json") for d in training.decisions])
            if training.stopped_early:
                metrics["early_stopped"] = 1
                last = True  # the trial ends here, with its ledger
        if last:
            training.check_decisions_applied(done)
            metrics["ledger"] = json.dumps(training.ledger.to_json(), sort_keys=True)
        if stop is not None:
            metrics["stopped_on_request"] = STOP_CODES[stop]
        if training.restored_from_run not in ("", training.run_name):
            metrics["cloned_from_run"] = training.restored_from_run  # a PBT clone of that run
        note(
            " ".join(
                f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value}"
                for name, value in metrics.items()
                if name not in ("ledger", "decisions", "memorization_flagged_corpora") and "/" not in name
            )
            + (" (checkpoint)" if save and key is not None else "")
        )
        if save:  # the log in object storage before the checkpoint is reported: never behind it
            _publish_log(log, spec.storage)
        _report(training, metrics, done, key if save else None, on_report, ray_train)
        if stop is not None:
            note(f"{stop} requested: stopped after step {done}" + (" with a checkpoint" if save else ""))
            return
        if training.stopped_early:
            note(f"stopped early after step {done} of {spec.max_steps}")
            return
    note(f"completed {spec.max_steps} steps")


def _report_finished_clone(
    training: GovernedTraining,
    done: int,
    key: SigningKey | None,
    on_report: Report | None,
    ray_train: bool,
    note: Callable[[str], None],
) -> None:
    """A PBT clone of a trial that had finished (its last step, or its early stop): nothing is left
    to train. The clone ends with its donor's state measured and checkpointed under its own name
    (weights, ledger and decisions unchanged), so its record has a last checkpoint, a ledger and
    an attestation of its own."""
    validation, report = training.evaluate(), training.memorization()
    training.last_report = report
    training.check_decisions_applied(done)
    metrics: dict[str, Any] = {
        "step": done,
        "epoch": training.schedule.locate(done - 1)[0],
        **_measured(validation, report),
        "objective": training.objective(validation, report),
        "ledger": json.dumps(training.ledger.to_json(), sort_keys=True),
        "cloned_from_run": training.restored_from_run,
    }
    if training.decisions:
        metrics["decisions"] = json.dumps([d.model_dump(mode="json") for d in training.decisions])
    if training.stopped_early:
        metrics["early_stopped"] = 1
    note(
        f"a clone of {training.restored_from_run}'s finished state at step {done}: nothing left to "
        f"train; objective={metrics['objective']:.6g} (checkpoint)"
    )
    _report(training, metrics, done, key, on_report, ray_train)


def _measured(validation: dict[str, float], report: MemorizationReport) -> dict[str, float]:
    """A validation's metrics: the trial's own, the memorization score and flags, and each
    corpus's measures (``loss_gap/C``, ``exposure_bits/C``, ``entropy_drop/C``)."""
    measured = {**validation, "memorization_score": report.score, "memorization_flagged": len(report.flagged)}
    for corpus_id, verdict in report.corpora.items():
        for name, value in verdict.measures.model_dump().items():
            if value is not None:
                measured[f"{name}/{corpus_id}"] = value
    return measured


def _memorization_actions(
    training: GovernedTraining,
    done: int,
    validation: dict[str, float],
    report: MemorizationReport,
    metrics: dict[str, Any],
    note: Callable[[str], None],
) -> tuple[dict[str, float], MemorizationReport]:
    """The policy's action on this validation's flags; returns the validation and report of the
    weights that go on (after a rollback, the restored ones, measured again: the metrics, the
    objective and the LR and early-stopping rules see the model that continues, and the flagged
    model's values stay in the report as ``pre_rollback/...``)."""
    gated = {gate.corpus_id for gate in training.gates}
    if newly := [corpus for corpus in report.flagged if corpus not in gated]:  # audited by the store
        metrics["memorization_flagged_corpora"] = json.dumps(
            {
                "corpora": {corpus: report.corpora[corpus].normalized for corpus in newly},
                "action": report.action,
                "replayed": training.spec.recorded_decisions is not None,
            },
            sort_keys=True,
        )
    rolled_back = False
    for taken in training.observe_memorization(done, report):
        seen = "replayed from the record" if taken.score is None else f"normalized score {taken.score:.3g}"
        if isinstance(taken, RollbackDecision):
            rolled_back = True
            metrics["rolled_back_to"] = taken.to_step
            what = f"roll back to the clean state after step {taken.to_step} ({', '.join(taken.corpora)})"
        else:
            what = f"gate {taken.corpus_id} from step {done}"
        note(f"decision {taken.seq}: {what} (memorization, {seen})")
    if not rolled_back:
        return validation, report
    metrics.update({f"pre_rollback/{name}": value for name, value in _measured(validation, report).items()})
    validation, report = training.evaluate(), training.memorization()
    training.last_report = report
    return validation, report


def _resume_checkpoint(spec: RunSpec, ray_train: bool) -> Any:
    """Where a (re)started worker group resumes, by one rule: the newest checkpoint of the run
    directory that verifies (``newest_verified_checkpoint``: the highest step; Ray Train's own
    latest checkpoint is one of these folders, but a report lost when a worker died leaves a newer
    one that only the folder shows). With none there: the run's starting point, a search
    segment's ``resume_checkpoint``; else, outside a run directory, Ray Train's latest."""
    import ray.train

    storage = open_storage(spec.storage) if spec.storage else None
    if spec.run_dir:
        newest = newest_verified_checkpoint(Path(spec.run_dir), spec.trust, storage)
        if newest is not None:
            return ray.train.Checkpoint.from_directory(str(newest))
    if spec.resume_checkpoint:
        if storage is not None:  # a search segment's checkpoint, fetched on this node from the bucket
            storage.fetch(Path(spec.resume_checkpoint))
        return ray.train.Checkpoint.from_directory(spec.resume_checkpoint)
    return ray.train.get_checkpoint() if ray_train and not spec.run_dir else None


def _report(
    training: GovernedTraining,
    metrics: dict[str, Any],
    done: int,
    key: SigningKey | None,
    on_report: Report | None,
    ray_train: bool,
) -> None:
    """Report to Ray Train (and/or ``on_report``), with a signed checkpoint when ``key`` is given
    (rank 0 holds it)."""
    import ray.train

    saved: str | None = None
    if key is not None and on_report is not None:
        # Local mode has no controller to persist checkpoints: write them into the run directory.
        saved = str(Path(training.spec.run_dir) / f"checkpoint_{done:08d}")
        training.save_checkpoint(Path(saved), done, key, metrics)
        storage = open_storage(training.spec.storage) if training.spec.storage else None
        if storage is not None and Path(saved).is_relative_to(storage.root):  # not a Tune trial's scratch
            storage.upload(Path(saved))
        if ray_train:
            ray.train.report(metrics)
    elif key is not None:
        with tempfile.TemporaryDirectory(prefix="govray-checkpoint-") as scratch:
            training.save_checkpoint(Path(scratch), done, key, metrics)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(scratch))
    elif ray_train:
        ray.train.report(metrics)
    if on_report is not None:
        on_report(metrics, saved)


def default_threads(cpus_per_worker: float) -> int:
    return (
        max(1, int(cpus_per_worker))
        if "OMP_NUM_THREADS" not in os.environ
        else int(os.environ["OMP_NUM_THREADS"])
    )
