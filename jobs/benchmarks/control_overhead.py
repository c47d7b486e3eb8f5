"""What looking for a pause/kill request costs a training step on 2 gloo CPU workers.

    python -m jobs.benchmarks.control_overhead

Each step is ~7 ms of compute and a 200k-float gradient allreduce (a small model's step). Three
variants run interleaved in the same two processes: no look, a blocking int64 broadcast from
rank 0 (what every rank needs to stop at the same step), and the same broadcast started before the
compute and waited for after it (govray's way). Prints the median ratios against no look;
govray looks every ``control_period`` (5) steps, so its cost is the async ratio's excess / 5.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROUNDS, STEPS = 40, 20


def step(mode: str, matrix: torch.Tensor, gradient: torch.Tensor) -> None:
    flag = torch.zeros(1, dtype=torch.int64)
    pending = dist.broadcast(flag, src=0, async_op=True) if mode == "async" else None
    for _ in range(10):
        matrix @ matrix
    dist.all_reduce(gradient)
    if mode == "blocking":
        dist.broadcast(flag, src=0)
    if pending is not None:
        pending.wait()


def worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    matrix, gradient = torch.randn(256, 256), torch.randn(200_000)
    times: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}
    for _ in range(ROUNDS):
        for mode, seconds in times.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                step(mode, matrix, gradient)
            seconds.append((time.perf_counter() - start) / STEPS)
    if rank == 0:
        base = statistics.median(times["none"])
        print(f"step without a look: {base * 1e3:.2f} ms")
        print(f"blocking look every step / none: {statistics.median(times['blocking']) / base:.3f}")
        print(f"overlapped look every step / none: {statistics.median(times['async']) / base:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(29000 + os.getpid() % 1000,), nprocs=2)
