"""The governed training loop: the whole run of one worker, wherever it runs.

``train_worker`` opens the worker's ``Session`` (chosen once: Ray Train worker, in-process, or a
Tune trial), resumes or starts, then for each step of the schedule::

    governed.step(step)                           # govray.train.step.governed: never waits for the device
    at a report boundary: refuse a non-finite gradient since the last one; all-reduce the losses;
        at a validation: evaluate, measure memorization, let the controller decide (LR, early
        stop, gate, rollback); at a checkpoint: seal it
    session.report(StepReport(...))               # typed: metrics, and what the driver acts on

A pause request checkpoints at the next step boundary and returns (so does reaching the attempt's
``pause_at``: the end of a replay's segment); a kill request returns without one. A node's reclaim
notice (a spot preemption, ``govray.train.control.preemption``) seals a checkpoint at the next step
boundary, records a ``preempted`` decision and trains no further step until Ray Train restarts the
worker group, which resumes from that checkpoint: no step is lost. After a failure Ray Train
restarts every worker, and each resumes from the newest verified checkpoint (per-step seeding: the
schedule and the randomness need no RNG state).
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path
from typing import Any

import torch

from govray.core.runtime import ray_node_id
from govray.core.storage import StorageError
from govray.train.context import OpenSession, WorkerContext
from govray.train.control.preemption import PreemptionNotice
from govray.train.control.validation import finished_clone_report, run_validation
from govray.train.parallel.layouts import own_run
from govray.train.parallel.worker import Worker, all_reduce_sums
from govray.train.reproduce.snapshots import CodeSnapshot, use_recorded_code
from govray.train.run.reports import StepReport
from govray.train.run.session import RayTrainSession
from govray.train.run.state import TrialRun
from govray.train.run.timings import WorkerTimings
from govray.train.runspec import attempt_of
from govray.train.trial import importable


def train_worker(config: dict[str, Any], session: OpenSession = RayTrainSession) -> None:
    """``train_loop_per_worker`` for Ray Train (and, with another ``session``, for one worker
    in-process or in a Tune trial): ``config`` is the ``Attempt``'s JSON (its signer capability
    out of band: ``runspec.train_loop_config``). Each rank logs to
    ``STORAGE/logs/RUN/rank-N.log`` (``govray trial logs``); a Ray Train worker also tees its
    stdout and stderr there."""
    attempt = attempt_of(config)
    spec = attempt.spec
    torch.set_num_threads(spec.threads)
    context = WorkerContext.open(attempt, session, WorkerTimings())
    if attempt.recorded_code:  # the trial's code, before its class is first looked up
        snapshot = CodeSnapshot.model_validate(spec.reproducibility["code"])
        use_recorded_code(snapshot, Path(attempt.code_dir), context.storage)
    else:
        importable(attempt.code_dir)  # Ray Train moves workers into the run directory
    log, timings, opened = context.log, context.timings, context.opened
    # In-process the worker is the driver, whose terminal shows a progress bar: no tee.
    tee = log is not None and isinstance(opened, RayTrainSession)
    with log or contextlib.nullcontext(), log.capture() if tee and log else contextlib.nullcontext():
        try:
            _train(context)
        except BaseException:
            context.note(traceback.format_exc())
            raise
        finally:
            with timings.part("close"):
                opened.close()
            context.note(timings.line())
            _publish_log(context)


def _train(context: WorkerContext) -> None:
    spec, worker, session, timings, note = (
        context.spec,
        context.worker,
        context.opened,
        context.timings,
        context.note,
    )
    run, start, resumed = _opened(context)
    governed, control = run.governed, run.control
    if not resumed and any(clean.on_storage for clean in control.clean_states.values()) and context.writes:
        # Under FSDP a clean state is a checkpoint, not a copy in memory: the starting one too.
        _deliver(run, StepReport(step=0, epoch=0, metrics={}), context, report_it=False)
    node = ray_node_id()
    note(
        f"rank {worker.rank} of {worker.world_size}{f' on Ray node {node}' if node else ''}: "
        f"steps {start + 1}..{spec.max_steps}, "
        f"policy {spec.policy.name} v{spec.policy.version}, excluded corpora {list(spec.excluded_corpora)}"
    )
    if _nothing_left(run, start, context):
        return
    loss_sum, examples = torch.zeros((), dtype=torch.float64, device=worker.device), 0
    for step in range(start, spec.max_steps):
        session.look_for_stop(step)
        notice = session.look_for_preemption(step)
        with timings.part("first_step" if step == start else "steps"):
            step_loss, step_examples = governed.step(step)  # nothing read from the device
        loss_sum, examples = loss_sum + step_loss, examples + step_examples
        done = step + 1
        last = done == spec.max_steps
        stop = session.stop_requested() or ("pause" if done == context.attempt.pause_at else None)
        if last:
            stop, notice = None, None  # the run is over anyway
        validate = last or bool(spec.validation_period and done % spec.validation_period == 0)
        save = validate or done % spec.checkpoint_period == 0 or stop == "pause" or notice is not None
        if done % spec.report_every and not save and stop is None:
            continue
        # The boundary: the device is read here, and a non-finite gradient since the last one
        # stops the run before any report, clean state or checkpoint holds its state.
        governed.governor.check_finite()
        metrics = _training_metrics(loss_sum, examples, worker)
        loss_sum, examples = torch.zeros_like(loss_sum), 0
        flagged = None
        if validate:
            with timings.part("validation"):
                flagged = run_validation(run, done, metrics, note)
            last = last or control.stopped_early  # an early stop ends the trial here, with its ledger
        if last:
            control.check_applied(done)
        if notice is not None:
            control.preempted(done, notice.deadline_ms, notice.nodes)
        report = StepReport(
            step=done,
            epoch=governed.schedule.locate(step)[0],
            metrics=metrics,
            ledger=governed.ledger.to_json() if last else None,
            decisions=tuple(control.decisions) if validate or notice is not None else (),
            flagged=flagged,
            stop="early_stop" if control.stopped_early else stop,  # type: ignore[arg-type]
            cloned_from_run=run.cloned_from_run,
            world_history=tuple(run.world_history),
        )
        note(_line(report) + (" (checkpoint)" if save and context.writes else ""))
        if save:  # the log in object storage before the checkpoint is reported: never behind it
            _publish_log(context)
        _deliver(run, report, context, save)
        if stop is not None:
            note(f"{stop} requested: stopped after step {done}" + (" with a checkpoint" if save else ""))
            return
        if control.stopped_early:
            note(f"stopped early after step {done} of {spec.max_steps}")
            return
        if notice is not None:
            _await_restart(context, notice, done)
    note(f"completed {spec.max_steps} steps")


def _opened(context: WorkerContext) -> tuple[TrialRun, int, bool]:
    """(the trial's run, the step it starts after, whether it resumed): restored from the session's
    newest verified checkpoint, or started from the spec's start checkpoint, or from scratch."""
    spec, session, note, timings = context.spec, context.opened, context.note, context.timings
    with timings.part("build"):
        run = TrialRun.open(context)
    start, resume = 0, session.resume_point()
    for reason in session.passed_over:
        note(f"passed over a newer checkpoint that does not verify: {reason}")
    if resume is not None:
        with timings.part("restore"):
            start = run.restore(resume, of_run=own_run(resume, session.run_dir))
        worlds = ", ".join(f"{workers} from step {step}" for step, workers in run.world_history)
        note(f"workers so far: {worlds}")
        note(f"resumed from a verified checkpoint at step {start}")
        return run, start, True
    if spec.start_checkpoint:
        run.start_from(Path(spec.start_checkpoint))
        note(f"starting from checkpoint {spec.start_checkpoint} (its step {run.source['step']})")
    run.keep_clean(0)  # the starting weights are the first rollback target
    return run, start, False


def _nothing_left(run: TrialRun, start: int, context: WorkerContext) -> bool:
    """Whether the run starts where its trial already ended: a PBT clone of a finished (or early
    stopped) state reports that state's objective; a checkpoint after the early stop trains nothing."""
    if (run.control.stopped_early or start >= run.spec.max_steps) and run.cloned_from_run:
        report = finished_clone_report(run, start)
        context.note(
            f"a clone of {run.restored_from_run}'s finished state at step {start}: nothing left to "
            f"train; objective={report.metrics['objective']:.6g} (checkpoint)"
        )
        _deliver(run, report, context)
        return True
    if run.control.stopped_early:
        context.note(f"the checkpoint at step {start} is after the trial's early stop: nothing left to train")
        return True
    return False


def _training_metrics(loss_sum: torch.Tensor, examples: int, worker: Worker) -> dict[str, float]:
    """The mean training loss over every rank's examples since the last boundary, and their count."""
    totals = all_reduce_sums({"loss": float(loss_sum), "examples": float(examples)}, worker)
    return {
        "training_loss": totals["loss"] / totals["examples"] if totals["examples"] else float("nan"),
        "examples": float(int(totals["examples"])),
    }


def _await_restart(context: WorkerContext, notice: PreemptionNotice, done: int) -> None:
    """After a preemption notice's checkpoint: wait for Ray Train to restart the group; past the
    notice's deadline with no restart, train on."""
    note = context.note
    note(
        f"preemption notice for Ray nodes {notice.nodes} (node: ranks), deadline_ms "
        f"{notice.deadline_ms}: checkpoint sealed after step {done}; training no further step"
    )
    _publish_log(context)  # the node may go before the log is copied again
    waited = context.opened.await_restart(notice)
    note(f"no restart after {waited:.0f} s, past the notice's deadline: training on from step {done}")


def _deliver(
    run: TrialRun, report: StepReport, context: WorkerContext, save: bool = True, *, report_it: bool = True
) -> None:
    """Report (unless not ``report_it``), after sealing the checkpoint that goes with it when
    ``save`` and the run signs its checkpoints (its layout says which ranks write: under FSDP
    every rank its shards)."""
    session, timings = context.opened, context.timings
    if save and context.writes:

        def write(folder: Path) -> None:
            sealed = report.model_copy(update={"checkpoint": str(folder)})
            run.save(folder, report.step, sealed.model_dump(mode="json"))

        with timings.part("checkpoint"):
            report = report.model_copy(update={"checkpoint": session.checkpoint(report.step, write)})
    if report_it:
        with timings.part("report"):
            session.report(report)


def _line(report: StepReport) -> str:
    """A report as one line of the rank's log."""
    shown = {"step": report.step, "epoch": report.epoch, **report.metrics}
    words = [
        f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in shown.items()
    ]
    return " ".join(
        [word for word in words if "/" not in word.partition("=")[0]]
        + ([f"stop={report.stop}"] if report.stop else [])
    )


def _publish_log(context: WorkerContext) -> None:
    """Copy a rank's log to object storage (at each checkpoint and at the end), where ``govray
    trial logs`` reads every node's ranks; a failed copy is noted in the log, never fatal."""
    if context.log is None:
        return
    try:
        context.storage.upload(context.log.path)
    except StorageError as error:
        context.note(f"could not copy this log to {context.storage.uri}: {error}")
