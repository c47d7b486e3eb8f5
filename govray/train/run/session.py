"""Where a trial runs, as twins of one ``Session`` protocol, chosen once when it starts.

The governed loop never asks where it runs. It asks its session to look for a stop request,
to write a checkpoint, to deliver a report, and where to resume:

- ``LocalSession``: one worker in the driver's process (Ray Train V2 local mode); reports go
  straight to the driver's ``RunRecorder``.
- ``RayTrainSession``: N Ray Train workers; rank 0 sends its reports to the driver's
  ``ReportSink`` actor without waiting, a few per actor call (Ray Train V2 keeps one unread
  report per worker and its controller polls every 2 s: reporting through it stalls fast steps),
  and writes each signed checkpoint into the run directory itself (the resume rule reads that
  directory, not Ray's index).
- ``TuneSession``: a 1-worker Tune trial; the reports since the last validation reach Tune with
  it, and its checkpoint becomes the Tune checkpoint (what ASHA stops and PBT clones). Its twin
  ``HostedSession`` trains in a warm trial host and hands each validation to the Tune trial's
  process, which reports it to Tune.

All three read the driver's pause/kill request (``govray experiment pause|kill``) the same way:
rank 0 looks at the control file every ``control_period`` steps and broadcasts what it found
while the step computes, so every rank stops at the same step boundary. The flag is a host
object: it goes through the worker's gloo host group (``Worker.host_group``), never the run's
NCCL group, so reading it waits for the broadcast only, not for the step's GPU work. At the same
period a Ray Train worker asks Ray whether a node of the run is being reclaimed
(``govray.train.control.preemption``); the other two never get such a notice.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from govray.train.checkpoints.files import CHECKPOINT_PREFIX
from govray.train.context import WorkerContext
from govray.train.control.preemption import PreemptionNotice, PreemptionWatch, wait_for_restart
from govray.train.run.reports import StepReport

STOP_CODES = {"pause": 1, "kill": 2}  # what the driver writes in the control file
STOP_NAMES = {code: name for name, code in STOP_CODES.items()}
REPORT_KEY = "govray_reports"  # a Tune result's reports since the last one, as a JSON list
LAST_KEY = "govray_last"  # 1 in a trial's last Tune result: it ends the trial (``ends_trial``)
EARLY_STOP_KEY = "govray_early_stop"  # 1 in the last result of a trial its own early stopping ended
Save = Callable[[Path], None]  # writes and signs a checkpoint into a folder


class Session(Protocol):
    """What the governed loop asks of the place it runs in."""

    passed_over: list[str]  # after resume_point: why newer checkpoints were not resumed from

    @property
    def run_dir(self) -> Path:
        """Where this worker's checkpoints are written (what its signer signs)."""

    def resume_point(self) -> Path | None:
        """The verified checkpoint this worker group resumes from, or None: a fresh start."""

    def look_for_stop(self, step: int) -> None:
        """Before ``step``: start looking for a pause/kill request (every ``control_period`` steps)."""

    def stop_requested(self) -> str | None:
        """After the step: ``pause`` or ``kill`` if the driver asked before it began."""

    def look_for_preemption(self, step: int) -> PreemptionNotice | None:
        """Before ``step`` (every ``control_period`` steps, every rank): a new reclaim notice."""

    def await_restart(self, notice: PreemptionNotice) -> float:
        """After the checkpoint sealed on ``notice``: every report delivered, wait for the restart;
        returns the seconds waited if none came (the loop then trains on)."""

    def checkpoint(self, steps_done: int, save: Save) -> str:
        """Write (rank 0) and persist a checkpoint; returns the folder the driver records."""

    def report(self, report: StepReport) -> None:
        """Deliver rank 0's report (other ranks report nothing)."""

    def close(self) -> None:
        """At the end of the run: every report delivered."""


class _RunDirectory:
    """What every session shares: the stop request, and checkpoints in the run directory."""

    def __init__(self, context: WorkerContext) -> None:
        self.spec, self.attempt, self.trust = context.spec, context.attempt, context.trust
        self.directory = Path(context.spec.run_dir)  # the run's (a Tune trial's: a scratch folder)
        self.worker = context.worker
        self.storage = context.storage
        self._stop: tuple[torch.Tensor, Any] | None = None
        # Who writes each checkpoint, and how the ranks agree on the one they resume from.
        self.layout = context.parallel.layout
        self.passed_over: list[str] = []  # why newer checkpoints were not resumed from
        self.preemption = PreemptionWatch(self.spec.control_period, ask=None)  # a Ray Train worker asks
        self._notice_seen_at = 0.0

    @property
    def run_dir(self) -> Path:
        return self.directory

    def resume_point(self) -> Path | None:
        """By one rule: the newest checkpoint of the run directory that verifies (a report lost
        when a worker died leaves a folder only the directory shows); with none there, a search
        segment's or a restored Tune trial's ``resume_checkpoint``."""
        if self.spec.run_dir:
            newest = self._newest_verified(self.directory)
            if newest is not None:
                return newest
        if given := self.attempt.resume_checkpoint:
            self.storage.fetch(Path(given))  # a segment's, from the bucket
            return Path(given)
        return None

    def _newest_verified(self, run_dir: Path) -> Path | None:
        """The resume rule, as the run's layout applies it (the ranks of a sharded run together);
        why newer checkpoints were passed over is kept."""
        newest, refusals = self.layout.newest_verified(run_dir, self.trust, self.storage, self.worker)
        self.passed_over.extend(refusals)
        return newest

    def look_for_stop(self, step: int) -> None:
        if (step + 1) % self.spec.control_period:
            self._stop = None
            return
        code = 0
        if self.worker.rank == 0 and self.spec.control_file:
            try:
                code = STOP_CODES.get(Path(self.spec.control_file).read_text().strip(), 0)
            except FileNotFoundError:
                code = 0
        flag = torch.tensor([code], dtype=torch.int64)  # a host tensor, for the host group
        work = None
        if self.worker.distributed:
            work = dist.broadcast(flag, src=0, group=self.worker.host_group, async_op=True)
        self._stop = (flag, work)  # the broadcast runs while the step computes

    def stop_requested(self) -> str | None:
        if self._stop is None:
            return None
        flag, work = self._stop
        if work is not None:
            work.wait()
        return STOP_NAMES.get(int(flag.item()))

    def look_for_preemption(self, step: int) -> PreemptionNotice | None:
        notice = self.preemption.look(step)
        if notice is not None:
            self._notice_seen_at = time.time()
        return notice

    def await_restart(self, notice: PreemptionNotice) -> float:
        self.flush()
        return wait_for_restart(notice, self._notice_seen_at)

    def flush(self) -> None:
        """Every report delivered to the driver (those that go through Ray)."""

    def checkpoint(self, steps_done: int, save: Save) -> str:
        """Rank 0 writes the checkpoint (under FSDP every rank writes its shards into the folder
        rank 0 made fresh) and puts it on the storage before it is reported."""
        folder = self.directory / f"{CHECKPOINT_PREFIX}{steps_done:08d}"
        if self.worker.rank == 0 and folder.exists():  # a partial folder a killed attempt left
            self.storage.delete_directory(folder)  # (none verified: it was not resumed from)
        self.layout.ready_to_write(self.worker)  # (FSDP: the folder is fresh before any rank writes there)
        if self.layout.writes(self.worker.rank):
            save(folder)
        if self.worker.rank == 0:
            self.storage.upload(folder)  # then reported: a recorded checkpoint is on storage
        return str(folder)

    def close(self) -> None:
        return None


class LocalSession(_RunDirectory):
    """One worker in the driver's process: reports go straight to ``deliver`` (the recorder)."""

    def __init__(self, context: WorkerContext, deliver: Callable[[StepReport], None]) -> None:
        super().__init__(context)
        self.deliver = deliver

    def report(self, report: StepReport) -> None:
        self.deliver(report)


WorkerPlace = dict[str, Any]  # a worker's {"pid": int, "placement_group": hex id, "" outside one}


class ReportSink:
    """A Ray actor on the driver's side: rank 0's reports, queued until the driver takes them, and
    where each worker runs (what a search trial needs to free its placement group itself)."""

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.workers: dict[int, WorkerPlace] = {}

    def put(self, reports: list[str]) -> None:
        self.reports.extend(reports)

    def take(self) -> list[str]:
        taken, self.reports = self.reports, []
        return taken

    def announce(self, rank: int, place: WorkerPlace) -> None:
        self.workers[rank] = place

    def places(self) -> dict[int, WorkerPlace]:
        return dict(self.workers)


def worker_places(sink: Any) -> dict[int, WorkerPlace]:
    """Where the sink's run has its workers, by rank (the latest worker group's)."""
    import ray

    places: dict[int, WorkerPlace] = ray.get(sink.places.remote())
    return places


def open_sink(name: str) -> Any:
    """A new ``ReportSink`` actor called ``name`` (in this job's namespace, where its workers look),
    on the driver's node as Ray Train's controller is: a worker node reclaimed mid-run (an elastic
    run continues without it) must not take the run's reports with it."""
    import ray

    if not ray.is_initialized():
        ray.init()  # what the actor's creation would do: join RAY_ADDRESS's cluster, or start one
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}  # Ray's own label of a node
    return ray.remote(num_cpus=0)(ReportSink).options(name=name, label_selector=here).remote()


def taken_reports(sink: Any) -> list[StepReport]:
    """What the sink has queued since the last look."""
    import ray

    return [StepReport.model_validate_json(report) for report in ray.get(sink.take.remote())]


class RayTrainSession(_RunDirectory):
    """A Ray Train worker: rank 0 sends its reports to the driver's sink without waiting.

    Reports are coalesced: one actor call carries those of the last ``SEND_PERIOD`` seconds (the
    driver takes them twice a second), and a report that carries a checkpoint, a ledger or a stop
    goes at once with those before it. Between checkpoints nothing else depends on a report, and
    a worker that dies loses only reports its resume makes again."""

    SEND_PERIOD = 0.25

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        sink, worker = context.attempt.report_sink, context.worker
        self._sink: Any = None
        self._pending: list[str] = []
        self._sent: list[Any] = []
        self._last_send = time.monotonic()
        if sink:  # every rank says where it runs (its Ray Train placement group)
            import ray

            group = ray.util.get_current_placement_group()
            self._sink = ray.get_actor(sink)
            place = {"pid": os.getpid(), "placement_group": group.id.hex() if group is not None else ""}
            self._sent.append(self._sink.announce.remote(worker.rank, place))
        import ray.train

        self.preemption.ask = ray.train.get_preemption_info

    def report(self, report: StepReport) -> None:
        if self.worker.rank != 0:
            return
        self._pending.append(report.model_dump_json())
        urgent = report.checkpoint is not None or report.ledger is not None or report.stop is not None
        if urgent or time.monotonic() - self._last_send >= self.SEND_PERIOD:
            self._send()

    def _send(self) -> None:
        if not self._pending:
            return
        import ray

        if self._sink is None:
            self._sink = ray.get_actor(self.attempt.report_sink)
        self._sent.append(self._sink.put.remote(self._pending))
        self._pending, self._last_send = [], time.monotonic()
        if len(self._sent) > 64:  # forget those delivered
            _, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0)

    def flush(self) -> None:
        import ray

        self._send()
        ray.get(self._sent)
        self._sent = []

    def close(self) -> None:
        self.flush()  # the run ends when the driver can read all of its reports


class TuneSession(_RunDirectory):
    """A 1-worker Tune trial: reports reach Tune with each validation, whose checkpoint Tune keeps."""

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        # Its checkpoints go to a scratch folder Tune copies from, not the run's directory: the one
        # the trial's launch opened the signer for (without a channel it seals nothing).
        channel = context.attempt.signer
        self.directory = Path(channel.run_dir if channel else tempfile.mkdtemp(prefix="govray-trial-"))
        self.pending: list[StepReport] = []

    def report(self, report: StepReport) -> None:
        self.pending.append(report)
        if report.validated:  # a validation (the last step always is one)
            self.deliver(tune_result(self.pending, self.spec.max_steps), report.checkpoint)
            self.pending.clear()
        if report.checkpoint is not None:
            shutil.rmtree(report.checkpoint, ignore_errors=True)  # Tune keeps its copy

    def deliver(self, result: dict[str, Any], folder: str | None) -> None:
        """Hand one validation's result and checkpoint folder to Tune; returns once Tune lets the
        trial go on (``SystemExit`` when Tune stopped it)."""
        import ray.tune
        from ray.train import Checkpoint

        ray.tune.report(result, checkpoint=Checkpoint.from_directory(folder) if folder else None)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class HostedSession(TuneSession):
    """A 1-worker Tune trial trained in a warm trial host (``govray.platform.search.hosts``): each
    validation goes to the Tune trial's process, which reports it to Tune and answers whether the
    trial goes on, exactly where ``ray.tune.report`` would have returned or raised."""

    def __init__(
        self,
        context: WorkerContext,
        relay: Callable[[dict[str, Any], str | None], bool],
        abandoned: Callable[[], bool],
    ) -> None:
        super().__init__(context)
        self.relay, self.abandoned = relay, abandoned

    def deliver(self, result: dict[str, Any], folder: str | None) -> None:
        if not self.relay(result, folder):
            raise SystemExit(0)  # what ray.tune.report raises in a trial Tune stopped

    def stop_requested(self) -> str | None:
        """A trial whose Tune trial died ends at this step boundary (nobody would take its
        results); else what the driver's control file says."""
        return "kill" if self.abandoned() else super().stop_requested()


def tune_result(reports: list[StepReport], max_steps: int) -> dict[str, Any]:
    """One Tune result for a validation: its objective and step, with every report since the
    previous validation (Tune insists on the objective in each result), and whether it is the
    trial's last (its last step, or its early stop)."""
    last = reports[-1]
    return {
        REPORT_KEY: json.dumps([report.model_dump(mode="json") for report in reports], sort_keys=True),
        "step": last.step,
        "objective": last.metrics["objective"],
        LAST_KEY: int(last.step >= max_steps or last.stop == "early_stop"),
        EARLY_STOP_KEY: int(last.stop == "early_stop"),
    }


def tune_reports(result: dict[str, Any]) -> list[StepReport]:
    """The reports a Tune result relays (none in a result Tune made itself)."""
    return [StepReport.model_validate(report) for report in json.loads(result.get(REPORT_KEY, "[]"))]
