"""A worker alone in this process (no Ray), for tests/test_worker_memory.py and data_scale.py:

    python -m jobs.benchmarks.bounded_worker RUN_JSON STEPS

trains STEPS governed steps of the run, validates once, measures memorization once, and prints
JSON with its peak RSS in bytes and the examples its ledger counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from govray.platform.run.plan import plan_run
from govray.train.context import WorkerContext
from govray.train.parallel.worker import Worker
from govray.train.runspec import read_run_spec
from govray.train.step.governed import GovernedStep
from govray.train.trial import make_trial


def train_alone(
    root: Path, config: Any, checked: Any, shard_root: Path, hparams: dict[str, Any], steps: int
) -> dict[str, Any]:
    """A run of ``config`` over ``shard_root`` (its spec written to ``root/run.json``) trained for
    ``steps`` steps by a worker alone in a fresh process: what ``main`` prints."""
    spec = plan_run(config, checked, shard_root, hparams=hparams).named(root.name, {})
    (root / "run.json").write_text(spec.model_dump_json())
    done = subprocess.run(
        [sys.executable, "-m", "jobs.benchmarks.bounded_worker", str(root / "run.json"), str(steps)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def peak_rss() -> int:
    """This process's peak RSS in bytes (``VmHWM``: unlike ``ru_maxrss``, not inherited from the
    process that started it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM (not Linux?)")


def main(run_json: str, steps: int) -> None:
    spec = read_run_spec(Path(run_json))
    governed = GovernedStep(
        WorkerContext.of(spec, Worker(0, 1)), make_trial(spec.trial, spec.hparams, spec.settings)
    )
    examples = sum(int(governed.step(step)[1]) for step in range(steps))
    governed.batches.close()
    validation = governed.evaluate()
    governed.memorization()
    counted = max(entry.examples for entry in governed.ledger.entries.values())
    peak = peak_rss()
    print(json.dumps({"peak_rss": peak, "examples": examples, "ledger": counted, **validation}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
