"""Every metric-driven decision of a trial, through one interface: the ``Controller``.

After each validation the controller decides — the LR plateau, early stopping, the policy's
memorization action (gate, or roll back to the last clean state and gate), and, in a replay, a
search scheduler's stop — or, in a replay, applies the source trial's recorded decisions at the
steps they were taken, whatever the replay's own metrics say (recomputing them would couple the
excluded corpora to every other route's updates). The caller carries them out: scales the
learning rate, restores a clean state, empties a gated corpus's later slots.

Example::

    control = Controller(spec.lr_schedule, spec.early_stopping, spec.policy.memorization, recorded=None)
    for decision in control.after_validation(step, {"validation_loss": 0.7}):
        ...  # an LrDecision: set each group's lr to initial_lr * control.lr_scale
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from govray.config.experiment import EarlyStoppingPolicy, PlateauSchedule
from govray.data.schedule import ScheduleEvent
from govray.governance.memorization import MemorizationReport, MemorizationThresholds
from govray.train.control.decisions import (
    DecisionError,
    EarlyStopDecision,
    EarlyStopping,
    EarlyStopState,
    GateDecision,
    LossScaleSkip,
    LrDecision,
    Plateau,
    PlateauState,
    PreemptedDecision,
    RecordedDecision,
    RollbackDecision,
)
from govray.train.step.scaling import LossScaler

Decision = (
    LrDecision | EarlyStopDecision | GateDecision | RollbackDecision | LossScaleSkip | PreemptedDecision
)
REPLAY_ONLY = EarlyStoppingPolicy(patience=1)  # settings of a rule that only replays a record
Kept = TypeVar("Kept")  # what the caller keeps of a clean state (weights, optimizer, ledger)


class Controller(Generic[Kept]):
    """One trial's decisions: live from its rules, or applied from ``recorded`` (a replay)."""

    def __init__(
        self,
        lr_schedule: PlateauSchedule | None,
        early_stopping: EarlyStoppingPolicy | None,
        memorization: MemorizationThresholds | None,
        recorded: Sequence[RecordedDecision] | None,
    ) -> None:
        self.record = None if recorded is None else tuple(sorted(recorded, key=lambda d: d.seq))
        self.plateau = Plateau(lr_schedule) if lr_schedule else None
        # A replay stops where its source stopped, also when a scheduler (ASHA) made that call.
        replayed_stop = bool(self.record and any(isinstance(d, EarlyStopDecision) for d in self.record))
        self.early = EarlyStopping(early_stopping or REPLAY_ONLY) if early_stopping or replayed_stop else None
        self.memorization = memorization
        self.gates: list[GateDecision] = []
        self.rollbacks: list[RollbackDecision] = []
        self.preemptions: list[PreemptedDecision] = []  # this run's own: a replay applies none
        # Rollback targets: the last clean state (a replay keeps those its record goes back to).
        self.clean_step: int | None = None
        self.clean_states: dict[int, Kept] = {}
        # fp16's per-route loss scales and the skips they led to (the governed step asks it).
        recorded_skips = None if self.record is None else self._recorded(LossScaleSkip)
        self.scaler = LossScaler(recorded_skips, next_seq=lambda: len(self.decisions))

    @property
    def replaying(self) -> bool:
        return self.record is not None

    @property
    def decisions(self) -> list[Decision]:
        """Every decision taken (or applied) so far, in order."""
        taken: list[Decision] = [*self.gates, *self.rollbacks, *self.scaler.skips, *self.preemptions]
        if self.plateau is not None:
            taken.extend(self.plateau.decisions)
        if self.early is not None and self.early.decision is not None:
            taken.append(self.early.decision)
        return sorted(taken, key=lambda decision: decision.seq)

    @property
    def lr_scale(self) -> float:
        return self.plateau.scale if self.plateau is not None else 1.0

    @property
    def stopped_early(self) -> bool:
        return self.early is not None and self.early.decision is not None

    def schedule_events(self) -> list[ScheduleEvent]:
        """Gates and rollbacks as schedule events (a gate only empties later slots; a rollback
        changes no slot)."""
        events = [ScheduleEvent(step=gate.step, kind="gate", corpus_id=gate.corpus_id) for gate in self.gates]
        return events + [
            ScheduleEvent(step=r.step, kind="rollback", to_step=r.to_step) for r in self.rollbacks
        ]

    # -- after a validation: learning rate and early stopping --------------------------------------

    def after_validation(
        self, steps_done: int, validation: Mapping[str, float]
    ) -> list[LrDecision | EarlyStopDecision]:
        """Take (or apply the recorded) decisions due after a validation."""
        made: list[LrDecision | EarlyStopDecision] = []
        if self.plateau is not None:
            if self.record is None:
                lr = self.plateau.observe(steps_done, validation, seq=len(self.decisions))
            else:
                lr = self._replay_lr(steps_done)
            if lr is not None:
                made.append(lr)
        if self.early is not None and self.early.decision is None:
            if self.record is None:
                stop = self.early.observe(steps_done, validation, seq=len(self.decisions))
            else:
                stop = self._replay_stop(steps_done)
            if stop is not None:
                made.append(stop)
        return made

    def _recorded(self, kind: type[Any]) -> list[Any]:
        assert self.record is not None
        return [decision for decision in self.record if isinstance(decision, kind)]

    def _replay_lr(self, steps_done: int) -> LrDecision | None:
        assert self.plateau is not None
        state = self.plateau.state
        due = [d for d in self._recorded(LrDecision)[len(state.decisions) :] if d.step <= steps_done]
        if not due:
            return None
        if due[0].step < steps_done or len(due) > 1:
            raise DecisionError(
                f"recorded decision {due[0].seq} was taken after step {due[0].step}, but this run "
                f"evaluated only at step {steps_done}: the replay's validation steps differ from the record's"
            )
        decision = due[0].model_copy(update={"observed": None, "previous_scale": state.scale})
        self.plateau.state = state.model_copy(
            update={"scale": due[0].scale, "decisions": (*state.decisions, decision)}
        )
        return decision

    def _replay_stop(self, steps_done: int) -> EarlyStopDecision | None:
        assert self.early is not None
        stops = self._recorded(EarlyStopDecision)
        recorded = min(stops, key=lambda d: d.step) if stops else None
        if recorded is not None and recorded.step == steps_done:
            self.early.state = self.early.state.model_copy(
                update={"decision": recorded.model_copy(update={"observed": None})}
            )
        elif recorded is not None and recorded.step < steps_done:
            raise DecisionError(
                f"the recorded early stop after step {recorded.step} was missed: this run "
                f"evaluated at step {steps_done} first"
            )
        return self.early.decision

    def check_applied(self, steps_done: int) -> None:
        """At the end of a replay: every recorded LR decision due by now was applied."""
        if self.record is None or self.plateau is None:
            return
        applied = {decision.seq for decision in self.plateau.decisions}
        missed = [d for d in self._recorded(LrDecision) if d.step <= steps_done and d.seq not in applied]
        if missed:
            raise DecisionError(
                f"the replay never reached recorded decisions {[d.seq for d in missed]} "
                f"(steps {[d.step for d in missed]})"
            )

    # -- after a validation: the policy's memorization action --------------------------------------

    def after_memorization(
        self, steps_done: int, report: MemorizationReport
    ) -> list[GateDecision | RollbackDecision]:
        """The policy's action on corpora this validation flagged (those not gated already):
        ``gate`` stops routing them from here on; ``rollback`` first goes back to the last clean
        state, then gates them. A replay does what its source did at this step. The caller rolls
        back, gates (``gate``) and then calls ``settle_clean``."""
        gated = {gate.corpus_id for gate in self.gates}
        if self.record is not None:
            recorded = [*self._recorded(RollbackDecision), *self._recorded(GateDecision)]
            applied = {d.seq for d in self.gates} | {d.seq for d in self.rollbacks}
            if missed := [d for d in recorded if d.step < steps_done and d.seq not in applied]:
                raise DecisionError(
                    f"recorded decisions {[d.seq for d in missed]} were missed by this replay"
                )
            due = sorted((d for d in recorded if d.step == steps_done), key=lambda d: d.seq)
            return [d.model_copy(update={"score": None}) for d in due]
        flagged = [corpus for corpus in report.flagged if corpus not in gated]
        action = report.action if flagged else "flag"
        seq = len(self.decisions)
        made: list[GateDecision | RollbackDecision] = []
        if action == "rollback":
            if self.clean_step is None:
                raise DecisionError(
                    f"memorization rollback after step {steps_done}: no clean checkpoint to go back to"
                )
            score = max(report.corpora[corpus].score for corpus in flagged)
            made.append(
                RollbackDecision(
                    seq=seq, step=steps_done, to_step=self.clean_step, corpora=flagged, score=score
                )
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
        return made

    def rollback_target(self, decision: RollbackDecision) -> Kept:
        """The clean state a rollback goes back to (kept since, also across a resume)."""
        clean = self.clean_states.get(decision.to_step)
        if clean is None:
            raise DecisionError(
                f"memorization rollback after step {decision.step}: the clean state of step "
                f"{decision.to_step} was not kept (this run's checkpoints predate the rollback policy?)"
            )
        self.rollbacks.append(decision)
        return clean

    def gate(self, decisions: Sequence[GateDecision]) -> None:
        self.gates.extend(decisions)

    def settle_clean(
        self,
        steps_done: int,
        report: MemorizationReport,
        gated_before: set[str],
        made: Sequence[GateDecision | RollbackDecision],
        take: Callable[[int], Kept],
    ) -> None:
        """A validation that leaves no ungated corpus flagged (or is rolled back) is the new clean
        state."""
        clean = not [corpus for corpus in report.flagged if corpus not in gated_before] or any(
            isinstance(d, RollbackDecision) for d in made
        )
        if clean or self.replayed_rollbacks is not None:
            self.keep_clean(steps_done, take)

    @property
    def replayed_rollbacks(self) -> list[RollbackDecision] | None:
        return None if self.record is None else self._recorded(RollbackDecision)

    @property
    def rolls_back(self) -> bool:
        """Whether this run may roll back (so keeps its clean state in memory)."""
        if (replayed := self.replayed_rollbacks) is not None:
            return bool(replayed)
        return self.memorization is not None and self.memorization.action == "rollback"

    def keep_clean(self, steps_done: int, take: Callable[[int], Kept]) -> None:
        """Remember this state as the rollback target. A replay keeps every state its record goes
        back to, whatever its own measures say."""
        if (replayed := self.replayed_rollbacks) is not None:
            if any(r.to_step == steps_done for r in replayed):
                self.clean_states[steps_done] = take(steps_done)
            return
        self.clean_step = steps_done
        if self.rolls_back:
            self.clean_states = {steps_done: take(steps_done)}

    def earlier_clean_states(self, steps_done: int) -> list[tuple[int, Kept]]:
        return [(step, snap) for step, snap in sorted(self.clean_states.items()) if step != steps_done]

    # -- on a reclaim notice --------------------------------------------------------------------------

    def preempted(
        self, steps_done: int, deadline_ms: int | None, nodes: Mapping[str, list[int]]
    ) -> PreemptedDecision:
        """Record that a checkpoint was sealed after ``steps_done`` steps on a reclaim notice. It
        takes the next free ``seq``: in a replay, after every recorded one too (the source's own
        preemptions are not re-applied, and the replay's must not take their numbers)."""
        taken = [d.seq for d in self.decisions] + [d.seq for d in self.record or ()]
        decision = PreemptedDecision(
            seq=max(taken, default=-1) + 1, step=steps_done, deadline_ms=deadline_ms, nodes=dict(nodes)
        )
        self.preemptions.append(decision)
        return decision

    # -- in every checkpoint -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The decisions' part of a checkpoint's state."""
        return {
            "plateau": self.plateau.state.model_dump(mode="json") if self.plateau else {},
            "early_stopping": self.early.state.model_dump(mode="json") if self.early else {},
            "gates": [gate.model_dump(mode="json") for gate in self.gates],
            "rollbacks": [rollback.model_dump(mode="json") for rollback in self.rollbacks],
            "clean_step": self.clean_step,
            "preemptions": [preempted.model_dump(mode="json") for preempted in self.preemptions],
            "loss_scaling": self.scaler.to_json() if self.scaler.state.scales or self.scaler.skips else {},
        }

    def restore(self, state: Any) -> None:
        """From a checkpoint's state (``CheckpointState``)."""
        self.gates = [GateDecision.model_validate(gate) for gate in state.gates]
        self.rollbacks = [RollbackDecision.model_validate(rollback) for rollback in state.rollbacks]
        if self.plateau is not None and state.plateau:
            self.plateau.state = PlateauState.model_validate(state.plateau)
        if self.early is not None and state.early_stopping:
            self.early.state = EarlyStopState.model_validate(state.early_stopping)
        self.preemptions = [PreemptedDecision.model_validate(p) for p in state.preemptions]
        self.clean_step = state.clean_step
        self.scaler.restore(state.loss_scaling)
