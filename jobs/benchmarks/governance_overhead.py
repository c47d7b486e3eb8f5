"""How much governance costs: governed vs plain DDP, and 1-worker govray vs a plain PyTorch loop.

1. Two Ray Train workers (gloo, CPU) each hold TWO DDP-wrapped copies of the same ≥5M-parameter
   model: one with govray's comm hook and GradientGovernor (a policy whose routes restrict
   different layers, workers on different routes), one plain DDP. Steps alternate between them in
   the same processes, on the same data; the result is the median of per-pair time ratios.
2. One worker: govray's governed step (GovernedModel, per-step seeding, masks, finish_step) vs a
   plain PyTorch loop, same thread count, interleaved; the ratio of throughputs.

Run: ``python -m jobs.benchmarks.governance_overhead [--steps 40]``. The last two lines are::

    governed/plain step ratio: X.XXX
    govray-1worker/torch throughput ratio: X.XXX
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

WIDTH_IN, WIDTH, CLASSES, BATCH = 1024, 2048, 10, 64
POLICY: dict[str, Any] = {
    "name": "bench",
    "version": 1,
    "rules": [
        {"name": "open", "match": {"license_class": "public-domain"}, "route": "all"},
        {"name": "upper", "match": {"license_class": "licensed"}, "route": {"depth": {"min": -2}}},
    ],
}


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH_IN, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH // 2),
        nn.ReLU(),
        nn.Linear(WIDTH // 2, WIDTH // 2),
        nn.ReLU(),
        nn.Linear(WIDTH // 2, CLASSES),
    )


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, WIDTH_IN, generator=generator), torch.randint(
        0, CLASSES, (BATCH,), generator=generator
    )


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, reduction="none")


def governed_parts(model: nn.Module) -> tuple[Any, Any]:
    """A GovernedModel over ``model`` and its governor, under the benchmark policy."""
    from govray.governance.adapters import GovernedModel
    from govray.governance.allreduce import GradientGovernor, parameters_by_name
    from govray.governance.policy import DepthPolicy
    from govray.governance.routing import resolve_routes
    from govray.train.step.governed import allowed_route_sets

    policy = DepthPolicy.model_validate(POLICY)
    table = resolve_routes(policy, model)
    governed = GovernedModel(model, table, policy.adapters, seed=0)
    governor = GradientGovernor(parameters_by_name(governed), allowed_route_sets(governed, table))
    return governed, governor


def ddp_pairs(config: dict[str, Any]) -> None:
    """Ray Train worker: alternate governed and plain DDP steps; rank 0 writes the ratios."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from govray.governance.allreduce import governed_allreduce_hook
    from govray.train.parallel.strategies import rank_local_buffers

    torch.set_num_threads(int(config["threads"]))
    rank = dist.get_rank()
    governed, governor = governed_parts(build_model(0))
    governed_ddp = DistributedDataParallel(governed, **rank_local_buffers())
    governed_ddp.register_comm_hook(governor, governed_allreduce_hook)
    plain_ddp = DistributedDataParallel(build_model(0), **rank_local_buffers())
    governed_opt = torch.optim.AdamW(governed.parameters(), lr=1e-4)
    plain_opt = torch.optim.AdamW(plain_ddp.parameters(), lr=1e-4)
    x, y = batch(rank)
    route = "open" if rank == 0 else "upper"  # each worker's slot is one route
    counts = {"open": BATCH, "upper": BATCH}

    def governed_step(step: int) -> None:
        governor.begin_step(step, route, counts)
        per_example_loss(governed_ddp, x, y).sum().backward()
        governor.finish_step()
        governed_opt.step()
        governed_opt.zero_grad(set_to_none=True)

    def plain_step(step: int) -> None:
        per_example_loss(plain_ddp, x, y).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    pairs = timed_pairs(governed_step, plain_step, int(config["steps"]), int(config["warmup"]))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, pairs)
    if rank == 0:
        # A data-parallel step takes as long as its slowest worker.
        ratios = [max(a[0], b[0]) / max(a[1], b[1]) for a, b in zip(gathered[0], gathered[1], strict=True)]
        Path(config["out"]).write_text(json.dumps({"ratios": ratios}))


def ddp_ratio(steps: int, warmup: int) -> tuple[float, list[float]]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from govray.core.runtime import ensure_ray

    ensure_ray()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "ratios.json"
        TorchTrainer(
            ddp_pairs,
            train_loop_config={"steps": steps, "warmup": warmup, "threads": 1, "out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(name=f"bench-{time.time_ns()}", storage_path=str(Path(scratch) / "ray")),
        ).fit()
        ratios = json.loads(out.read_text())["ratios"]
    return statistics.median(ratios), ratios


def single_worker_ratio(steps: int, warmup: int, threads: int) -> tuple[float, float, float]:
    """(govray throughput / torch throughput, govray steps/s, torch steps/s), interleaved."""
    from govray.data.schedule import derive_seed

    torch.set_num_threads(threads)
    governed, governor = governed_parts(build_model(0))
    plain = build_model(0)
    governed_opt = torch.optim.AdamW(governed.parameters(), lr=1e-4)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    x, y = batch(0)
    govray_time = torch_time = 0.0
    for step in range(warmup + steps):
        started = time.perf_counter()
        torch.manual_seed(derive_seed(0, 0, step, 0))  # govray's per-step randomness
        governor.begin_step(step, "open", {"open": BATCH})  # every tensor trained: the same work
        with governed.active(None):
            per_example_loss(governed, x, y).sum().backward()
        governor.govern_local()
        governor.finish_step()
        governed_opt.step()
        governed_opt.zero_grad(set_to_none=True)
        middle = time.perf_counter()
        per_example_loss(plain, x, y).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        ended = time.perf_counter()
        if step >= warmup:
            govray_time += middle - started
            torch_time += ended - middle
    return torch_time / govray_time, steps / govray_time, steps / torch_time


def timed_pairs(
    governed: Callable[[int], None], plain: Callable[[int], None], steps: int, warmup: int
) -> list[list[float]]:
    """(governed seconds, plain seconds) of each measured step on this rank, interleaved."""
    import torch.distributed as dist

    pairs = []
    for step in range(warmup + steps):
        # Alternate which goes first so neither always inherits a warm cache.
        order = [(governed, 0), (plain, 1)] if step % 2 == 0 else [(plain, 1), (governed, 0)]
        measured = [0.0, 0.0]
        for run, slot in order:
            dist.barrier()
            started = time.perf_counter()
            run(step)
            measured[slot] = time.perf_counter() - started
        if step >= warmup:
            pairs.append(measured)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    parameters = sum(p.numel() for p in build_model(0).parameters())
    print(f"model: {parameters / 1e6:.2f}M parameters, batch {BATCH} per worker, {args.steps} measured steps")
    ddp, ratios = ddp_ratio(args.steps, args.warmup)
    print(f"2 workers, interleaved pairs: min {min(ratios):.3f}, median {ddp:.3f}, max {max(ratios):.3f}")
    single, govray_rate, torch_rate = single_worker_ratio(args.steps, args.warmup, args.threads)
    rates = f"govray {govray_rate:.2f} steps/s, torch {torch_rate:.2f} steps/s"
    print(f"1 worker, {args.threads} thread(s): {rates}")
    print(f"governed/plain step ratio: {ddp:.3f}")
    print(f"govray-1worker/torch throughput ratio: {single:.3f}")


if __name__ == "__main__":
    main()
