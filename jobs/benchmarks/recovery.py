"""What a killed worker costs: a governed run with one Ray Train worker SIGKILLed mid-way vs the same
run uninterrupted, and how big governance state is next to the model in a checkpoint.

The model is the digits MLP widened to ≥ 5M parameters (hidden 2304); 2 workers; checkpoints every
P steps. The worker is killed once the first checkpoint is recorded plus half a period of steps.

Run: ``python -m jobs.benchmarks.recovery [--steps 60 --period 20]``. The last lines are::

    lost steps after kill: N (checkpoint period P)
    recovery overhead ratio: X.XXX
    governance state / model checkpoint size: X.XXXX
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from govray.config.experiment import load_experiment
from govray.core.runtime import ensure_ray, train_worker_pids
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.run.runner import TrialOutcome, run_trial
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    STATE_FILE,
    find_checkpoints,
    model_file,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "examples" / "digits"


def experiment_file(root: Path, steps: int, period: int) -> Path:
    shutil.copytree(EXAMPLE / "data", root / "data")
    raw = yaml.safe_load((EXAMPLE / "experiment.yaml").read_text())
    raw["policy"] = {
        "file": str(REPO / "policies" / "digits.policy.yaml"),
        "trust": str(REPO / "policies" / "trust.yaml"),
    }
    raw["storage_path"] = str(root / "storage")
    raw["hyperparameters"] = {"hidden": 2304, "dropout": 0.1, "lr": 0.001, "batch_size": 32}
    raw["searcher"] = {"name": "single", "max_length": {"batches": steps}}
    raw["checkpoint"] = {"period": period, "save_trial_latest": 1000}
    raw["max_restarts"] = 2
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def timed_run(path: Path, kill_after: int | None) -> tuple[float, TrialOutcome, int | None]:
    """(wall seconds of training, outcome, last step reported before the kill)."""
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    result: dict[str, Any] = {}

    def train() -> None:
        result["outcome"] = run_trial(config, checked, experiment, ingested.root, store, report_every=1)

    started = time.perf_counter()
    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    reported_at_kill = None
    while kill_after is not None and reported_at_kill is None and thread.is_alive():
        trials = store.list_trials(experiment.id)  # type: ignore[arg-type]
        if trials and trials[-1].id is not None:
            steps = [m.step for m in store.metrics(trials[-1].id, "training_loss")]
            if steps and steps[-1] >= kill_after and checkpoints(store, trials[-1].id):
                pids = train_worker_pids()
                if pids:
                    os.kill(pids[-1], signal.SIGKILL)
                    reported_at_kill = steps[-1]
        time.sleep(0.02)
    thread.join()
    return time.perf_counter() - started, result["outcome"], reported_at_kill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--period", type=int, default=20)
    args = parser.parse_args()
    ensure_ray()
    with tempfile.TemporaryDirectory() as scratch:
        plain_time, plain, _ = timed_run(
            experiment_file(Path(scratch) / "plain", args.steps, args.period), None
        )
        kill_after = args.period + args.period // 2
        killed_time, _, reported = timed_run(
            experiment_file(Path(scratch) / "killed", args.steps, args.period), kill_after
        )
        assert reported is not None, "the worker was never killed"
        lost = reported - (reported // args.period) * args.period
        final = find_checkpoints(plain.run_dir)[-1]
        state = sum((final / name).stat().st_size for name in (STATE_FILE, MANIFEST_FILE, SIGNATURE_FILE))
        model = model_file(final).stat().st_size
        print(f"model.safetensors {model} bytes; state.json + manifest + signature {state} bytes")
        print(
            f"uninterrupted {plain_time:.1f} s, killed at step {reported} and recovered {killed_time:.1f} s"
        )
        print(f"lost steps after kill: {lost} (checkpoint period {args.period})")
        print(f"recovery overhead ratio: {killed_time / plain_time:.3f}")
        print(f"governance state / model checkpoint size: {state / model:.4f}")


if __name__ == "__main__":
    main()
