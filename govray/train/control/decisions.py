"""Decisions driven by metrics, made once and recorded, so a replay applies the record.

A learning rate cut on a plateau depends on validation metrics, and a counterfactual replay
(``govray replay --exclude-corpus X``) has different metrics: recomputing the decision there
would couple X to every other route's updates. So a trial records each decision (its step, what
it changed, what it saw); a replay is handed the record and applies it at the same steps,
whatever its own metrics say.

Example::

    plateau = Plateau(config.lr_schedule)                    # or Plateau(settings, recorded=record)
    decision = plateau.observe(step=40, metrics={"validation_loss": 0.71})
    if decision is not None:
        set_lr_scale(optimizer, plateau.scale)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from govray.config.experiment import EarlyStoppingPolicy, PlateauSchedule
from govray.core.errors import GovrayError

SCALE_EPSILON = 1e-8  # torch's ``eps``: a smaller cut is not made


class DecisionError(GovrayError):
    """A recorded decision cannot be applied to this run, or a metric it needs is missing."""

    exit_code = 13


class LrDecision(BaseModel):
    """Scale every parameter group's learning rate to ``scale`` times its initial value from ``step`` on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0)
    step: int = Field(ge=1)  # steps completed when the decision was taken (applies to later steps)
    kind: Literal["lr_scale"] = "lr_scale"
    metric: str
    observed: float | None  # None in a replay: the value is the source trial's, not observed here
    previous_scale: float
    scale: float


class PlateauState(BaseModel):
    """What the plateau rule remembers between evaluations (kept in every checkpoint)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    best: float | None = None
    bad_evaluations: int = 0
    cooldown_left: int = 0
    scale: float = 1.0
    decisions: tuple[LrDecision, ...] = ()


class Plateau:
    """torch's ``ReduceLROnPlateau`` over validation evaluations (a replay applies the record
    instead: ``govray.train.control.controller.Controller``).

    After more than ``patience`` evaluations without improvement, the learning-rate scale is
    multiplied by ``factor`` (not below ``min_scale``) and ``cooldown`` evaluations pass before
    counting again — the same sequence torch computes, as a scale of each group's initial LR.
    """

    def __init__(
        self,
        settings: PlateauSchedule,
        state: PlateauState | None = None,
    ) -> None:
        self.settings = settings
        self.state = state or PlateauState()

    @property
    def scale(self) -> float:
        return self.state.scale

    @property
    def decisions(self) -> tuple[LrDecision, ...]:
        return self.state.decisions

    def observe(self, step: int, metrics: Mapping[str, float], seq: int | None = None) -> LrDecision | None:
        """The decision due after ``step`` completed steps; None if nothing changes."""
        name = self.settings.metric
        if name not in metrics:
            raise DecisionError(
                f"lr_schedule watches {name!r} but the trial's validation reported only: "
                f"{', '.join(sorted(metrics)) or 'nothing'}"
            )
        value = float(metrics[name])
        state = self.state
        best, bad = state.best, state.bad_evaluations
        if self._improved(value, best):
            best, bad = value, 0
        else:
            bad += 1
        cooldown_left = state.cooldown_left
        if cooldown_left:
            cooldown_left, bad = cooldown_left - 1, 0
        scale, decisions, decision = state.scale, state.decisions, None
        if bad > self.settings.patience:
            cooldown_left, bad = self.settings.cooldown, 0
            reduced = max(scale * self.settings.factor, self.settings.min_scale)
            if scale - reduced > SCALE_EPSILON:
                decision = LrDecision(
                    seq=len(decisions) if seq is None else seq,
                    step=step,
                    metric=name,
                    observed=value,
                    previous_scale=scale,
                    scale=reduced,
                )
                scale, decisions = reduced, (*decisions, decision)
        self.state = PlateauState(
            best=best, bad_evaluations=bad, cooldown_left=cooldown_left, scale=scale, decisions=decisions
        )
        return decision

    def _improved(self, value: float, best: float | None) -> bool:
        """torch's ``threshold_mode="rel"``: better than ``best·(1 ∓ threshold)``; NaN never is."""
        if value != value:
            return False
        if best is None:
            return True
        if self.settings.smaller_is_better:
            return value < best * (1.0 - self.settings.threshold)
        return value > best * (1.0 + self.settings.threshold)


class EarlyStopDecision(BaseModel):
    """Stop the trial after ``step``: its metric stopped improving (``patience``), reached the
    target (``threshold``), or a search scheduler (ASHA) stopped it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0)
    step: int = Field(ge=1)
    kind: Literal["early_stop"] = "early_stop"
    reason: Literal["patience", "threshold", "scheduler"]
    metric: str
    observed: float | None  # None in a replay, or when a scheduler decided


class EarlyStopState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    best: float | None = None
    bad_evaluations: int = 0
    decision: EarlyStopDecision | None = None


class EarlyStopping:
    """Determined's early stopping over validation evaluations.

    Stops once the metric is at least as good as ``threshold`` (when set), or after ``patience``
    evaluations without an improvement larger than ``min_delta``. (A replay stops at the recorded
    step whatever its own metrics say: ``govray.train.control.controller.Controller``.)
    """

    def __init__(self, settings: EarlyStoppingPolicy, state: EarlyStopState | None = None) -> None:
        self.settings = settings
        self.state = state or EarlyStopState()

    @property
    def decision(self) -> EarlyStopDecision | None:
        return self.state.decision

    def observe(self, step: int, metrics: Mapping[str, float], seq: int) -> EarlyStopDecision | None:
        """The decision to stop after ``step`` completed steps, or None to go on."""
        if self.state.decision is not None:
            return self.state.decision
        name = self.settings.metric
        if name not in metrics:
            raise DecisionError(
                f"early_stopping watches {name!r} but the trial's validation reported only: "
                f"{', '.join(sorted(metrics)) or 'nothing'}"
            )
        value = float(metrics[name])
        sign = 1.0 if self.settings.smaller_is_better else -1.0
        state = self.state
        improved = value == value and (
            state.best is None or sign * (state.best - value) > self.settings.min_delta
        )
        best = value if improved else state.best
        bad = 0 if improved else state.bad_evaluations + 1
        reason: Literal["patience", "threshold"] | None = None
        if self.settings.threshold is not None and sign * (value - self.settings.threshold) <= 0:
            reason = "threshold"
        elif self.settings.patience is not None and bad >= self.settings.patience:
            reason = "patience"
        decision = None
        if reason is not None:
            decision = EarlyStopDecision(seq=seq, step=step, reason=reason, metric=name, observed=value)
        self.state = EarlyStopState(best=best, bad_evaluations=bad, decision=decision)
        return decision


class GateDecision(BaseModel):
    """Stop routing ``corpus_id``'s rows from global step ``step`` on (the steps already done):
    the policy's ``gate`` action on a memorization flag, as a schedule event."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0)
    step: int = Field(ge=1)
    kind: Literal["gate"] = "gate"
    corpus_id: str
    score: float | None  # the corpus's normalized memorization measure; None in a replay


class RollbackDecision(BaseModel):
    """The policy's ``rollback`` action: after ``step`` global steps a validation flagged
    ``corpora``; the weights, adapters, optimizer state and ledger went back to the last clean
    checkpoint, taken after ``to_step`` steps, and gate decisions (the next ``seq`` numbers) stop
    ``corpora`` from ``step`` on. Training continues at ``step``: the steps ``to_step .. step-1``
    are discarded, not repeated, so step numbers, metrics and the schedule only move forward and
    a gated corpus is never rolled back twice (no loop)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0)
    step: int = Field(ge=1)
    kind: Literal["rollback"] = "rollback"
    to_step: int = Field(ge=0)
    corpora: list[str] = Field(min_length=1)
    score: float | None  # the largest normalized memorization measure of ``corpora``; None in a replay

    @model_validator(mode="after")
    def _backwards(self) -> RollbackDecision:
        if self.to_step >= self.step:
            raise ValueError(f"rollback at step {self.step} to step {self.to_step}: must go back")
        return self


class LossScaleSkip(BaseModel):
    """fp16: at global step ``step - 1`` (``step`` steps done after it) the gradients of
    ``routes`` overflowed under their loss scales (``scales``, in route order), so the tensors
    those routes may update skipped the step and those routes' scales backed off. Every other
    tensor stepped. A replay skips the same tensors at the same step, whatever its own overflow
    check says (an adapter route's overflow never touches the base: removal = replay holds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0)
    step: int = Field(ge=1)
    kind: Literal["loss_scale_skip"] = "loss_scale_skip"
    routes: list[str] = Field(min_length=1)
    scales: list[float] | None  # None in a replay: the source's scales, not observed here


class PreemptedDecision(BaseModel):
    """A node of the run was being reclaimed (a spot preemption notice, read at the control
    period): after ``step`` steps every rank sealed a checkpoint and trained no further step until
    the restart, which resumes from it (no step is lost). ``nodes`` maps each reclaimed Ray node
    to the ranks it held; ``deadline_ms`` is when it goes (UNIX ms; None: the notice gave none).
    It changes no tensor: a replay does not re-apply it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int = Field(ge=0)
    step: int = Field(ge=1)
    kind: Literal["preempted"] = "preempted"
    deadline_ms: int | None
    nodes: dict[str, list[int]] = Field(min_length=1)


RecordedDecision = Annotated[
    LrDecision | EarlyStopDecision | GateDecision | RollbackDecision | LossScaleSkip | PreemptedDecision,
    Field(discriminator="kind"),
]
