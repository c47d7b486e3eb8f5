"""What runs inside a Tune trial of a search: one governed trial, planned there for its sample.

One worker trains in the Tune trial's own process (``TuneSession``); N workers train in nested
``TorchTrainer`` segments between validations, each ending with a signed checkpoint that becomes
the Tune checkpoint (so PBT can hand any trial's state to another). Every report reaches Tune with
its validation.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.tune

from govray.config.experiment import ExperimentConfig
from govray.core.errors import GovrayError
from govray.core.storage import Storage
from govray.data.schedule import SCHEDULE_VERSION
from govray.platform.plan import plan_run
from govray.platform.preflight import CheckedPolicy
from govray.platform.runner import governed_trainer
from govray.train.base_file import materialize_base
from govray.train.checkpoint import checkpoint_step
from govray.train.loop import train_worker
from govray.train.reports import StepReport
from govray.train.run_checkpoints import (
    checkpoint_report,
    checkpoint_run,
    checkpoint_schedule_version,
    newest_verified_checkpoint,
)
from govray.train.runspec import RunSpec
from govray.train.session import LAST_KEY, TuneSession, open_sink, taken_reports, tune_result

TUNE_TRIAL_MEMORY = 64 * 1024**2  # what the Tune trial of an N-worker trial reserves (bytes)


class SearchError(GovrayError):
    """The search cannot start or finished without a usable trial."""

    exit_code = 15


@dataclass(frozen=True)
class SearchSetup:
    """What every Tune trial needs besides its hyperparameters (plain data: it crosses processes)."""

    config_json: str
    checked: CheckedPolicy  # with the trust read at preflight: every trial checks against it
    shard_root: str
    reproducibility: dict[str, Any]
    report_every: int
    validation_period: int | None
    database_url: str


def trial_run_name(config: ExperimentConfig, tune_trial_id: str) -> str:
    return f"{config.name}-{tune_trial_id}"


def tune_trial(params: dict[str, Any], setup: SearchSetup) -> None:
    """The Tune function trainable: one governed trial, reporting at every validation with its
    signed checkpoint (Tune hands a restored or PBT-cloned trial that checkpoint back)."""
    config = ExperimentConfig.model_validate_json(setup.config_json)
    hparams = {name: params[name] for name in config.hyperparameters}
    run_name = trial_run_name(config, ray.tune.get_context().get_trial_id())
    restored = ray.tune.get_checkpoint()
    with restored.as_directory() if restored is not None else tempfile.TemporaryDirectory() as scratch:
        # A restored trial or a PBT clone continues its checkpoint's schedule (a search begun
        # before schedule version 2 keeps version 1).
        version = checkpoint_schedule_version(Path(scratch)) if restored is not None else SCHEDULE_VERSION
        plan = plan_run(
            config,
            setup.checked,
            Path(setup.shard_root),
            hparams=hparams,
            report_every=setup.report_every,
            validation_period=setup.validation_period,
            schedule_version=version,
        )
        spec = plan.named(run_name, setup.reproducibility).model_copy(
            update={"resume_checkpoint": scratch if restored is not None else ""}
        )
        if config.resources.workers == 1:
            _local_trial(spec)
        else:
            _segmented_trial(config, plan.storage, spec)


def ends_trial(trial_id: str, result: Mapping[str, Any]) -> bool:
    """Tune's stopper: a trial's last result ends it before any scheduler
    sees it. Synchronous PBT would otherwise pause a finished trial at its last step to wait for
    the others, and could then hand one's final state to another trial with nothing left to train."""
    return bool(result.get(LAST_KEY))


def _local_trial(spec: RunSpec) -> None:
    """One worker, in this Tune trial's process (Ray 2.60 refuses Ray Train's session API inside
    Tune functions, also in Train V2 local mode): a ``TuneSession``."""
    train_worker(spec.model_dump(mode="json"), session=TuneSession)


def _segment_reports(reported: list[StepReport], last: StepReport) -> list[StepReport]:
    """The segment's reports in step order, ending with its result (a restarted worker group
    re-reports the steps after its checkpoint: the later copy counts)."""
    by_step = {report.step: report for report in reported if report.step <= last.step}
    by_step[last.step] = last
    return [by_step[step] for step in sorted(by_step)]


def _segmented_trial(config: ExperimentConfig, storage: Storage, spec: RunSpec) -> None:
    """N workers in nested TorchTrainers, one per segment between validations. Each segment ends
    with a signed checkpoint that becomes the Tune checkpoint, so Tune (PBT) can hand any trial's
    state to another; the next segment resumes from it under a fresh Ray Train run name. Every
    report of the segment reaches Tune with its validation."""
    from ray.train import Checkpoint

    resume = spec.resume_checkpoint
    start = checkpoint_step(Path(resume)) if resume else 0
    period = spec.validation_period or spec.max_steps
    # A PBT clone of a finished donor has nothing left to train: one segment ends it with the
    # donor's state checkpointed under this trial's name.
    cloned = bool(resume) and checkpoint_run(Path(resume)) != spec.run_name
    while start < spec.max_steps or cloned:
        cloned = False
        end = min(spec.max_steps, (start // period + 1) * period)
        segment = spec.model_copy(update={"max_steps": end, "resume_checkpoint": resume})
        name = f"{Path(spec.run_dir).name}-{end:06d}-{uuid.uuid4().hex[:6]}"
        run_dir = storage.root / "ray" / name
        sink = open_sink(f"govray-reports-{name}")  # rank 0's reports, for Tune
        try:
            segment = segment.model_copy(
                update={"run_dir": str(run_dir), "report_sink": f"govray-reports-{name}"}
            )
            governed_trainer(config, segment, name, storage).fit()
            reported = taken_reports(sink)
        finally:
            ray.kill(sink)
        # The segment's end is its newest verified checkpoint, by the rule its workers resume by
        # (Ray Train's result lacks it when a worker died before Ray collected the last report);
        # the report that went with it is in the checkpoint.
        final = newest_verified_checkpoint(run_dir, spec.trust, storage if storage.is_remote else None)
        last = checkpoint_report(final) if final is not None else {}
        if final is None or not last:
            raise SearchError(f"segment {start}..{end} of {spec.run_dir} ended without a checkpoint")
        relayed = tune_result(_segment_reports(reported, StepReport.parse(last)), spec.max_steps)
        materialize_base(final, storage)  # Tune keeps a copy of the folder: it must stand alone
        ray.tune.report(relayed, checkpoint=Checkpoint(storage.ray_path(final), storage.filesystem))
        if StepReport.parse(last).stop == "early_stop":
            return  # the trial's last report (with its ledger): the rest of its steps never run
        # The next segment resumes from it: a directory in the nodes' cache of object storage.
        resume, start = str(final), end
