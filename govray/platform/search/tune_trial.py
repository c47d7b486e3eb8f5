"""What runs inside a Tune trial of a search: one governed trial, planned there for its sample.

One worker trains in the Tune trial's own process (``TuneSession``); N workers train in one nested
``TorchTrainer`` run that keeps its worker group across rungs, while the Tune trial relays its
reports: each validation reaches Tune with its signed checkpoint as the Tune checkpoint (so PBT can
hand any trial's state to another). A trial Tune stops has its run's placement group removed here
and by the driver (``govray.platform.search.placement_guard``).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.tune

from govray.config.experiment import ExperimentConfig
from govray.core.errors import GovrayError
from govray.core.storage import Storage
from govray.platform.run.fitting import fit_polled, pass_request
from govray.platform.run.plan import plan_run
from govray.platform.run.preflight import CheckedPolicy
from govray.platform.search.placement_guard import PLACES_KEY
from govray.signer.local import close_channel, open_channel
from govray.train.checkpoints.base_file import materialize_base
from govray.train.checkpoints.folders import (
    checkpoint_report,
    newest_verified_checkpoint,
    present_checkpoint,
)
from govray.train.reproduce.snapshots import CodeSnapshot
from govray.train.run.loop import OpenSession, train_worker
from govray.train.run.reports import StepReport
from govray.train.run.session import (
    LAST_KEY,
    TuneSession,
    WorkerPlace,
    open_sink,
    taken_reports,
    tune_result,
    worker_places,
)
from govray.train.runspec import Attempt

TUNE_TRIAL_MEMORY = 64 * 1024**2  # what the Tune trial of an N-worker trial reserves (bytes)
RELAY_PERIOD = 0.2  # seconds between the Tune trial's looks at its run's reports


class SearchError(GovrayError):
    """The search cannot start or finished without a usable trial."""

    exit_code = 15


@dataclass(frozen=True)
class SearchSetup:
    """What every Tune trial needs besides its hyperparameters (plain data: it crosses processes)."""

    config_json: str
    checked: CheckedPolicy  # with the trust read at preflight: every trial checks against it
    shard_root: str
    reproducibility: dict[str, Any]  # the search's record: every trial's row keeps it
    report_every: int
    validation_period: int | None
    database_url: str
    code: CodeSnapshot  # the record's: every trial imports it (whatever the working directory holds)
    threads: int  # the record's: every trial's torch threads per worker


def trial_run_name(config: ExperimentConfig, tune_trial_id: str) -> str:
    return f"{config.name}-{tune_trial_id}"


def tune_trial(params: dict[str, Any], setup: SearchSetup) -> None:
    """The Tune function trainable of a trial trained in the Tune trial's own process: one governed
    trial, reporting at every validation with its signed checkpoint (Tune hands a restored or
    PBT-cloned trial that checkpoint back). ``govray.platform.search.hosts.hosted_trial`` is its
    twin for 1-worker CPU trials, which train in a warm trial host instead."""
    restored = ray.tune.get_checkpoint()
    with restored.as_directory() if restored is not None else contextlib.nullcontext(None) as resume:
        train_trial(params, setup, ray.tune.get_context().get_trial_id(), resume, TuneSession)


def train_trial(
    params: dict[str, Any],
    setup: SearchSetup,
    tune_trial_id: str,
    resume: str | None,
    session: OpenSession,
) -> None:
    """Plan the trial for its sample, then train it: one worker here with ``session`` (a
    ``TuneSession`` or its hosted twin), N workers in a nested Ray Train run. ``resume``: the
    folder of the checkpoint Tune restored or cloned, None for a trial that begins."""
    config = ExperimentConfig.model_validate_json(setup.config_json)
    hparams = {name: params[name] for name in config.hyperparameters}
    plan = plan_run(
        config,
        setup.checked,
        Path(setup.shard_root),
        hparams=hparams,
        report_every=setup.report_every,
        validation_period=setup.validation_period,
        code=setup.code,
        threads=setup.threads,
    )
    name = trial_run_name(config, tune_trial_id)
    if config.resources.max_workers == 1:
        # Ray 2.60 refuses Ray Train's session API inside Tune functions (also in Train V2 local
        # mode): the one worker trains here, with a Tune session.
        # Its checkpoints go to a scratch folder Tune copies from (``TuneSession``), opened here:
        # in the storage (named after the trial's run), where a signer running as another OS user
        # reads it as it reads every run's checkpoints (a private temporary folder it could not).
        scratch = plan.storage.root / "scratch" / f"{name}-{uuid.uuid4().hex[:8]}"
        scratch.mkdir(parents=True)
        spec = plan.named(name, setup.reproducibility)
        channel = open_channel(scratch, spec)
        attempt = Attempt.of(
            spec,
            trust=setup.checked.trust,
            resume_checkpoint=resume or "",
            signer=channel,
        )
        try:
            train_worker(attempt.model_dump(mode="json"), session=session)
        finally:  # (Tune stopping the trial raises SystemExit here)
            close_channel(channel)
    else:
        # Each life of the trial in this Tune actor (a restored trial, a PBT clone) is a Ray Train
        # run of its own, in a fresh directory.
        directory = f"{name}-{uuid.uuid4().hex[:6]}"
        spec = plan.named(name, setup.reproducibility, directory=directory)
        sink = f"govray-reports-{directory}"
        channel = open_channel(Path(spec.run_dir), spec)
        attempt = Attempt.of(
            spec, trust=setup.checked.trust, resume_checkpoint=resume or "", report_sink=sink, signer=channel
        )
        # (Not closed when the run ends: a close in a ``finally`` here left a stopped ASHA trial's
        # placement group behind in the slow tier; its directory is this life's alone.)
        _continuous_trial(config, plan.storage, attempt)


def ends_trial(trial_id: str, result: Mapping[str, Any]) -> bool:
    """Tune's stopper: a trial's last result ends it before any scheduler
    sees it. Synchronous PBT would otherwise pause a finished trial at its last step to wait for
    the others, and could then hand one's final state to another trial with nothing left to train."""
    return bool(result.get(LAST_KEY))


class _Relay:
    """The Tune side of a trial's Ray Train run: the reports its sink queued, relayed to Tune at
    each validation with that validation's verified checkpoint (what PBT clones). A restarted
    worker group re-reports the steps after its checkpoint: the later copy counts."""

    def __init__(self, attempt: Attempt, storage: Storage, sink: Any) -> None:
        self.spec, self.trust, self.storage, self.sink = attempt.spec, attempt.trust, storage, sink
        self.pending: dict[int, StepReport] = {}  # by step, since the last relayed validation
        self.relayed = 0  # the step of the last validation relayed
        self.places: dict[int, WorkerPlace] = {}

    def take(self) -> None:
        """Relay every validation the run reported since the last look, but not its last report
        (that one waits for the run's end: ``finish``)."""
        for report in taken_reports(self.sink):
            if report.step > self.relayed:
                self.pending[report.step] = report
        if self.pending and not self.places:
            self.places = worker_places(self.sink)
        for step in sorted(self.pending):
            report = self.pending[step]
            if report.validated and report.checkpoint is not None and not report.ends_trial:
                self._relay(step, Path(report.checkpoint))

    def finish(self) -> None:
        """After the run: its end is its newest verified checkpoint, by the rule its workers resume
        by (the report that went with it is in the checkpoint: the sink may have lost it when a
        worker died)."""
        self.take()
        final = newest_verified_checkpoint(Path(self.spec.run_dir), self.trust, self.storage)
        report = StepReport.parse(checkpoint_report(final)) if final is not None else None
        if report is None or report.step <= self.relayed:
            raise SearchError(f"the trial's run {self.spec.run_dir} ended without its last checkpoint")
        assert final is not None
        self.pending[report.step] = report
        self._relay(report.step, final)

    def _relay(self, step: int, folder: Path) -> None:
        from ray.train import Checkpoint

        storage = self.storage
        present_checkpoint(folder, self.trust, storage)
        reports = [self.pending[s] for s in sorted(self.pending) if s <= step]
        self.pending = {s: r for s, r in self.pending.items() if s > step}
        self.relayed = step
        result = {**tune_result(reports, self.spec.max_steps), PLACES_KEY: json.dumps(self.places)}
        materialize_base(folder, storage)  # Tune keeps a copy of the folder: it must stand alone
        ray.tune.report(result, checkpoint=Checkpoint(storage.ray_path(folder), storage.filesystem))


def _continuous_trial(config: ExperimentConfig, storage: Storage, attempt: Attempt) -> None:
    """N workers in one Ray Train run for the trial's life in this Tune actor (a restored trial or
    a PBT clone starts another from its checkpoint, in a fresh run directory: ``attempt``'s). The
    run reports to a sink this thread relays to Tune at every validation; its last result reaches
    Tune only once the run has ended. When Tune stops the trial, ``ray.tune.report`` raises
    ``SystemExit`` here: rank 0 is asked to end at the next step boundary (its last sealed
    checkpoint is the one Tune holds) and the run's placement group is removed (the driver's
    ``PlacementGuard`` again)."""
    from govray.platform.run.runner import governed_trainer  # Ray Train's: N-worker trials only

    sink = open_sink(attempt.report_sink)  # rank 0's reports, for Tune
    relay = _Relay(attempt, storage, sink)
    control = Path(attempt.spec.control_file)
    try:
        fit_polled(
            lambda: governed_trainer(config, attempt, storage).fit(),
            relay.take,
            period=RELAY_PERIOD,
            name="govray-trial-run",
            abandon=lambda: _end_run(control, relay.places or worker_places(sink)),
        )
        relay.finish()
    finally:
        ray.kill(sink)


def _end_run(control: Path, places: dict[int, WorkerPlace]) -> None:
    """Tune stopped the trial mid-run: ask rank 0 to stop at the next step boundary, and free the
    workers' placement group (Ray would keep it until the driver exits)."""
    from ray.util.placement_group import PlacementGroup

    pass_request(control, "kill")
    for group in {place["placement_group"] for place in places.values()} - {""}:
        ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group)))
