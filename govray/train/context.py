"""What one worker is given once, when it starts, and hands down: its ``WorkerContext``.

Determined gives trial code one composed ``core.Context`` (distributed, checkpoint, preempt,
train); a govray worker gets the same from ``WorkerContext.open``, built once per worker:

- ``attempt``: this fit of the run (``govray.train.runspec.Attempt``): its ``spec``, the
  ``RunSpec`` the driver planned, complete (nothing edits it after ``plan_run``), and what this fit
  alone asks (where it resumes or pauses, whom it reports to, which code it imports);
- ``worker``: rank, world size, device, the host group;
- ``storage``: the experiment's storage, one interface with a local and an object-store twin
  (``govray.core.storage``), opened once: never absent;
- ``parallel``: the parallelism twin (single, DDP, FSDP, HSDP: ``govray.train.parallel``), built
  once, which answers everything that differs between them;
- ``signer``: what the worker may ask sealed (its own run's checkpoints, by the platform's signer
  over the channel its launch opened: ``govray.train.checkpoints.signer``; no key in the worker);
- ``session``: where it runs (``govray.train.run.session``: in-process, Ray Train, Tune);
- ``log`` and ``timings``: the rank's log file and where its wall time went.

Nothing below it opens storage, builds a twin, reaches the signer or parses the spec again; a component
takes the parts it needs (``TrialRun`` the context, a checkpoint layout the model, optimizer,
storage and worker), never the whole run.

Example::

    context = WorkerContext.open(attempt, RayTrainSession, WorkerTimings())
    run = TrialRun.open(context)
    context.session.report(report)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from govray.core.errors import SignatureError
from govray.core.keys import TrustConfig
from govray.core.logs import WorkerLog
from govray.core.storage import Storage, open_storage
from govray.train.checkpoints.signer import ChannelSigner, ManifestSigner, NoSigner
from govray.train.parallel.strategies import Single, parallelism
from govray.train.parallel.worker import Worker
from govray.train.run.timings import WorkerTimings
from govray.train.runspec import Attempt, RunSpec

if TYPE_CHECKING:
    from govray.train.run.session import Session

OpenSession = Callable[["WorkerContext"], "Session"]  # a session built on the worker's context


@dataclass(frozen=True)
class WorkerContext:
    attempt: Attempt
    worker: Worker
    storage: Storage
    parallel: Single
    signer: ManifestSigner
    session: Session | None = None  # set once, by ``open``: a context built for a tool has none
    log: WorkerLog | None = None  # (a run planned without a log directory has none)
    timings: WorkerTimings = dataclasses.field(default_factory=WorkerTimings)

    @property
    def spec(self) -> RunSpec:
        """The run's spec, as planned."""
        return self.attempt.spec

    @property
    def trust(self) -> TrustConfig:
        """The platform keys whose checkpoints this worker accepts: the operator's."""
        return self.attempt.trust

    @classmethod
    def of(
        cls,
        spec: RunSpec,
        worker: Worker,
        trust: TrustConfig | None = None,
        signer: ManifestSigner | None = None,
    ) -> WorkerContext:
        """The context of a worker outside any session: what a tool (or a test) that builds a
        trial's state itself needs, its storage and twin built as a run's are; it seals through
        ``signer`` (by default nothing: no launch opened a channel for it) and accepts checkpoints
        under ``trust`` (by default the operator's)."""
        storage = open_storage(spec.storage)
        parallel = parallelism(spec.strategy, worker, spec.settings.precision, spec.shard_group)
        return cls(Attempt.of(spec, trust=trust), worker, storage, parallel, signer or NoSigner())

    @classmethod
    def open(cls, attempt: Attempt, open_session: OpenSession, timings: WorkerTimings) -> WorkerContext:
        """The worker's context for ``attempt``, its session opened (in ``timings``' "open" part)
        and its log (``LOG_DIR/rank-N.log``, continuing what this rank wrote on another node) ready."""
        spec = attempt.spec
        # (the attempt's trust, the operator's as the launch read it: a worker reads no settings)
        context = dataclasses.replace(
            cls.of(spec, Worker.detect(spec.use_gpu), attempt.trust), attempt=attempt, timings=timings
        )
        with timings.part("open"):
            session = open_session(context)
        log = None
        if spec.log_dir:
            path = Path(spec.log_dir) / f"rank-{context.worker.rank}.log"
            context.storage.pull_growing(path)  # a resumed run appends to what this rank wrote elsewhere
            log = WorkerLog(path, context.worker.rank)
        signer = _channel_signer(attempt, session.run_dir)
        opened = dataclasses.replace(context, session=session, log=log, signer=signer)
        if isinstance(signer, ChannelSigner) and opened.writes and opened.worker.rank == 0:
            signer.reach()  # the rank that seals: refused now, not at the first checkpoint
        return opened

    @property
    def opened(self) -> Session:
        """The session (a context built by ``open`` always has one)."""
        if self.session is None:
            raise RuntimeError("this worker context was built outside a session (WorkerContext.of)")
        return self.session

    @property
    def writes(self) -> bool:
        """This rank writes (part of) the run's checkpoints: the run signs them, and its layout
        has this rank write (rank 0; under FSDP every rank its shards)."""
        return self.signer.signs and self.parallel.layout.writes(self.worker.rank)

    def note(self, message: str) -> None:
        """A line in the rank's log (none without a log)."""
        if self.log is not None:
            self.log.write(message)


def _channel_signer(attempt: Attempt, run_dir: Path) -> ManifestSigner:
    """The worker's signer: its attempt's channel, opened for the directory its session writes
    checkpoints in (the session's run directory: a Tune trial's own); none: it seals nothing."""
    channel = attempt.signer
    if channel is None:
        return NoSigner()
    if Path(channel.run_dir).resolve() != Path(run_dir).resolve():
        raise SignatureError(
            f"the launch opened the signer for {channel.run_dir}, but this worker writes its "
            f"checkpoints in {run_dir}"
        )
    return ChannelSigner(channel)
