"""The golden configuration run again with one Ray Train worker SIGKILLed mid-run."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

from govray.core.keys import platform_key, platform_trust
from govray.core.runtime import train_worker_pids
from govray.train.checkpoints.files import CheckpointError, verify_checkpoint
from govray.train.checkpoints.folders import checkpoint_directories
from tests.helpers.golden import GoldenRun, golden_run_at


def _verified_folders(run_dir: Path) -> int:
    count = 0
    for directory in checkpoint_directories(run_dir):
        try:
            verify_checkpoint(directory, platform_trust(platform_key()))
        except (CheckpointError, OSError):
            continue
        count += 1
    return count


def run_killing_a_worker(golden_run: GoldenRun, golden_example: Path, seed: int) -> tuple[GoldenRun, str]:
    """The golden configuration with one Ray Train worker SIGKILLed once the ``k``-th checkpoint
    folder verifies on storage, ``delay`` seconds later or when the next checkpoint's folder
    appears, whichever comes first (seed 0: at once, before Ray Train's next 2-s poll collects the
    report that goes with it)."""
    rng = random.Random(seed)
    k = 1 if seed == 0 else rng.choice([1, 2])
    delay = 0.0 if seed == 0 else rng.uniform(0.0, 2.5)
    victim = rng.choice([0, -1])
    store = golden_run.store
    known = {trial.id for trial in store.list_trials(1)}
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(run=golden_run_at(golden_example)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    killed = None
    while killed is None and time.monotonic() < deadline and thread.is_alive():
        new = [t for t in store.list_trials(1) if t.id not in known and t.ray_run_name]
        run_dir = golden_run.outcome.run_dir.parent / str(new[0].ray_run_name) if new else None
        if run_dir is not None and _verified_folders(run_dir) >= k:
            # ``delay`` later, or sooner if the next checkpoint's folder appears first: the workers
            # are still alive then (a fast run could otherwise end within the delay).
            until = time.monotonic() + delay
            while time.monotonic() < until and len(checkpoint_directories(run_dir)) <= k:
                time.sleep(0.01)
            pids = sorted(train_worker_pids())
            if pids:
                killed = pids[victim]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    thread.join(timeout=600)
    assert killed is not None, f"seed {seed}: never saw checkpoint {k} of the run to kill"
    assert "run" in result, f"seed {seed}: the killed run did not finish"
    return result["run"], f"k={k} delay={delay:.2f}s victim={victim}"
