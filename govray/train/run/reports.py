"""What a trial reports, typed: a ``StepReport`` per report boundary, serialised once.

``metrics`` holds only measurements (training loss, examples, validation values, memorization
measures, the objective). What the driver must act on travels beside them: the ledger (a trial's
last report), the decisions taken so far, the corpora a validation newly flagged, why the trial
stopped, and the run a PBT clone continued. A checkpoint keeps the report it went with
(``report.json``), so a report lost with a dying worker is recovered from storage.

Example::

    report = StepReport(step=10, epoch=0, metrics={"training_loss": 0.7, "examples": 320.0})
    StepReport.model_validate_json(report.model_dump_json()) == report  # -> True
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from govray.train.control.decisions import RecordedDecision

StopReason = Literal["pause", "kill", "early_stop"]


class MemorizationFlag(BaseModel):
    """Corpora a validation flagged that were not gated already (audited by the driver)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpora: dict[str, dict[str, float]]  # corpus → its threshold-normalized measures
    action: str  # the policy's: flag, gate or rollback
    replayed: bool


class StepReport(BaseModel):
    """One report of the governed loop (rank 0's; every scalar is summed over the workers)."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    step: int  # steps completed
    epoch: int
    metrics: dict[str, float]
    checkpoint: str | None = None  # the signed checkpoint folder written at this step, if any
    ledger: dict[str, Any] | None = None  # the trial's ledger (``Ledger.to_json``): its last report
    decisions: tuple[RecordedDecision, ...] = ()  # every decision taken (or applied) so far
    flagged: MemorizationFlag | None = None
    stop: StopReason | None = None  # the trial stops after this report, and why
    cloned_from_run: str | None = None  # a PBT clone: the run whose state it continued
    # [(from_step, workers), ...]: the world sizes the run trained on so far (its checkpoints'
    # history, then this world's size); empty in the report of a run's starting state.
    world_history: tuple[tuple[int, int], ...] = ()

    @property
    def workers(self) -> int | None:
        """The world size that made this report (None: not recorded)."""
        return self.world_history[-1][1] if self.world_history else None

    @property
    def validated(self) -> bool:
        """Whether this report carries a validation (its objective)."""
        return "objective" in self.metrics

    @property
    def ends_trial(self) -> bool:
        """The trial's last report: its ledger is in it (the last step, or an early stop)."""
        return self.ledger is not None

    @classmethod
    def parse(cls, data: dict[str, Any]) -> StepReport:
        """A report as a checkpoint's ``report.json`` holds it (this model's JSON form)."""
        return cls.model_validate(data)
