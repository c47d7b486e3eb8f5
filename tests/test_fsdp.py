"""Governed FSDP2 keeps the governed allreduce's promises, in one persistent 2-process gloo group
running the golden run's governed step: the sharded update equals DDP's (within fp32 rounding:
the reduce-scatter sums in another order), a tensor no slot may update stays bit-identical under
AdamW with weight decay (fp32, and bf16 mixed precision with gradient accumulation), and a
non-finite gradient stops every rank at the boundary naming the tensor and the route."""

from __future__ import annotations

import re
import shutil
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from govray.config.experiment import ExperimentConfig, ParallelStrategy
from govray.core.keys import KeyRole, SigningKey, platform_trust
from govray.governance.adapter_files import save_base_tensors
from govray.train.checkpoints.files import MODEL_FILE, shard_file, shard_owner
from govray.train.checkpoints.whole_file import write_whole_model
from jobs.examples.digits.golden import EXAMPLE_CONFIG
from tests.helpers.gloo_group import persistent_group
from tests.helpers.golden import GoldenRun
from tests.helpers.sharded_reference import consolidated
from tests.test_engine import run_spec

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
    from govray.train.step.governed import GovernedStep
    from govray.train.trial import make_trial

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
            governed = GovernedStep(spec, Worker.detect(), make_trial(spec.trial, hparams, settings))

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

    from govray.core.keys import SigningKey
    from govray.train.checkpoints.files import CheckpointError
    from govray.train.parallel.worker import Worker
    from govray.train.run.state import TrialRun

    assert task.resume_at is not None
    key = SigningKey.load(Path(spec.platform_key)) if rank == 0 else None
    folder = Path(spec.run_dir) / f"checkpoint_{task.resume_at:08d}"
    if rank == 0 and folder.exists():  # an earlier task's (a session makes the folder fresh so)
        shutil.rmtree(folder)
    dist.barrier()
    first = TrialRun.open(spec, Worker.detect())
    for step in range(task.resume_at):
        first.governed.step(step)
    first.save(folder, task.resume_at, key, {"step": task.resume_at})
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
        second = TrialRun.open(spec, Worker.detect())
    else:  # a run that claims another strategy or world size
        strategy, world = task.resumed_as
        second = TrialRun.open(
            spec.model_copy(update={"strategy": ParallelStrategy(strategy)}), Worker(rank, world)
        )
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

    from govray.core.keys import SigningKey
    from govray.governance.memorization import MemorizationThresholds
    from govray.train.checkpoints.files import CheckpointError
    from govray.train.control.decisions import RollbackDecision
    from govray.train.parallel.worker import Worker
    from govray.train.run.state import TrialRun

    thresholds = MemorizationThresholds(loss_gap=0.5, action="rollback")
    spec = spec.model_copy(
        update={"policy": spec.policy.model_copy(update={"memorization": thresholds}), "lr_schedule": None}
    )
    key = SigningKey.load(Path(spec.platform_key)) if rank == 0 else None
    run_dir = Path(spec.run_dir)
    if rank == 0 and run_dir.exists():
        shutil.rmtree(run_dir)
    dist.barrier()

    def checkpoint(run: Any, step: int) -> Path:
        folder = run_dir / f"checkpoint_{step:08d}"
        run.save(folder, step, key, {"step": step})
        return folder

    run = TrialRun.open(spec, Worker.detect())
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
    snapshots = list(run.control.snapshots.values())
    assert snapshots and all(s.on_storage and not s.weights and not s.optimizer for s in snapshots)
    run.roll_back(RollbackDecision(seq=0, step=6, to_step=4, corpora=["digits-public"], score=None))
    first = whole(run.governed.model)
    for step in range(6, 8):
        run.governed.step(step)
    folder = checkpoint(run, 8)  # carries the clean state of step 4
    carried = sorted(path.name for path in folder.iterdir() if path.name.startswith("clean-"))
    resumed = TrialRun.open(spec, Worker.detect())
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


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with persistent_group(rank_main, tmp_path_factory.mktemp("fsdp"), WORLD, timeout=240) as run:
        yield run


def weights(run: Any, task: Task) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    answers = run(task)
    for rank, (status, payload) in answers.items():
        assert status == "ok", f"rank {rank}: {payload}"
    before, after = answers[0][1]
    return before, after


def test_the_sharded_update_equals_the_ddp_update(gloo_pair: Any, golden_run: GoldenRun) -> None:
    """10 steps of the golden trial (3 routes, the PII adapter, per-group clipping at 0.25,
    AdamW with weight decay): FSDP's weights equal DDP's within fp32 rounding, element by element."""
    spec = run_spec(golden_run).model_dump_json()
    ddp_before, ddp = weights(gloo_pair, Task(spec, "ddp"))
    fsdp_before, fsdp = weights(gloo_pair, Task(spec, "fsdp"))
    assert ddp.keys() == fsdp.keys()
    assert any(".lora_" in name for name in ddp), "the adapter is in play"
    for name in ddp:
        assert torch.equal(ddp_before[name], fsdp_before[name]), f"{name}: the same initial weights"
        assert not torch.equal(ddp_before[name], ddp[name]), (
            f"{name}: trained (the comparison is not vacuous)"
        )
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "training",
    [(), (("precision", "bf16"), ("accumulation_steps", 2))],
    ids=["fp32", "bf16-accumulation"],
)
def test_a_tensor_no_slot_may_update_is_bit_identical_under_adamw_with_decay(
    gloo_pair: Any, golden_run: GoldenRun, training: tuple[tuple[str, Any], ...]
) -> None:
    """Without the public corpus no slot may update the embedding: after 10 sharded AdamW steps
    with weight decay it is the initial embedding bit for bit, while what the licensed and PII
    routes may update trained."""
    spec = run_spec(golden_run).model_dump_json()
    before, after = weights(gloo_pair, Task(spec, "fsdp", excluded=(PUBLIC,), training=training))
    embedding = [name for name in before if name.startswith("base.embed.")]
    assert embedding
    for name in before:
        if name in embedding:
            assert torch.equal(before[name], after[name]), name
        else:
            assert not torch.equal(before[name], after[name]), f"{name} trained"


@pytest.fixture(scope="module")
def signing_spec(golden_run: GoldenRun, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The golden run's spec, signing its checkpoints with a key of this test module's own."""
    root = tmp_path_factory.mktemp("fsdp-checkpoints")
    key = SigningKey.generate(KeyRole.PLATFORM)
    private, _ = key.save(root / "platform")
    return run_spec(golden_run).model_copy(
        update={"platform_key": str(private), "trust": platform_trust(key), "run_dir": str(root / "run")}
    )


def test_a_resume_from_the_sharded_checkpoint_is_bit_identical(
    gloo_pair: Any, signing_spec: Any, tmp_path: Path
) -> None:
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", resume_at=4))
    assert answers[1][0] == "ok", answers[1]
    status, (uninterrupted, again, *_) = answers[0]
    assert status == "ok"
    folder = Path(signing_spec.run_dir) / "checkpoint_00000004"
    assert {shard_owner(path.name) for path in folder.iterdir()} == {None, 0, 1}, "each rank wrote its shards"
    assert not (folder / MODEL_FILE).exists()
    # The whole model streamed from these shards is the file the shards put together in memory give.
    in_memory = save_base_tensors(consolidated(folder, WORLD), tmp_path / MODEL_FILE)
    assert write_whole_model(folder, signing_spec.trust, tmp_path / "streamed.safetensors") == in_memory
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], again[name]), name


@pytest.mark.parametrize(
    "name",
    [shard_file(kind, rank, WORLD) for kind in ("model", "optimizer") for rank in range(WORLD)]
    + [
        "adapter-pii-lora.safetensors",
        "optimizer.json",
        "state.json",
        shard_file("model", 1, WORLD) + ".blocks.json",
    ],
)
def test_a_flipped_byte_in_any_file_of_a_sharded_checkpoint_is_refused_on_every_rank_naming_it(
    gloo_pair: Any, signing_spec: Any, name: str
) -> None:
    """The rank that reads the file refuses it; the other rank refuses too (with that rank's
    message) instead of resuming alone."""
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", resume_at=2, tamper=name))
    for rank, (status, message) in answers.items():
        assert status == "refused", (rank, status)
        assert f"{name}: sha256 does not match the signed manifest (tampered)" in message, message


@pytest.mark.parametrize(
    ("strategy", "resumed_as"), [("ddp", "fsdp"), ("fsdp", "ddp")], ids=["ddp-to-fsdp", "fsdp-to-ddp"]
)
def test_a_checkpoint_of_the_other_strategy_resumes_with_its_exact_state(
    gloo_pair: Any, signing_spec: Any, strategy: str, resumed_as: str
) -> None:
    """DDP -> FSDP and FSDP -> DDP on the same world size (the schedule unchanged): each rank
    reads its rows by verified ranges; the resumed weights and optimizer state (exp_avg,
    exp_avg_sq, step) are the checkpointed ones bit for bit, the ledger continues exactly, and
    the weights trained on equal the uninterrupted run's within the DDP/FSDP rounding (the
    allreduce and the reduce-scatter sum in another order)."""
    task = Task(signing_spec.model_dump_json(), strategy, resume_at=4, resumed_as=(resumed_as, WORLD))
    assert_resumed_exactly(gloo_pair(task))


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


@pytest.mark.parametrize(
    ("strategy", "resumed_as", "name"),
    [
        ("ddp", "fsdp", MODEL_FILE),
        ("ddp", "fsdp", "optimizer.safetensors"),
        ("fsdp", "ddp", shard_file("model", 1, WORLD)),
        ("fsdp", "ddp", shard_file("optimizer", 0, WORLD)),
    ],
)
def test_a_flipped_byte_in_a_range_a_rank_reads_is_refused_on_every_rank_naming_the_file(
    gloo_pair: Any, signing_spec: Any, strategy: str, resumed_as: str, name: str
) -> None:
    """Read by ranges (another strategy): the block holding the byte fails its signed digest on
    the rank that reads it, and every rank refuses with that rank's message."""
    task = Task(
        signing_spec.model_dump_json(), strategy, resume_at=2, tamper=name, resumed_as=(resumed_as, WORLD)
    )
    for rank, (status, message) in gloo_pair(task).items():
        assert status == "refused", (rank, status, message)
        assert re.search(
            rf"{name}: block \d+ does not match its signed block digest \(tampered\)", message
        ), message


def test_an_fsdp_rollback_restores_the_clean_state_from_storage(gloo_pair: Any, signing_spec: Any) -> None:
    """No clean state is kept in memory: a rollback reads the signed checkpoint of the clean step
    (its own shards, or the copies a later checkpoint carries), bit for bit."""
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", rollback=True))
    assert answers[1][0] == "ok", answers[1]
    status, (clean, first, second, initial, carried) = answers[0]
    assert status == "ok"
    assert {shard_owner(name) for name in carried} == {None, 0, 1}, carried  # each rank carried its own
    assert all(name.startswith("clean-00000004-") for name in carried), carried
    assert any(not torch.equal(clean[name], initial[name]) for name in clean), "training moved it"
    for name in clean:
        assert torch.equal(first[name], clean[name]), name
        assert torch.equal(second[name], clean[name]), name


@pytest.mark.parametrize("name", [shard_file("model", 1, WORLD), "optimizer.json"])
def test_a_tampered_clean_state_is_never_carried_into_a_new_checkpoint(
    gloo_pair: Any, signing_spec: Any, name: str
) -> None:
    """The checkpoint that carries a clean state checks each file against its signed manifest
    first: a byte flipped since is refused (on every rank), never signed again."""
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", rollback=True, tamper=name))
    for rank, (status, message) in answers.items():
        assert status == "refused", (rank, status)
        assert f"checkpoint_00000004/{name}: sha256 does not match its signed manifest" in message, message


def test_a_non_finite_gradient_stops_every_rank_naming_tensor_and_route(
    gloo_pair: Any, golden_run: GoldenRun
) -> None:
    """NaN losses on rank 1 from step 3: both ranks refuse at the boundary with the same message,
    naming the step, tensors and routes (each rank flags its own shards; the boundary all-reduces
    the flags)."""
    answers = gloo_pair(Task(run_spec(golden_run).model_dump_json(), "fsdp", nan_step=3))
    assert {status for status, _ in answers.values()} == {"nonfinite"}, answers
    messages = {message for _, message in answers.values()}
    assert len(messages) == 1, messages
    (message,) = messages
    match = re.match(
        r"step (\d+): non-finite gradient in (.+) from a slot allowed to update it \(routes (.+)\)", message
    )
    assert match is not None, message
    assert int(match.group(1)) >= 3


def test_fsdp_is_validated() -> None:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    with pytest.raises(
        ValueError, match="strategy fsdp shards the model across workers: it needs workers >= 2"
    ):
        ExperimentConfig.model_validate({**raw, "resources": {"strategy": "fsdp"}})
    with pytest.raises(ValueError, match="precision fp16 with strategy fsdp: use bf16"):
        ExperimentConfig.model_validate(
            {**raw, "resources": {"strategy": "fsdp", "workers": 2}, "training": {"precision": "fp16"}}
        )
    config = ExperimentConfig.model_validate({**raw, "resources": {"strategy": "fsdp", "workers": 2}})
    assert config.model_dump(mode="json")["resources"]["strategy"] == "fsdp"
    default = ExperimentConfig.model_validate({**raw, "resources": {"workers": 2}})
    assert "strategy" not in default.model_dump(mode="json")["resources"], "ddp leaves digests as they were"
