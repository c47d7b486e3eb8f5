"""Benchmark: the host memory one rank needs to build its shard of a model under FSDP, measured.

Four gloo ranks on the CPU (spawned processes) build a Llama-shaped model of about 650 MB (fp32:
hidden 768, 12 blocks, MLP 3072, vocab 32000, untied head) the way ``GovernedStep`` does under
``resources.strategy: fsdp``: rank 0 writes the seed checkpoint, every rank builds the model on
meta, wraps it (``GovernedModel``), shards it (``shard_model``) and fills its shards from the
seed (``SeedCheckpoint.fill``). And, for comparison, the path of old: every rank builds the whole
model on its CPU, then FSDP shards it.

What is measured: each rank's resident set size (``/proc/self/statm``: anonymous memory, torch's
CPU allocations included, plus the pages of the seed file it has mapped and touched), sampled
every millisecond by a thread; the figure is the peak minus the resident size just before the
build (imports, process group and trial made), divided by the bytes of that rank's shards of the
base model (the sum of its local tensors' sizes after sharding). Rank 0 also writes the seed (it
holds the whole model once): its figure is printed apart; the line that counts is the largest
among the other ranks.

Run it with ``python -m jobs.benchmarks.init_memory`` (about a minute on 2 cores); its last line
is the ratio (target <= 2). ``jobs.benchmarks.memory_plan`` prints that line last.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WORLD = 4
MIB = 2**20
SHAPE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


class PeakResidentSize:
    """The largest resident set size of this process while it is entered (sampled)."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s, self.peak, self._done = interval_s, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def resident(self) -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.resident())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakResidentSize:
        self.peak = self.resident()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.resident())


def _warm_up(trial: Any) -> None:
    """Imports and torch's first-use state (the modeling code, FSDP2, DTensor, safetensors) made
    before the baseline: the figure is the build's memory, not the libraries'."""
    import safetensors.torch  # noqa: F401
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    trial.build_meta_model()
    with torch.device("meta"):
        tiny = torch.nn.Linear(WORLD, WORLD)
    fully_shard(tiny, mesh=init_device_mesh("cpu", (WORLD,)))
    tiny.to_empty(device="cpu")


def _build(run_dir: str, meta: bool) -> tuple[int, int]:
    """One rank's build of its shards: (peak resident bytes over the build, its shard bytes)."""
    import torch

    from govray.config.training import Precision
    from govray.core.storage import IN_PLACE
    from govray.governance.adapters import GovernedModel
    from govray.governance.policy import DepthPolicy
    from govray.governance.routing import resolve_routes
    from govray.train.checkpoints.seed import SeedCheckpoint, initial_model
    from govray.train.hf import CausalLMTrial
    from govray.train.parallel.fsdp import layer_units, local, shard_model
    from govray.train.parallel.worker import Worker
    from govray.train.runspec import RunSpec

    trial = CausalLMTrial({"model": SHAPE})
    spec = RunSpec.model_construct(seed=1, trial_seed=0, run_dir=run_dir, storage="")
    rules = DepthPolicy.model_validate(
        {"name": "all", "version": 1, "rules": [{"name": "all", "match": {}, "route": "all"}]}
    )
    _warm_up(trial)
    before = PeakResidentSize()
    baseline = before.resident()
    with before:
        seed = SeedCheckpoint.agree(spec, Worker.detect(), IN_PLACE, trial) if meta else None
        base = seed.skeleton() if seed is not None else initial_model(spec, trial)
        model = GovernedModel(base, resolve_routes(rules, base, trial.layers(base)), {}, seed=0)
        shard_model(model, layer_units(base, trial.fsdp_units(base)), Precision.FP32, torch.device("cpu"))
        if seed is not None:
            seed.fill(model, torch.device("cpu"))
    share = sum(local(tensor).nbytes for tensor in model.base_state().values())
    return before.peak - baseline, share


def _rank(rank: int, init_file: str, run_dir: str, meta: bool, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results.put((rank, *_build(run_dir, meta)))
    finally:
        dist.destroy_process_group()


def measure(meta: bool) -> dict[int, tuple[int, int]]:
    """Each rank's (peak resident bytes of its build, its shard bytes)."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as directory:
        results = context.Queue()
        init_file, run_dir = str(Path(directory) / "init"), str(Path(directory) / "run")
        ranks = [
            context.Process(target=_rank, args=(rank, init_file, run_dir, meta, results))
            for rank in range(WORLD)
        ]
        for process in ranks:
            process.start()
        measured = {}
        for _ in ranks:
            rank, peak, share = results.get(timeout=600)
            measured[rank] = (peak, share)
        for process in ranks:
            process.join(timeout=60)
    return measured


def init_ratio(show: bool = True) -> float:
    """The largest ratio, over the ranks that do not write the seed, of the host memory a rank's
    build needed to its share of the model."""
    ratio = 0.0
    for meta, label in ((False, "whole model on every rank (before)"), (True, "meta + seed checkpoint")):
        measured = measure(meta)
        for rank, (peak, share) in sorted(measured.items()):
            if show:
                print(
                    f"{label}, rank {rank}: peak +{peak / 2**20:.0f} MiB, its shard {share / 2**20:.0f} MiB"
                )
        if meta:
            ratio = max(peak / share for rank, (peak, share) in measured.items() if rank != 0)
    return ratio


def main() -> None:
    print(f"init host memory per rank / its shard of the model: {init_ratio():.2f}")


if __name__ == "__main__":
    main()
