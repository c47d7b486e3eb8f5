"""Does reporting stall the governed step? Two Ray Train workers, the digits example, 120 steps of
a few milliseconds, a signed checkpoint every 10 steps, run twice in the same session on the
same local Ray: reporting after every step, and reporting only with the checkpoints. The ratio of
their wall times (driver's ``run_trial``, Ray Train start included) is the price of reporting.

Before typed reports went through the driver's sink, each report was a ``ray.train.report``,
and Ray Train V2 holds one unread report per worker while its controller polls every 2 s: a
report every step made training wait on the controller.

Run: ``python -m jobs.benchmarks.report_stall [--steps 120] [--repeats 2]``. Last line::

    every-step/checkpoint-only reporting time ratio: X.XXX
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from jobs.examples.digits.golden import GOLDEN_HPARAMS, golden_example, opened


def timed_run(root: Path, steps: int, report_every: int) -> float:
    from govray.platform.run.runner import run_trial

    path = golden_example(
        root, 2, {"batches": steps}, GOLDEN_HPARAMS, keep_checkpoints=1000, lr_schedule=False
    )
    config, store, checked, experiment, ingested = opened(path)
    started = time.perf_counter()
    run_trial(config, checked, experiment, ingested.root, store, report_every=report_every)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from govray.core.runtime import ensure_ray

    ensure_ray()
    ratios = []
    for repeat in range(args.repeats):
        times = {}
        for label, every in (("every-step", 1), ("checkpoint-only", args.steps)):
            scratch = Path(tempfile.mkdtemp(prefix=f"stall-{label}-"))
            times[label] = timed_run(scratch, args.steps, every)
            shutil.rmtree(scratch, ignore_errors=True)
        ratios.append(times["every-step"] / times["checkpoint-only"])
        every, only = times["every-step"], times["checkpoint-only"]
        print(f"repeat {repeat}: every-step {every:.2f} s, checkpoint-only {only:.2f} s")
    print(f"every-step/checkpoint-only reporting time ratio: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
