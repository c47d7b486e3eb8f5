"""What governed FSDP2 costs, and what it saves: governed vs plain FSDP steps, FSDP vs DDP memory.

Two spawned processes (CPU, gloo, one thread each) train a ≥20M-parameter decoder-only
transformer (the text example's ``CharTransformer``: embedding, 8 pre-LayerNorm blocks of causal
self-attention and MLP, head; built locally, nothing downloaded), sharded per layer unit.

1. Each process holds TWO ``fully_shard``-ed copies of the same model (same init): one governed
   (``GovernedModel``, ``shard_model`` with sum reduction, ``ShardedGovernor``: masks before each
   reduce-scatter, per-count division of the shards, per-route-group clipping), one plain FSDP2
   (defaults: averaging reduction; ``clip_grad_norm_``). Both use AdamW and see the same batch.
   The policy's routes restrict different layers and the two ranks are on different routes
   (rank 0 ``open``: every layer; rank 1 ``upper``: the last two), so the masking is real.
   Steps alternate between the copies in the same processes; a pair's time is each copy's
   slowest rank; the result is the median of per-pair time ratios.
2. Peak memory per rank, FSDP vs DDP (govray's governed DDP: comm hook and ``GradientGovernor``),
   same model and AdamW, after an optimizer step: the bytes of the parameters, gradients and
   optimizer state tensors the rank holds (of a sharded tensor, its local shard): what FSDP
   shards. Not counted: FSDP's transient all-gathered unit (one layer's parameters and gradients
   at a time) and DDP's gradient buckets (another gradient-sized buffer).

Run: ``python -m jobs.benchmarks.fsdp [--steps 20]``. The last two lines are::

    governed/plain fsdp step ratio: X.XXX
    fsdp/ddp peak memory per rank: X.XXX
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jobs.benchmarks.governance_overhead import POLICY, timed_pairs  # POLICY: open (all), upper (last two)
from jobs.examples.text.trial import VOCAB, CharTransformer

WORLD, D_MODEL, N_LAYERS, N_HEADS, CONTEXT, BATCH = 2, 512, 8, 8, 64, 4
LAYERS = ("embed", *(f"blocks.{index}" for index in range(N_LAYERS)), "head")
MAX_GRAD_NORM = 1.0
ROUTES = ("open", "upper")  # rank r's slot is on ROUTES[r]
HeldBytes = tuple[int, int, int]  # parameters, gradients, optimizer state


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return CharTransformer(D_MODEL, N_LAYERS, N_HEADS, dropout=0.0, context=CONTEXT)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(seed))


def per_example_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of each row."""
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(dim=1)


def governed_model(base: nn.Module) -> tuple[Any, Any]:
    """``base`` under the benchmark policy: the GovernedModel and its routing table."""
    from govray.governance.adapters import GovernedModel
    from govray.governance.policy import DepthPolicy
    from govray.governance.routing import resolve_routes

    policy = DepthPolicy.model_validate(POLICY)
    table = resolve_routes(policy, base, LAYERS)
    return GovernedModel(base, table, policy.adapters, seed=0), table


def governed_fsdp() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    """A governed FSDP2 copy, as ``GovernedStep`` builds one for ``strategy: fsdp``."""
    from govray.config.training import Precision
    from govray.governance.allreduce import parameters_by_name
    from govray.train.parallel.fsdp import ShardedGovernor, layer_units, optimizer_groups, shard_model
    from govray.train.step.governed import allowed_route_sets

    base = build_model(0)
    model, table = governed_model(base)
    cpu = torch.device("cpu")
    shard_model(model, layer_units(base, LAYERS), Precision.FP32, cpu)
    named = parameters_by_name(model)
    governor = ShardedGovernor(model, named, allowed_route_sets(model, table), cpu)
    return model, governor, torch.optim.AdamW(optimizer_groups([p for _, p in named]), lr=1e-4)


def governed_ddp() -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    """A governed DDP copy, as ``GovernedStep`` builds one for ``strategy: ddp``."""
    from torch.nn.parallel import DistributedDataParallel

    from govray.governance.allreduce import GradientGovernor, governed_allreduce_hook, parameters_by_name
    from govray.train.parallel.strategies import rank_local_buffers
    from govray.train.step.governed import allowed_route_sets

    model, table = governed_model(build_model(0))
    governor = GradientGovernor(parameters_by_name(model), allowed_route_sets(model, table))
    ddp = DistributedDataParallel(model, **rank_local_buffers())
    ddp.register_comm_hook(governor, governed_allreduce_hook)
    return ddp, governor, torch.optim.AdamW(model.parameters(), lr=1e-4)


def plain_fsdp() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The same model and units under FSDP2's defaults."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from govray.train.parallel.fsdp import layer_units

    model = build_model(0)
    mesh = init_device_mesh("cpu", (WORLD,))
    for unit in layer_units(model, LAYERS):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def governed_step(
    forward: nn.Module,
    governor: Any,
    optimizer: torch.optim.Optimizer,
    step: int,
    route: str,
    tokens: torch.Tensor,
) -> None:
    """forward → backward (masked reduction) → per-count division → clip per group → AdamW.
    Gradients are dropped at the start, so they are still held after the step (measured)."""
    from govray.train.parallel.fsdp import ShardedGovernor

    optimizer.zero_grad(set_to_none=True)
    governor.begin_step(step, route, dict.fromkeys(ROUTES, BATCH))
    per_example_loss(forward, tokens).sum().backward()
    if isinstance(governor, ShardedGovernor):
        governor.govern_sharded()  # DDP's comm hook did this during backward
    governor.finish_step(MAX_GRAD_NORM)
    optimizer.step()


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    per_example_loss(model, tokens).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()


def held_bytes(parameters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> HeldBytes:
    """Bytes of the parameters, gradients and optimizer state this rank holds (local shards)."""
    from govray.train.parallel.fsdp import local

    def size(tensor: torch.Tensor) -> int:
        part = local(tensor)
        return part.numel() * part.element_size()

    return (
        sum(size(p) for p in parameters),
        sum(size(p.grad) for p in parameters if p.grad is not None),
        sum(
            size(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
    )


def fsdp_pairs(
    route: str, tokens: torch.Tensor, steps: int, warmup: int
) -> tuple[list[list[float]], HeldBytes]:
    """This rank's interleaved (governed, plain) FSDP step times, and the governed copy's held bytes."""
    sharded, governor, sharded_opt = governed_fsdp()
    plain, plain_opt = plain_fsdp()
    pairs = timed_pairs(
        lambda step: governed_step(sharded, governor, sharded_opt, step, route, tokens),
        lambda step: plain_step(plain, plain_opt, tokens),
        steps,
        warmup,
    )
    governor.check_finite()  # a boundary: every rank agrees the governed run stayed finite
    return pairs, held_bytes(list(sharded.parameters()), sharded_opt)


def ddp_held(route: str, tokens: torch.Tensor) -> HeldBytes:
    """The held bytes of a governed DDP copy after two steps (AdamW's state exists after one)."""
    ddp, governor, optimizer = governed_ddp()
    for step in range(2):
        governed_step(ddp, governor, optimizer, step, route, tokens)
    return held_bytes(list(ddp.parameters()), optimizer)


def rank_main(rank: int, init_file: str, steps: int, warmup: int, out: str) -> None:
    """One spawned rank: the interleaved FSDP pairs, then DDP's held bytes; rank 0 writes every
    rank's measurements to ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        route, tokens = ROUTES[rank], batch(rank)
        pairs, fsdp = fsdp_pairs(route, tokens, steps, warmup)  # the FSDP copies freed on return
        measured = {"pairs": pairs, "held": [fsdp, ddp_held(route, tokens)]}
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, measured)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def measure(steps: int, warmup: int) -> list[dict[str, Any]]:
    """Every rank's interleaved pairs and held bytes ([fsdp, ddp])."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "measured.json"
        mp.spawn(rank_main, args=(str(Path(scratch) / "init"), steps, warmup, str(out)), nprocs=WORLD)
        measured: list[dict[str, Any]] = json.loads(out.read_text())
    return measured


def slowest_ranks(pairs: Sequence[Sequence[Sequence[float]]]) -> list[tuple[float, float]]:
    """Per measured step, (governed, plain) seconds of the slowest rank: a data-parallel step
    takes as long as its slowest rank."""
    return [
        (max(governed for governed, _ in step), max(plain for _, plain in step))
        for step in zip(*pairs, strict=True)
    ]


def mib(held: Sequence[int]) -> str:
    parameters, gradients, state = (value / 2**20 for value in held)
    return f"{parameters:.1f} + {gradients:.1f} + {state:.1f} = {sum(held) / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    parameters = sum(p.numel() for p in build_model(0).parameters())
    print(
        f"model: {parameters / 1e6:.2f}M parameters, batch {BATCH}x{CONTEXT} tokens per rank, "
        f"{WORLD} ranks, {args.steps} measured step pairs"
    )
    measured = measure(args.steps, args.warmup)
    slowest = slowest_ranks([m["pairs"] for m in measured])
    ratios = [governed / plain for governed, plain in slowest]
    step_ratio = statistics.median(ratios)
    governed_s = statistics.median(pair[0] for pair in slowest)
    plain_s = statistics.median(pair[1] for pair in slowest)
    print(f"interleaved pairs: min {min(ratios):.3f}, median {step_ratio:.3f}, max {max(ratios):.3f}")
    print(f"median step: governed fsdp {governed_s:.3f} s, plain fsdp {plain_s:.3f} s")
    for rank, each in enumerate(measured):
        fsdp, ddp = each["held"]
        print(f"rank {rank} MiB (parameters + gradients + AdamW state): fsdp {mib(fsdp)}, ddp {mib(ddp)}")
    memory_ratio = max(sum(m["held"][0]) for m in measured) / max(sum(m["held"][1]) for m in measured)
    print(f"governed/plain fsdp step ratio: {step_ratio:.3f}")
    print(f"fsdp/ddp peak memory per rank: {memory_ratio:.3f}")


if __name__ == "__main__":
    main()
