"""A validation in the governed loop: evaluate, measure memorization, let the controller decide
(LR plateau, early stop, the policy's gate or rollback) and carry its decisions out."""

from __future__ import annotations

from collections.abc import Callable

from govray.governance.memorization import MemorizationReport, objective
from govray.train.control.decisions import DecisionError, EarlyStopDecision, LrDecision, RollbackDecision
from govray.train.run.reports import MemorizationFlag, StepReport
from govray.train.run.state import TrialRun
from govray.train.runspec import RunSpec

Note = Callable[[str], None]


def run_validation(
    run: TrialRun, done: int, metrics: dict[str, float], note: Note
) -> MemorizationFlag | None:
    """Evaluate and measure, let the controller decide, carry its decisions out; adds the
    validation's metrics to ``metrics`` and returns the corpora it newly flagged."""
    governed, control = run.governed, run.control
    validation, report = governed.evaluate(), governed.memorization()
    validation, report, flagged = _memorization_actions(run, done, validation, report, metrics, note)
    metrics.update(measured(validation, report))
    metrics["objective"] = objective_of(run.spec, validation, report)
    for decision in control.after_validation(done, validation):
        seen = "replayed from the record" if decision.observed is None else f"{decision.observed:.6g}"
        if isinstance(decision, LrDecision):
            governed.set_lr_scale(control.lr_scale)
            what = f"learning rate x{decision.previous_scale:g} -> x{decision.scale:g}"
        elif isinstance(decision, EarlyStopDecision):
            what = f"early stop ({decision.reason})"
        note(f"decision {decision.seq}: {what} after step {done} ({decision.metric} {seen})")
    return flagged


def _memorization_actions(
    run: TrialRun,
    done: int,
    validation: dict[str, float],
    report: MemorizationReport,
    metrics: dict[str, float],
    note: Note,
) -> tuple[dict[str, float], MemorizationReport, MemorizationFlag | None]:
    """The policy's action on this validation's flags; returns the validation and report of the
    weights that go on (after a rollback, the restored ones, measured again: the metrics, the
    objective and the LR and early-stopping rules see the model that continues, and the flagged
    model's values stay in the report as ``pre_rollback/...``), and the newly flagged corpora."""
    control = run.control
    run.last_report = report
    gated = {gate.corpus_id for gate in control.gates}
    flagged = None
    if newly := [corpus for corpus in report.flagged if corpus not in gated]:  # audited by the store
        corpora = {corpus: report.corpora[corpus].normalized for corpus in newly}
        flagged = MemorizationFlag(corpora=corpora, action=report.action, replayed=control.replaying)
    rolled_back = False
    for taken in run.act_on_memorization(done, report):
        seen = "replayed from the record" if taken.score is None else f"normalized score {taken.score:.3g}"
        if isinstance(taken, RollbackDecision):
            rolled_back = True
            metrics["rolled_back_to"] = taken.to_step
            what = f"roll back to the clean state after step {taken.to_step} ({', '.join(taken.corpora)})"
        else:
            what = f"gate {taken.corpus_id} from step {done}"
        note(f"decision {taken.seq}: {what} (memorization, {seen})")
    if not rolled_back:
        return validation, report, flagged
    metrics.update({f"pre_rollback/{name}": value for name, value in measured(validation, report).items()})
    validation, report = run.governed.evaluate(), run.governed.memorization()
    run.last_report = report
    return validation, report, flagged


def measured(validation: dict[str, float], report: MemorizationReport) -> dict[str, float]:
    """A validation's metrics: the trial's own, the memorization score and flags, and each
    corpus's measures (``loss_gap/C``, each detector's gap such as ``min_k_prob/C``,
    ``exposure_bits/C``, ``entropy_drop/C``)."""
    measured = {**validation, "memorization_score": report.score, "memorization_flagged": len(report.flagged)}
    for corpus_id, verdict in report.corpora.items():
        for name, value in verdict.measures.model_dump().items():
            if value is not None:
                measured[f"{name}/{corpus_id}"] = value
    return measured


def objective_of(spec: RunSpec, metrics: dict[str, float], report: MemorizationReport) -> float:
    """The search objective: the searcher's metric penalized by the memorization score."""
    if spec.objective_metric not in metrics:
        raise DecisionError(
            f"the searcher's metric {spec.objective_metric!r} was not reported; "
            f"validation reported: {', '.join(sorted(metrics))}"
        )
    return objective(
        float(metrics[spec.objective_metric]), report.score, spec.memorization_lambda, spec.smaller_is_better
    )


def finished_clone_report(run: TrialRun, done: int) -> StepReport:
    """A PBT clone of a trial that had finished (its last step, or its early stop) has nothing left
    to train. It ends with its donor's state measured and checkpointed under its own name (weights,
    ledger and decisions unchanged), so its record has a last checkpoint, a ledger and an
    attestation of its own: this is the report that goes with that checkpoint."""
    governed, control = run.governed, run.control
    validation, memorization = governed.evaluate(), governed.memorization()
    run.last_report = memorization
    control.check_applied(done)
    return StepReport(
        step=done,
        epoch=governed.schedule.locate(done - 1)[0],
        metrics={
            **measured(validation, memorization),
            "objective": objective_of(run.spec, validation, memorization),
        },
        ledger=governed.ledger.to_json(),
        decisions=tuple(control.decisions),
        stop="early_stop" if control.stopped_early else None,
        cloned_from_run=run.cloned_from_run,
    )
