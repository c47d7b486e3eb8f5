"""Every collective of a governed run is on the run's device, or on the gloo host group for host
objects — what NCCL requires (it takes CUDA tensors only, even at world size 1): in one persistent
2-process gloo group, under ``tests.helpers.collective_audit.CollectiveAudit``:

- a whole governed run (``train_worker``: stop-flag broadcasts, the comm hook, report sums, the
  validation and memorization probe, signed checkpoints; DDP and FSDP) hands the run's group only
  tensors on the run's device (the CPU here; a CUDA GPU under ``-m gpu``), and host objects only
  to the host group;
- with a worker whose device is ``meta`` (a device that is not the CPU, so a tensor made without
  the worker's device shows), the pause/kill flag and the host sums still reach no collective of
  the run's group.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from govray.config.experiment import ParallelStrategy
from tests.helpers.collective_audit import CollectiveAudit
from tests.helpers.engine import run_spec
from tests.helpers.gloo_group import persistent_group
from tests.helpers.golden import GoldenRun

WORLD = 2
STEPS = 10


@dataclass(frozen=True)
class Task:
    spec: str  # RunSpec JSON
    kind: str  # "run": a whole governed run; "meta": the host collectives of a meta-device worker
    device: str = "cpu"  # the run's device (cuda: use_gpu)


def rank_main(rank: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    while (task := tasks.get()) is not None:
        try:
            results.put((rank, "ok", audited_run(task) if task.kind == "run" else audited_meta(task, rank)))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


def audited_run(task: Task) -> tuple[list[Any], list[str]]:
    """A whole governed run of this rank (``train_worker`` in-process), audited."""
    from govray.train.parallel.worker import Worker
    from govray.train.run.loop import train_worker
    from govray.train.run.session import LocalSession
    from govray.train.runspec import Attempt, RunSpec
    from tests.helpers.signing import channel_for

    spec = RunSpec.model_validate_json(task.spec)
    device = torch.device(task.device, 0) if task.device == "cuda" else torch.device(task.device)
    channel = channel_for(spec, Worker.detect())  # the launch's (rank 0 opens it for both)
    with CollectiveAudit(device) as audit:
        train_worker(
            Attempt.of(spec, signer=channel).model_dump(mode="json"),
            session=lambda context: LocalSession(context, lambda _: None),
        )
    return audit.calls, audit.violations


def audited_meta(task: Task, rank: int) -> tuple[list[Any], list[str]]:
    """The session's stop flag, the report sums and an agreed action of a worker whose device is
    ``meta``, audited against that device."""
    from govray.core.storage import IN_PLACE
    from govray.train.checkpoints.signer import NoSigner
    from govray.train.context import WorkerContext
    from govray.train.parallel.strategies import Single
    from govray.train.parallel.worker import Worker, agreed, all_reduce_sums
    from govray.train.run.session import LocalSession
    from govray.train.runspec import Attempt, RunSpec

    # What a session reads of its spec (nothing here trains).
    spec = RunSpec.model_construct(
        storage="", strategy=ParallelStrategy.DDP, control_period=5, control_file="", run_dir=""
    )
    worker = Worker(rank, WORLD, torch.device("meta"))
    context = WorkerContext(Attempt.of(spec), worker, IN_PLACE, Single(worker), NoSigner())
    session = LocalSession(context, lambda _: None)
    with CollectiveAudit(worker.device) as audit:
        session.look_for_stop(spec.control_period - 1)
        stop = session.stop_requested()
        sums = all_reduce_sums({"loss": 1.5 + rank}, worker)
        agreed(lambda: None, worker)
    assert stop is None and sums == {"loss": 4.0}
    return audit.calls, audit.violations


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with persistent_group(rank_main, tmp_path_factory.mktemp("collectives"), WORLD, timeout=300) as run:
        yield run


def short_run(golden: GoldenRun, root: Path, strategy: str, device: str = "cpu") -> str:
    """The golden run's spec, cut to ``STEPS`` steps with checkpoints, validations (the probe) and
    stop-flag looks in them, in a fresh run directory, logs and storage off."""
    spec = run_spec(golden)
    update = {
        "max_steps": STEPS,
        "checkpoint_period": 5,
        "validation_period": 5,
        "control_period": 2,
        "report_every": 1,
        "run_dir": str(root / f"{strategy}-{device}"),
        "log_dir": "",
        "storage": str(root),
        "control_file": "",
        "strategy": ParallelStrategy(strategy),
        "use_gpu": device == "cuda",
    }
    return spec.model_copy(update=update).model_dump_json()


def audit_of(answers: dict[int, tuple[str, Any]]) -> list[tuple[list[Any], list[str]]]:
    for rank, (status, payload) in answers.items():
        assert status == "ok", f"rank {rank}: {payload}"
    return [answers[rank][1] for rank in range(WORLD)]


RUNS = [
    ("ddp", "cpu"),
    ("fsdp", "cpu"),
    pytest.param(  # two ranks on one GPU: gloo carries CUDA tensors (NCCL cannot put both there)
        "ddp",
        "cuda",
        marks=pytest.mark.gpu,  # selected only with -m gpu
    ),
]


@pytest.mark.parametrize(("strategy", "device"), RUNS)
def test_every_collective_of_a_governed_run_is_on_its_device_or_the_host_group(
    gloo_pair: Any, golden_run: GoldenRun, tmp_path: Path, strategy: str, device: str
) -> None:
    spec = short_run(golden_run, tmp_path, strategy, device)
    for calls, violations in audit_of(gloo_pair(Task(spec, "run", device))):
        assert violations == []
        run_calls = {call.name for call in calls if call.group == "run"}
        host_calls = {call.name for call in calls if call.group == "host"}
        # Not vacuous: the gradients crossed the run's group, the stop flags and sums the host's.
        assert "all_reduce" in run_calls
        assert {"broadcast", "all_gather_object"} <= host_calls
        stop_flags = [c for c in calls if c.name == "broadcast" and c.group == "host"]
        assert len(stop_flags) == STEPS // 2, "a stop-flag broadcast every control_period steps"
        if strategy == "fsdp":  # the sharded resume rule and checkpoint: lists and barriers
            assert {"broadcast_object_list", "barrier"} <= host_calls


def test_a_worker_off_the_cpu_hands_its_run_group_no_host_tensor_or_object(gloo_pair: Any) -> None:
    """On a CPU-only machine the CPU is the run's device, so a tensor made without the worker's
    device would pass unseen: here the worker's device is ``meta``, and the audit refuses any host
    tensor or object the run's group would get (NCCL would refuse the tensor at step 5)."""
    for calls, violations in audit_of(gloo_pair(Task("", "meta"))):
        assert violations == []
        assert [call.name for call in calls] == ["broadcast", "all_gather_object", "all_gather_object"]
        assert {call.group for call in calls} == {"host"}


def test_the_audit_refuses_what_nccl_would() -> None:
    """The instrument itself (no process group needed to judge the arguments): a CPU tensor on
    the run's group of a ``meta`` run, an object collective there, a device tensor on the host."""
    audit = CollectiveAudit("meta")
    audit._check("broadcast", {"tensor": torch.zeros(1), "src": 0, "group": None})
    audit._check("all_reduce", {"tensor": torch.zeros(1, device="meta"), "group": None})
    audit._check("all_gather_object", {"object_list": [None, None], "obj": 1, "group": None})
    assert len(audit.violations) == 2
    assert audit.violations[0].startswith("broadcast on the run's group with a cpu torch.float32 tensor")
    assert audit.violations[1].startswith("all_gather_object on the run's group")
