"""A spot node's reclaim notice: every rank asks for it at the control period (off Ray Train, none
asks), a noticed run seals a checkpoint at that step boundary, records a ``preempted`` decision
and trains no further step, and the restart resumes from that checkpoint with an exact ledger. A
replay applies no preemption. (On a local Ray cluster with a real drain:
``tests/cluster/test_preemption.py``.)"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import TypeAdapter

from govray.config.experiment import PlateauSchedule
from govray.core.settings import operator_trust
from govray.core.storage import IN_PLACE
from govray.data.schedule import ScheduleSpec
from govray.data.shard_reader import ShardReader
from govray.data.shards import ShardSet
from govray.platform.rerun.replay import recorded_decisions
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import CheckpointState, find_checkpoints, load_checkpoint
from govray.train.checkpoints.signer import NoSigner
from govray.train.context import WorkerContext
from govray.train.control.controller import Controller
from govray.train.control.decisions import LrDecision, PreemptedDecision, RecordedDecision
from govray.train.control.preemption import (
    RESTART_SLACK_S,
    UNKNOWN_DEADLINE_S,
    PreemptionNotice,
    PreemptionWatch,
    wait_for_restart,
)
from govray.train.parallel.strategies import Single
from govray.train.parallel.worker import RouteRows, Worker
from govray.train.run.loop import train_worker
from govray.train.run.reports import StepReport
from govray.train.run.session import LocalSession
from govray.train.runspec import Attempt, RunSpec
from govray.train.step.governed import GovernedStep
from govray.train.step.ledger import Ledger, recompute_ledger
from govray.train.trial import make_trial
from tests.helpers.engine import run_spec
from tests.helpers.golden import GoldenRun
from tests.helpers.signing import channel_for

REPO = Path(__file__).resolve().parents[1]
DEADLINE_MS = 1_800_000_000_000


@dataclass(frozen=True)
class PreemptionInfo:
    """What ``ray.train.get_preemption_info()`` returns (``ray.train.v2.api.preemption``)."""

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]]


def test_every_rank_asks_for_a_notice_only_at_the_control_period_and_acts_on_each_once() -> None:
    answers = [None, PreemptionInfo(DEADLINE_MS, {"n1": [1]}), PreemptionInfo(DEADLINE_MS, {"n1": [1]})]
    asked: list[int] = []  # the steps before which Ray was asked
    now = 0

    def ask() -> PreemptionInfo | None:
        asked.append(now)
        return answers[len(asked) - 1]

    watch = PreemptionWatch(period=5, ask=ask)
    seen = {}
    for now in range(15):
        if (notice := watch.look(now)) is not None:
            seen[now] = notice
    # Ray's call is a barrier: the same steps on every rank, one call each.
    assert asked == [4, 9, 14]
    assert seen == {9: PreemptionNotice(deadline_ms=DEADLINE_MS, nodes={"n1": [1]})}
    # A notice for another node too is a new one.
    watch.ask = lambda: PreemptionInfo(None, {"n1": [1], "n2": [0]})
    assert watch.look(19) == PreemptionNotice(deadline_ms=None, nodes={"n1": [1], "n2": [0]})


def test_off_ray_train_no_rank_asks_for_a_notice() -> None:
    spec = RunSpec.model_construct(storage="", strategy="ddp", control_period=1, control_file="", run_dir="")
    worker = Worker(0, 1, torch.device("cpu"))
    context = WorkerContext(Attempt.of(spec), worker, IN_PLACE, Single(worker), NoSigner())
    session = LocalSession(context, lambda _: None)
    assert session.preemption.ask is None  # Ray's local mode answers None; a Tune trial's call raises
    assert [session.look_for_preemption(step) for step in range(10)] == [None] * 10


def test_waiting_for_the_restart_gives_up_past_the_deadline_and_the_slack() -> None:
    clock = [1000.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    notice = PreemptionNotice(deadline_ms=1_030_000, nodes={"n1": [1]})  # 30 s after "now"
    waited = wait_for_restart(notice, seen_at=1000.0, now=lambda: clock[0], sleep=sleep)
    assert waited == pytest.approx(30 + RESTART_SLACK_S)
    clock[0] = 1000.0
    unknown = PreemptionNotice(deadline_ms=None, nodes={"n1": [1]})  # Ray's controller waits 120 s
    waited = wait_for_restart(unknown, seen_at=1000.0, now=lambda: clock[0], sleep=sleep)
    assert waited == pytest.approx(UNKNOWN_DEADLINE_S + RESTART_SLACK_S)


def lr(seq: int, step: int, scale: float) -> LrDecision:
    return LrDecision(
        seq=seq, step=step, metric="validation_loss", observed=None, previous_scale=1.0, scale=scale
    )


def test_a_replay_applies_no_preemption_and_numbers_its_own_after_the_record() -> None:
    record = [
        lr(0, 5, 0.5),
        PreemptedDecision(seq=1, step=7, deadline_ms=DEADLINE_MS, nodes={"n1": [1]}),
        lr(2, 10, 0.25).model_copy(update={"previous_scale": 0.5}),
    ]
    control: Controller[Any] = Controller(PlateauSchedule(patience=0), None, None, recorded=record)
    assert [d.seq for d in control.after_validation(5, {"validation_loss": 1.0})] == [0]
    assert [d.seq for d in control.after_validation(10, {"validation_loss": 1.0})] == [2]
    control.check_applied(10)
    assert [(d.seq, d.kind) for d in control.decisions] == [(0, "lr_scale"), (2, "lr_scale")]
    assert control.lr_scale == 0.25
    own = control.preempted(12, None, {"n2": [0, 1]})
    assert own.seq == 3  # never a number of the record's
    assert [(d.seq, d.kind) for d in control.decisions] == [
        (0, "lr_scale"),
        (2, "lr_scale"),
        (3, "preempted"),
    ]


def test_a_preempted_decision_is_kept_in_checkpoints_and_the_next_decision_follows_it() -> None:
    control: Controller[Any] = Controller(PlateauSchedule(patience=0), None, None, recorded=None)
    first = control.preempted(3, DEADLINE_MS, {"n1": [1]})
    assert first == PreemptedDecision(seq=0, step=3, deadline_ms=DEADLINE_MS, nodes={"n1": [1]})
    state = CheckpointState.model_validate(
        {
            "step": 3,
            "epoch": 0,
            "seed": 1,
            "trial_seed": 1,
            "schedule": {},
            "schedule_digest": "",
            "policy_digest": "",
            "config_digest": "",
            "ledger": {},
            "world_history": [[0, 1]],
            "hparams_history": [{"from_step": 0, "run": "run", "hparams": {}}],
            **control.state(),
        }
    )
    resumed: Controller[Any] = Controller(PlateauSchedule(patience=0), None, None, recorded=None)
    resumed.restore(state)
    assert resumed.decisions == [first]
    assert resumed.after_validation(10, {"validation_loss": 1.0}) == []  # the first: no cut
    assert resumed.after_validation(20, {"validation_loss": 2.0})[0].seq == 1  # after the preemption


def test_the_preempted_decision_is_stored_and_read_back_for_a_replay(tmp_path: Path) -> None:
    store = TrackingStore.open(f"sqlite:///{tmp_path / 'govray.db'}")
    experiment = store.create_experiment("spot", "{}", "digest", str(tmp_path))
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=1)
    assert trial.id is not None
    decision = PreemptedDecision(seq=0, step=3, deadline_ms=DEADLINE_MS, nodes={"n1": [1]})
    report = StepReport(step=3, epoch=0, metrics={}, decisions=(decision,))
    assert StepReport.model_validate_json(report.model_dump_json()) == report
    store.record_decisions(trial.id, [decision.model_dump(mode="json")], replayed=False)
    store.record_decisions(trial.id, [decision.model_dump(mode="json")], replayed=False)  # a re-report
    (row,) = store.decisions(trial.id)
    assert (row.seq, row.step, row.kind) == (0, 3, "preempted")
    assert json.loads(row.payload_json) == {"deadline_ms": DEADLINE_MS, "nodes": {"n1": [1]}}
    assert recorded_decisions(store, trial.id) == (decision,)
    assert TypeAdapter(RecordedDecision).validate_python(decision.model_dump()) == decision


class Reclaimed(Exception):
    """Ray Train tearing the worker group down at the notice's deadline."""


class NoticedSession(LocalSession):
    """One worker in-process that gets a reclaim notice at its first look (every 3 steps)."""

    def __init__(self, context: WorkerContext, deliver: Any) -> None:
        super().__init__(context, deliver)
        self.preemption.ask = lambda: PreemptionInfo(DEADLINE_MS, {"node-a": [0]})

    def await_restart(self, notice: PreemptionNotice) -> float:
        raise Reclaimed(notice)


def test_a_noticed_run_seals_its_boundary_trains_no_more_and_resumes_there_with_an_exact_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, golden_local_epoch: GoldenRun
) -> None:
    stored = run_spec(golden_local_epoch)  # one worker in-process: its spec and shards
    shards = Path(stored.shard_root)
    spec = stored.model_copy(
        update={
            "run_dir": str(tmp_path / "run"),
            "code_dir": str(REPO),
            "max_steps": 6,
            "control_period": 3,
        }
    )
    trained: list[int] = []
    step = GovernedStep.step
    monkeypatch.setattr(GovernedStep, "step", lambda self, s: (trained.append(s), step(self, s))[1])
    reports: list[StepReport] = []
    with pytest.raises(Reclaimed):
        train_worker(
            Attempt.of(spec, signer=channel_for(spec)).model_dump(mode="json"),
            session=partial(NoticedSession, deliver=reports.append),
        )
    assert trained == [0, 1, 2]  # the notice read before step 2: sealed after it, nothing more
    preempted = PreemptedDecision(seq=0, step=3, deadline_ms=DEADLINE_MS, nodes={"node-a": [0]})
    (sealed,) = reports
    assert (sealed.step, sealed.decisions, sealed.stop) == (3, (preempted,), None)
    (folder,) = find_checkpoints(Path(spec.run_dir))
    assert sealed.checkpoint == str(folder)
    assert load_checkpoint(folder, operator_trust()).state.preemptions == [preempted.model_dump(mode="json")]

    # The restart (no notice now) resumes from the sealed checkpoint: no step is trained twice.
    trained.clear()
    train_worker(
        Attempt.of(spec, signer=channel_for(spec)).model_dump(mode="json"),
        session=partial(LocalSession, deliver=reports.append),
    )
    assert trained == [3, 4, 5]
    final = load_checkpoint(find_checkpoints(Path(spec.run_dir))[-1], operator_trust()).state
    assert final.step == 6 and final.preemptions == [preempted.model_dump(mode="json")]
    assert reports[-1].decisions[0] == preempted
    trial = make_trial(spec.trial, spec.hparams, spec.settings)
    tokens = RouteRows(ShardReader(ShardSet.open(shards))).tokens(trial)
    schedule = ScheduleSpec.from_json(final.schedule)
    assert Ledger.from_json(final.ledger) == recompute_ledger(schedule, spec.routing, 6, tokens)
