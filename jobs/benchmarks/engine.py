"""The engine's cost: govray's governed step against a plain PyTorch loop on a Hugging Face causal
LM, and the governance bookkeeping of one step of a simulated large world.

1. **Throughput.** The ``hf_lm`` example's model (a small Llama from its config, random init) and
   its text corpora, ingested into a temporary directory: govray's real ``GovernedStep`` (schedule
   slot, per-step seeding, masks and divisors, per-route-group clipping, ledger, prefetched
   batches) against a plain loop (collate, ``model(ids)``, mean loss, ``backward``, clip,
   ``AdamW``) over the same rows and a copy of the same model (its PEFT adapter layers
   included), one step of each in turn in one process, the order flipping every pair (both fp32
   on the CPU; bf16 on a GPU when there is one). The ratio of throughputs (median of per-pair
   ratios).
2. **Bookkeeping.** What one step costs the governance in a world of 1024 ranks, 1000 tensors and
   50 corpora (no model, no data): the step's rows summed by route (``step_rows``), this rank's
   slot, the governor's divisors and masked fraction, and the ledger's per-(corpus, route)
   counts; the ledger's expansion to (corpus, tensor) rows happens when one is written (once per
   checkpoint) and is timed on its own, amortized over ``--checkpoint-period`` steps.

Run: ``python -m jobs.benchmarks.engine [--steps 30]``. The last two lines are::

    govray-1worker/torch throughput ratio (hf lm, PRECISION, DEVICE): X.XXX
    governance bookkeeping per step (1024 ranks x 1000 tensors x 50 corpora): X.XXX ms
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

RANKS, TENSORS, CORPORA, BATCH = 1024, 1000, 50, 8


def bookkeeping(steps: int, checkpoint_period: int) -> float:
    """Milliseconds of governance bookkeeping per step (median), ledger expansion amortized."""
    from govray.data.schedule import RouteLayout, ScheduleSpec
    from govray.data.slots import slot
    from govray.data.step_rows import step_rows
    from govray.governance.allreduce import GradientGovernor, parameters_by_name
    from govray.governance.policy import DepthPolicy
    from govray.governance.routing import resolve_routes
    from govray.train.step.ledger import Ledger, TokensPerRow

    with torch.device("meta"):  # 1000 tensors of a 500-layer stack; never allocated
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(TENSORS // 2)))
    policy = DepthPolicy.model_validate(
        {
            "name": "bench",
            "version": 1,
            "rules": [
                {"name": "public", "match": {"license_class": "public-domain"}, "route": "all"},
                {
                    "name": "licensed",
                    "match": {"license_class": "licensed"},
                    "route": {"depth": {"min": -100}},
                },
                {"name": "pii", "match": {"sensitivity": "pii"}, "route": {"depth": {"max": 10}}},
            ],
        }
    )
    table = resolve_routes(policy, model)
    named = parameters_by_name(model)
    governor = GradientGovernor(named, [frozenset(table.routes_updating(name)) for name, _ in named])
    rng = np.random.default_rng(0)
    corpora = [f"corpus-{index:02d}" for index in range(CORPORA)]
    routes = tuple(
        RouteLayout(route, tuple((corpus, int(rng.integers(2_000, 20_000))) for corpus in corpora[start::3]))
        for start, route in enumerate(("public", "licensed", "pii"))
    )
    schedule = ScheduleSpec(seed=1, world_size=RANKS, batch_size=BATCH, routes=routes)
    tokens = TokensPerRow({route.route: rng.integers(1, 512, route.rows) for route in routes})
    ledger = Ledger()
    rank = 17
    timings = []
    for step in range(steps):
        started = time.perf_counter()
        mine = slot(schedule, step, rank)
        every = step_rows(schedule, step)
        governor.begin_step(step, mine.route, every.route_counts())
        governor.masked_fraction()
        ledger.record_rows(every, table, tokens)
        timings.append(time.perf_counter() - started)
    started = time.perf_counter()
    rows = len(ledger.entries)  # the expansion a ledger write does
    expansion = time.perf_counter() - started
    print(
        f"bookkeeping: {steps} steps of {RANKS} ranks x {BATCH} rows, {len(named)} tensors, {CORPORA} "
        f"corpora: median {statistics.median(timings) * 1e3:.3f} ms/step; ledger expansion "
        f"{expansion * 1e3:.1f} ms for {rows} (corpus, tensor) rows, every {checkpoint_period} steps"
    )
    return statistics.median(timings) * 1e3 + expansion * 1e3 / checkpoint_period


def _hf_example(root: Path) -> tuple[Any, Any]:
    """The hf_lm example ingested under ``root``: a run spec and its trial, as a run builds them."""
    from govray.platform.run.plan import plan_run
    from jobs.examples.digits.golden import opened
    from jobs.examples.hf_lm.golden import example_under

    config, _, checked, _, ingested = opened(example_under(root, steps=1000))
    plan = plan_run(config, checked, ingested.root)
    return plan.named("bench", {}), plan.trial


def throughput(steps: int) -> tuple[float, str, str]:
    """govray's governed step vs a plain loop on the HF example: the median per-pair ratio of
    throughputs (examples per second), its precision and its device."""
    from govray.data.slots import slot
    from govray.train.context import WorkerContext
    from govray.train.parallel.worker import Worker
    from govray.train.step.governed import GovernedStep

    with tempfile.TemporaryDirectory() as directory:
        spec, trial = _hf_example(Path(directory))
        use_gpu = torch.cuda.is_available()
        precision = "bf16" if use_gpu else "fp32"
        settings = trial.settings.model_copy(update={"precision": precision})
        spec = spec.model_copy(update={"use_gpu": use_gpu, "settings": settings})
        trial = type(trial)(spec.hparams, settings)
        worker = Worker.detect(use_gpu)
        governed = GovernedStep(WorkerContext.of(spec, worker), trial)
        # The plain loop trains a copy of the same model (its PEFT adapter layers too, active on
        # the adapter route's batches as a PEFT user's would be) on the very rows of each step.
        plain = copy.deepcopy(governed.model)
        optimizer = torch.optim.AdamW(plain.parameters(), lr=settings.optimizer.lr)
        slots = [slot(governed.schedule, step, worker.rank) for step in range(steps)]
        rows = [governed.rows.take(item) for item in slots]  # read; collated in each plain step
        adapters = [governed.routing.adapter_names.get(item.route) if item.route else None for item in slots]

        def plain_step(step: int) -> None:
            autocast = torch.autocast(worker.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
            batch = {name: tensor.to(worker.device) for name, tensor in trial.collate(rows[step]).items()}
            with plain.active(adapters[step]), autocast:
                loss = trial.loss(plain, batch).float().mean()
            loss.backward()
            if settings.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(plain.parameters(), settings.max_grad_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def timed(run: Any) -> float:
            if use_gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            run()
            if use_gpu:
                torch.cuda.synchronize()
            return time.perf_counter() - started

        for step in range(3):  # warm-up: layouts, masks, optimizer state, allocator
            governed.step(step)
            plain_step(step)
        ratios = []
        for step in range(3, steps):  # the order flips every pair (caches, allocator)
            if step % 2:
                governed_time = timed(lambda s=step: governed.step(s))
                plain_time = timed(lambda s=step: plain_step(s))
            else:
                plain_time = timed(lambda s=step: plain_step(s))
                governed_time = timed(lambda s=step: governed.step(s))
            ratios.append(plain_time / governed_time)  # same rows: throughput ratio = time ratio
        governed.governor.check_finite()
        print(
            f"throughput: {steps - 3} interleaved pairs on {worker.device}, {precision}, batch "
            f"{trial.batch_size}: per-pair ratios min {min(ratios):.3f} "
            f"median {statistics.median(ratios):.3f} max {max(ratios):.3f}"
        )
        return statistics.median(ratios), precision, worker.device.type


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="interleaved pairs (+3 warm-up)")
    parser.add_argument("--bookkeeping-steps", type=int, default=200)
    parser.add_argument("--checkpoint-period", type=int, default=100)
    parser.add_argument("--bookkeeping-only", action="store_true", help="skip the throughput part")
    args = parser.parse_args()
    ratio, precision, device = throughput(args.steps) if not args.bookkeeping_only else (0.0, "-", "-")
    per_step = bookkeeping(args.bookkeeping_steps, args.checkpoint_period)
    print(f"govray-1worker/torch throughput ratio (hf lm, {precision}, {device}): {ratio:.3f}")
    print(
        f"governance bookkeeping per step ({RANKS} ranks x {TENSORS} tensors x {CORPORA} corpora): "
        f"{per_step:.3f} ms"
    )


if __name__ == "__main__":
    main()
