"""The governed FSDP/DDP step in a persistent gloo group: the rank's tasks and what they answer."""

from __future__ import annotations

import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from govray.config.experiment import ParallelStrategy
from tests.helpers.builders import governed_step

WORLD = 2
STEPS = 10
PUBLIC = "digits-public"  # the only corpus whose route may update the embedding
ADAMW = {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}


@dataclass(frozen=True)
class Task:
    spec: str  # RunSpec JSON
    strategy: str
    excluded: tuple[str, ...] = ()
    training: tuple[tuple[str, Any], ...] = ()  # engine settings (precision, accumulation_steps)
    nan_step: int | None = None  # from this step on, rank 1's losses are NaN
    resume_at: int | None = None  # checkpoint here, train on; then a fresh run resumes from it
    tamper: str | None = None  # the checkpoint file in which a byte is flipped before the resume
    resumed_as: tuple[str, int] | None = None  # the resuming run's strategy and world size, if other
    rollback: bool = False  # keep clean states, checkpoint, train on, roll back (``rolled_back``)


def rank_main(rank: int, init_file: str, tasks: Any, results: Any, world: int = WORLD) -> None:
    import torch.distributed as dist

    from govray.governance.allreduce import NonFiniteGradientError
    from govray.train.parallel.worker import Worker
    from govray.train.runspec import RunSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    while (task := tasks.get()) is not None:
        try:
            spec = RunSpec.model_validate_json(task.spec)
            update = {"strategy": ParallelStrategy(task.strategy), "excluded_corpora": task.excluded}
            spec = spec.model_copy(update=update)
            hparams = {**spec.hparams, **ADAMW}
            assert spec.settings is not None
            settings = spec.settings.model_copy(update=dict(task.training)).with_hyperparameters(hparams)
            spec = spec.model_copy(update={"hparams": hparams, "settings": settings})
            if task.rollback:
                results.put((rank, *rolled_back(spec, rank, task.tamper)))
                continue
            if task.resume_at is not None:
                results.put((rank, *resumed(spec, task, rank)))
                continue
            governed = governed_step(spec, Worker.detect(), settings)

            before = whole(governed.model)
            try:
                for step in range(STEPS):
                    if task.nan_step == step and rank == 1:  # from here on, rank 1's losses are NaN
                        governed.trial.loss = poisoned(governed.trial.loss)  # type: ignore[method-assign]
                    governed.step(step)
                governed.governor.check_finite()
            except NonFiniteGradientError as error:
                results.put((rank, "nonfinite", str(error)))
                continue
            after = whole(governed.model)
            results.put((rank, "ok", (before, after) if rank == 0 else None))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


def resumed(spec: Any, task: Task, rank: int) -> tuple[str, Any]:
    """Train, checkpoint at ``task.resume_at`` (every rank its shards), train to the end; then a
    fresh run resumes from the checkpoint (one file tampered with, maybe) and trains to the end:
    ``("ok", (uninterrupted, resumed))`` on rank 0, or ``("refused", message)``."""
    import torch.distributed as dist

    from govray.train.checkpoints.files import CheckpointError
    from govray.train.parallel.worker import Worker
    from govray.train.run.state import TrialRun
    from tests.helpers.signing import sealing_context

    assert task.resume_at is not None
    folder = Path(spec.run_dir) / f"checkpoint_{task.resume_at:08d}"
    if rank == 0 and folder.parent.exists():  # an earlier task's run: this one starts afresh
        shutil.rmtree(folder.parent)
    dist.barrier()
    first = TrialRun.open(sealing_context(spec, Worker.detect()))
    for step in range(task.resume_at):
        first.governed.step(step)
    first.save(folder, task.resume_at, {"step": task.resume_at})
    saved = whole(first.governed.model), whole_optimizer(first.governed)
    for step in range(task.resume_at, STEPS):
        first.governed.step(step)
    uninterrupted = whole(first.governed.model)
    if task.tamper is not None and rank == 0:
        data = bytearray((folder / task.tamper).read_bytes())
        data[len(data) // 2] ^= 0x01
        (folder / task.tamper).write_bytes(bytes(data))
    dist.barrier()
    if task.resumed_as is None:
        second = TrialRun.open(sealing_context(spec, Worker.detect()))
    else:  # a run that claims another strategy or world size
        strategy, world = task.resumed_as
        claimed = spec.model_copy(update={"strategy": ParallelStrategy(strategy)})
        second = TrialRun.open(sealing_context(claimed, Worker(rank, world)))
    try:
        start = second.restore(folder)
    except CheckpointError as error:
        return "refused", str(error)
    loaded = whole(second.governed.model), whole_optimizer(second.governed)
    for step in range(start, STEPS):
        second.governed.step(step)
    again = whole(second.governed.model)
    ledgers = first.governed.ledger.to_json(), second.governed.ledger.to_json()
    return "ok", (uninterrupted, again, saved, loaded, ledgers) if rank == 0 else None


def rolled_back(spec: Any, rank: int, tamper: str | None = None) -> tuple[str, Any]:
    """Under a rollback policy: a clean state at step 4, checkpointed and kept in no memory;
    at step 6 a rollback to it reads that checkpoint; the checkpoint at step 8 carries it, and
    a run resumed from there rolls back to it again from the carried copy:
    ``("ok", (clean, after the first rollback, after the second, initial, files carried))``.
    With ``tamper``, that file of the clean checkpoint gets a flipped byte before the checkpoint
    at step 8 carries it: ``("refused", message)``."""
    import torch.distributed as dist

    from govray.governance.memorization import MemorizationThresholds
    from govray.train.checkpoints.files import CheckpointError
    from govray.train.control.decisions import RollbackDecision
    from govray.train.parallel.worker import Worker
    from govray.train.run.state import TrialRun
    from tests.helpers.signing import sealing_context

    thresholds = MemorizationThresholds(loss_gap=0.5, action="rollback")
    spec = spec.model_copy(
        update={"policy": spec.policy.model_copy(update={"memorization": thresholds}), "lr_schedule": None}
    )
    run_dir = Path(spec.run_dir)
    if rank == 0 and run_dir.exists():
        shutil.rmtree(run_dir)
    dist.barrier()

    def checkpoint(run: Any, step: int) -> Path:
        folder = run_dir / f"checkpoint_{step:08d}"
        run.save(folder, step, {"step": step})
        return folder

    run = TrialRun.open(sealing_context(spec, Worker.detect()))
    run.keep_clean(0)
    initial = whole(run.governed.model)
    checkpoint(run, 0)
    for step in range(4):
        run.governed.step(step)
    run.keep_clean(4)  # a validation found it clean
    clean = whole(run.governed.model)
    checkpoint(run, 4)
    for step in range(4, 6):
        run.governed.step(step)
    if tamper is not None:
        if rank == 0:
            path = run_dir / "checkpoint_00000004" / tamper
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
        dist.barrier()
        try:
            checkpoint(run, 8)
        except CheckpointError as error:
            return "refused", str(error)
        return "ok", None
    clean_states = list(run.control.clean_states.values())
    assert clean_states and all(s.on_storage and not s.weights and not s.optimizer for s in clean_states)
    run.roll_back(RollbackDecision(seq=0, step=6, to_step=4, corpora=["digits-public"], score=None))
    first = whole(run.governed.model)
    for step in range(6, 8):
        run.governed.step(step)
    folder = checkpoint(run, 8)  # carries the clean state of step 4
    carried = sorted(path.name for path in folder.iterdir() if path.name.startswith("clean-"))
    resumed = TrialRun.open(sealing_context(spec, Worker.detect()))
    resumed.restore(folder)
    resumed.roll_back(RollbackDecision(seq=1, step=8, to_step=4, corpora=["digits-licensed"], score=None))
    second = whole(resumed.governed.model)
    return "ok", (clean, first, second, initial, carried) if rank == 0 else None


def poisoned(loss: Any) -> Any:
    """A trial's ``loss`` whose every value is NaN."""

    def nan_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return loss(model, batch) * float("nan")

    return nan_loss


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor whole (a sharded one gathered: every rank calls this)."""
    from torch.distributed.tensor import DTensor

    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def whole_optimizer(governed: Any) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor whole, by its parameter's name (every rank calls this)."""
    from torch.distributed.tensor import DTensor

    names = {id(p): name for name, p in governed.model.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": (value.full_tensor() if isinstance(value, DTensor) else value)
        .detach()
        .clone()
        for group in governed.optimizer.param_groups
        for p in group["params"]
        for key, value in governed.optimizer.state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    }


def weights(run: Any, task: Task) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    answers = run(task)
    for rank, (status, payload) in answers.items():
        assert status == "ok", f"rank {rank}: {payload}"
    before, after = answers[0][1]
    return before, after


def assert_resumed_exactly(answers: dict[int, Any]) -> None:
    """Every rank resumed (``resumed``'s answers); the weights and optimizer state (exp_avg,
    exp_avg_sq, step) loaded are the saved ones bit for bit, the ledger continues exactly, and
    the weights trained on equal the uninterrupted run's within the layouts' summation order."""
    assert all(status == "ok" for status, _ in answers.values()), answers
    _, (uninterrupted, again, saved, loaded, (ledger, resumed_ledger)) = answers[0]
    for at_save, at_load in zip(saved, loaded, strict=True):
        assert at_save.keys() == at_load.keys() and at_save
        for name in at_save:
            assert torch.equal(at_save[name], at_load[name]), name
    assert any(name.endswith(".exp_avg_sq") for name in saved[1])
    assert resumed_ledger == ledger
    for name in uninterrupted:
        torch.testing.assert_close(again[name], uninterrupted[name], rtol=1e-5, atol=1e-6, msg=name)
