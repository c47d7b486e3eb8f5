"""Governed FSDP2 keeps no more than its shards, in one persistent 2-process gloo group:

- under gradient accumulation each micro-batch's backward ends in its reduce-scatter (FSDP2 adds
  the sums into the sharded gradients): no unsharded gradient survives between micro-batches,
  every trainable shard is reduced exactly k times a step, the zero-fill hooks have zeroed every
  tensor a rank's route may not update before each reduce-scatter, the update equals DDP's
  (within fp32 rounding) and a tensor no slot may update stays bit-identical;
- under LoRA, blocks whose tensors are all frozen are FSDP units too: every base tensor is a
  shard, the adapters whole, and a step and a shard checkpoint run with frozen shards.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from govray.config.experiment import ParallelStrategy
from tests.helpers.builders import governed_step
from tests.helpers.engine import run_spec
from tests.helpers.fsdp import ADAMW, PUBLIC, whole
from tests.helpers.gloo_group import persistent_group
from tests.helpers.golden import GoldenRun

WORLD = 2
STEPS = 4
MICRO_BATCHES = 4


@dataclass(frozen=True)
class Accumulated:
    spec: str  # RunSpec JSON
    strategy: str
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrozenBlocks:
    directory: str  # where each rank writes its shard files


@dataclass(frozen=True)
class Ready:
    """Answered once the rank has joined the group and imported what the tasks use."""


@dataclass
class Probes:
    """What FSDP held and reduced during the steps, seen from one rank."""

    held: list[int] = field(default_factory=list)  # unsharded gradient elements at each micro-batch's start
    reduced: dict[str, int] = field(default_factory=dict)  # tensor → reduce-scatters into its shard
    forbidden: int = 0  # gradients of tensors this rank may not update, seen entering a reduce-scatter
    nonzero: list[str] = field(default_factory=list)  # ... of which not all zeros


def rank_main(rank: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    while (task := tasks.get()) is not None:
        try:
            if isinstance(task, Ready):
                import govray.train.parallel.fsdp
                import govray.train.step.governed  # noqa: F401

                results.put((rank, "ok", None))
            elif isinstance(task, Accumulated):
                results.put((rank, "ok", accumulated(task, rank)))
            else:
                results.put((rank, "ok", frozen_blocks(task, rank)))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


def fsdp_records(model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's record of each sharded tensor (its sharded and unsharded parameter)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


def attach_probes(governed: Any) -> Probes:
    """Count, without changing what runs: the unsharded gradients alive when a micro-batch
    starts (its loss is called), the reduce-scatters into each shard (FSDP2 runs a shard's
    post-accumulate-grad hooks after adding a reduce-scatter's sum), and whether a gradient the
    rank may not update is zeros when it enters the reduce-scatter (a hook run after the
    governor's zero-fill)."""
    probes = Probes()
    governor, records = governed.governor, list(fsdp_records(governed.model))
    loss = governed.trial.loss

    def probed_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        alive = 0
        for record in records:
            unsharded = getattr(record, "_unsharded_param", None)
            for grad in (getattr(unsharded, "grad", None), record.unsharded_accumulated_grad):
                alive += grad.numel() if grad is not None else 0
        probes.held.append(alive)
        return loss(model, batch)

    governed.trial.loss = probed_loss
    for record in records:
        index = governor._index.get(id(record.sharded_param))
        if index is None:
            continue
        name = governor.names[index]
        probes.reduced[name] = 0

        def reduced(_shard: torch.Tensor, name: str = name) -> None:
            probes.reduced[name] += 1

        def entering(parameter: torch.Tensor, index: int = index, name: str = name) -> None:
            if parameter.grad is not None and not governor.contributes(index):
                probes.forbidden += 1
                if bool(parameter.grad.any()):
                    probes.nonzero.append(name)

        record.sharded_param.register_post_accumulate_grad_hook(reduced)
        record._unsharded_param.register_post_accumulate_grad_hook(entering)
    return probes


def accumulated(task: Accumulated, rank: int) -> dict[str, Any]:
    """``STEPS`` governed steps of ``MICRO_BATCHES`` micro-batches each; the weights before and
    after (rank 0) and, under FSDP, the probes."""
    from govray.train.parallel.worker import Worker
    from govray.train.runspec import RunSpec

    spec = RunSpec.model_validate_json(task.spec)
    hparams = {**spec.hparams, **ADAMW}
    assert spec.settings is not None
    settings = spec.settings.model_copy(update={"accumulation_steps": MICRO_BATCHES})
    spec = spec.model_copy(
        update={
            "strategy": ParallelStrategy(task.strategy),
            "excluded_corpora": task.excluded,
            "hparams": hparams,
            "settings": settings.with_hyperparameters(hparams),
        }
    )
    governed = governed_step(spec, Worker.detect())
    probes = attach_probes(governed) if task.strategy == "fsdp" else None
    before = whole(governed.model)
    for step in range(STEPS):
        governed.step(step)
    governed.governor.check_finite()
    after = whole(governed.model)
    return {"weights": (before, after) if rank == 0 else None, "probes": probes}


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with persistent_group(rank_main, tmp_path_factory.mktemp("fsdp-memory"), WORLD, timeout=240) as run:
        answers(run, Ready())  # the ranks' start and imports: the shared fixture's time, not a test's
        yield run


def answers(run: Any, task: Any) -> dict[int, Any]:
    replies = run(task)
    for rank, (status, payload) in replies.items():
        assert status == "ok", f"rank {rank}: {payload}"
    return {rank: payload for rank, (_, payload) in replies.items()}


def test_fsdp_reduce_scatters_every_micro_batch_and_keeps_no_unsharded_gradient(
    gloo_pair: Any, golden_run: GoldenRun
) -> None:
    """4 steps of 4 micro-batches (3 routes, the PII adapter, per-group clipping, AdamW with
    decay): every trainable shard reduce-scattered 16 times, no unsharded gradient alive at any
    micro-batch's start, every forbidden gradient zeros when it entered a reduce-scatter, and the
    weights equal DDP's (which accumulates locally under no_sync) within fp32 rounding."""
    spec = run_spec(golden_run).model_dump_json()
    ddp_before, ddp = answers(gloo_pair, Accumulated(spec, "ddp"))[0]["weights"]
    fsdp = answers(gloo_pair, Accumulated(spec, "fsdp"))
    for rank, payload in fsdp.items():
        probes: Probes = payload["probes"]
        assert probes.held == [0] * (STEPS * MICRO_BATCHES), f"rank {rank}: {probes.held}"
        assert probes.reduced and set(probes.reduced.values()) == {STEPS * MICRO_BATCHES}, probes.reduced
        assert probes.forbidden > 0 and probes.nonzero == [], f"rank {rank}: {probes.nonzero}"
    fsdp_before, fsdp_after = fsdp[0]["weights"]
    assert ddp.keys() == fsdp_after.keys()
    for name in ddp:
        assert torch.equal(ddp_before[name], fsdp_before[name]), f"{name}: the same initial weights"
        if ".lora_" not in name:  # (the PII adapter's slots may not come up in 4 steps)
            assert not torch.equal(ddp_before[name], ddp[name]), f"{name}: trained"
        torch.testing.assert_close(fsdp_after[name], ddp[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_tensor_no_slot_may_update_stays_bit_identical_under_fsdp_accumulation(
    gloo_pair: Any, golden_run: GoldenRun
) -> None:
    """Without the public corpus no slot may update the embedding: after 4 steps of 4
    micro-batches, each reduce-scattered, it is the initial embedding bit for bit."""
    spec = run_spec(golden_run).model_dump_json()
    before, after = answers(gloo_pair, Accumulated(spec, "fsdp", excluded=(PUBLIC,)))[0]["weights"]
    embedding = [name for name in before if name.startswith("base.embed.")]
    assert embedding
    for name in before:
        if name in embedding:
            assert torch.equal(before[name], after[name]), name
        elif ".lora_" not in name:
            assert not torch.equal(before[name], after[name]), f"{name} trained"


# Two LoRA routes at different depths: a rank on "high" has nothing to train below the head, so
# its backward reaches the lower blocks only because every unit's input requires a gradient.
LORA_ONLY = {
    "name": "digits-lora",
    "version": 1,
    "adapters": {
        "low-lora": {"targets": ["embed"], "rank": 2, "alpha": 4},
        "high-lora": {"targets": ["head"], "rank": 2, "alpha": 4},
    },
    "rules": [
        {"name": "low", "match": {"license_class": "licensed"}, "route": {"adapter": "low-lora"}},
        {"name": "high", "route": {"adapter": "high-lora"}},
    ],
}


def frozen_blocks(task: FrozenBlocks, rank: int) -> dict[str, Any]:
    """The digits model handed over frozen (as PEFT's ``get_peft_model`` hands one over), two
    LoRA routes, sharded as ``GovernedStep`` does; one governed step, rank 0 on "high" and rank 1
    on "low"; its shard files written and read back."""
    from torch.distributed.fsdp import FSDPModule

    from govray.config.training import Precision
    from govray.governance.adapters import GovernedModel
    from govray.governance.allreduce import parameters_by_name
    from govray.governance.policy import DepthPolicy
    from govray.governance.routing import resolve_routes
    from govray.train.checkpoints.files import shard_file
    from govray.train.parallel.fsdp import (
        ShardedGovernor,
        is_sharded,
        layer_units,
        load_shards,
        optimizer_groups,
        shard_model,
        write_shards,
    )
    from govray.train.step.governed import allowed_route_sets
    from govray.train.step.trainable import freeze_unroutable, trainable_in_fp32
    from jobs.examples.digits.trial import DigitsMLP

    policy = DepthPolicy.model_validate(LORA_ONLY)
    torch.manual_seed(0)
    base = DigitsMLP(hidden=32, dropout=0.0)
    base.requires_grad_(False)
    names = ["embed", "hidden", "head"]
    table = resolve_routes(policy, base, names)
    model = GovernedModel(base, table, policy.adapters, seed=0)
    units = layer_units(base, names)
    freeze_unroutable(model, table)
    trainable_in_fp32(model)
    shard_model(model, units, Precision.FP32, torch.device("cpu"))
    named = parameters_by_name(model)
    governor = ShardedGovernor(model, named, allowed_route_sets(model, table), torch.device("cpu"))
    optimizer = torch.optim.AdamW(optimizer_groups([p for _, p in named]), lr=0.01)

    route = ("high", "low")[rank]
    governor.begin_step(0, route, {"high": 4, "low": 4})
    base_before = {name: p.to_local().clone() for name, p in model.base_named_parameters()}
    adapter = table.adapter_names[route]
    adapter_before = {name: t.clone() for name, t in model.adapter_tensors(adapter).items()}
    pixels = torch.rand(4, 64, generator=torch.Generator().manual_seed(rank)) * 16
    with model.active(adapter):
        model(pixels).square().mean().backward()
    governor.govern_sharded()
    governor.finish_step(1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    folder = Path(task.directory)
    write_shards(folder, model, optimizer, rank, WORLD)
    written = {name: p.to_local().clone() for name, p in model.base_named_parameters()}
    with torch.no_grad():
        for _, parameter in model.base_named_parameters():
            parameter.to_local().zero_()
    load_shards(model, folder / shard_file("model", rank, WORLD))
    return {
        "units": {name: isinstance(base.get_submodule(name), FSDPModule) for name in names},
        "frozen": sorted(name for name, p in model.base_named_parameters() if not p.requires_grad),
        "base_sharded": {name: is_sharded(p) for name, p in model.base_named_parameters()},
        "adapters_whole": {
            f"{a}.{i}": not is_sharded(p)
            for a in model.adapter_names()
            for i, p in enumerate(model.adapter_parameters(a))
        },
        "base_unchanged": all(torch.equal(base_before[n], written[n]) for n in written),
        "adapter_trained": any(
            not torch.equal(adapter_before[n], t) for n, t in model.adapter_tensors(adapter).items()
        ),
        "read_back": all(torch.equal(written[n], p.to_local()) for n, p in model.base_named_parameters()),
    }


def test_every_block_of_a_lora_run_is_sharded_its_adapters_whole(gloo_pair: Any, tmp_path: Path) -> None:
    """A LoRA run whose base arrives frozen: every block is an FSDP unit (no frozen block left
    whole in the root unit), every base tensor a shard, every adapter whole; a governed step with
    the ranks' adapters at different depths completes (no rank waits for an all-gather another
    skips), trains each rank's adapter and leaves the frozen shards as they were; the shard files
    hold them and read back bit for bit."""
    replies = answers(gloo_pair, FrozenBlocks(str(tmp_path)))
    for rank, reply in replies.items():
        assert reply["units"] == {"embed": True, "hidden": True, "head": True}, f"rank {rank}"
        assert reply["frozen"] == sorted(reply["base_sharded"]), "the whole base is frozen"
        assert all(reply["base_sharded"].values()), reply["base_sharded"]
        assert len(reply["adapters_whole"]) == 4 and all(reply["adapters_whole"].values())
        assert reply["base_unchanged"] and reply["adapter_trained"] and reply["read_back"], reply
