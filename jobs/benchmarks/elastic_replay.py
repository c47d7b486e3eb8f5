"""Replay of a resized run: does `govray replay` reproduce a run that changed world size mid-way?

The digits example (golden hyperparameters) on 3 Ray Train workers, 30 steps, checkpoints every
10: paused (`govray experiment pause`, asked as it starts: it stops at its first control boundary,
step 5) and resumed with `govray resume --workers 2`, paused again the same way (step 10) and
resumed with `--workers 3` to the end. Its final checkpoint records the world sizes (3 from step
0, 2 from the first pause, 3 from the second). The trial is then replayed with nothing
excluded: the replay follows those world sizes segment by segment, and its final weights,
optimizer state and ledger are compared byte for byte. A fixed 3-worker run of the same trial
(what a replay on one world size reproduces) is compared too: whether the resize changed the
bytes at all (the summation order of 3 slots on 2 workers is not that of 3 workers).

Run: ``python -m jobs.benchmarks.elastic_replay``. A local Ray with 4 CPUs (3 one-CPU workers)
is started unless one is connected. Its last line is::

    replay of a run resized 3 -> 2 -> 3 workers bit-identical: yes|no

(``jobs/benchmarks/elastic.py`` prints it with the other elastic scenarios' lines.)
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STEPS = 30
WORLDS = (3, 2, 3)
COMPARED = ("model.safetensors", "adapter-pii-lora.safetensors", "optimizer.safetensors")


@contextlib.contextmanager
def local_ray(cpus: int) -> Iterator[None]:
    """A local Ray with ``cpus`` CPUs for the scenario, unless this process is connected already."""
    import ray

    from govray.core.raylogs import route_ray_logs

    if ray.is_initialized():
        yield
        return
    ray.init(
        address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    importlib.import_module("ray.data")  # it configures its loggers at import
    route_ray_logs()  # Ray's loggers write to govray's log file, as in `govray` commands
    try:
        yield
    finally:
        ray.shutdown()


def govray(*args: str) -> str:
    """``govray ARGS`` in this process; what it printed (exit 0 required)."""
    from govray.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(list(args))
    if code != 0:
        raise RuntimeError(f"govray {' '.join(args)} exited {code}: {printed.getvalue()}")
    return printed.getvalue()


def paused(store: Any, experiment_id: int, run: Callable[[], Any]) -> None:
    """``run()`` while a watcher asks for a pause (`govray experiment pause`) as soon as the
    experiment is active: the workers, still starting, stop at their first look (the control
    period's first boundary) with a checkpoint. Fails unless the trial ended paused."""
    from govray.platform.lifecycle import request_pause

    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if store.get_experiment(experiment_id).state == "active":
                request_pause(store, experiment_id)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run()
    finally:
        done.set()
        watcher.join()
    state = store.list_trials(experiment_id)[-1].state
    if state != "paused":
        raise RuntimeError(f"the run was to pause; it ended {state}")


def final_checkpoint(run_dir: Path) -> Path:
    from govray.train.checkpoints.files import find_checkpoints

    return find_checkpoints(run_dir)[-1]


def resized_then_replayed(workdir: Path) -> tuple[Path, Path, Path, list[list[int]]]:
    """The resized run's, its replay's and a fixed 3-worker run's final checkpoints, and the
    recorded world history."""
    from govray.platform.rerun.replay import replay_trial
    from govray.platform.rerun.world_history import describe_segments
    from govray.platform.run.runner import run_trial
    from jobs.examples.digits.golden import GOLDEN_HPARAMS, golden_example, opened

    path = golden_example(workdir, WORLDS[0], {"batches": STEPS}, GOLDEN_HPARAMS, keep_checkpoints=1000)
    config, store, checked, experiment, ingested = opened(path)
    database = ("--database", config.database_url)
    paused(store, experiment.id, lambda: run_trial(config, checked, experiment, ingested.root, store))
    workers = ("--workers", str(WORLDS[1]))
    paused(store, experiment.id, lambda: govray("resume", config.name, *database, *workers))
    govray("resume", config.name, *database, "--workers", str(WORLDS[2]))
    trial = store.list_trials(experiment.id)[-1]
    if trial.state != "completed":
        raise RuntimeError(f"the resized run ended {trial.state}")
    resized = final_checkpoint(Path(config.storage_path) / "ray" / trial.ray_run_name)
    history = json.loads((resized / "state.json").read_text())["world_history"]
    started = time.perf_counter()
    replay = replay_trial(store, config.name, (), trial_id=trial.id)
    print(f"{describe_segments(replay.segments)}: {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    fixed = run_trial(config, checked, experiment, ingested.root, store)  # what a one-world replay gives
    print(f"a fixed 3-worker run of the same trial (one segment): {time.perf_counter() - started:.1f} s")
    return resized, final_checkpoint(replay.outcome.run_dir), final_checkpoint(fixed.run_dir), history


def measure(workdir: Path) -> str:
    """Run the scenario under ``workdir``; returns its line."""
    with local_ray(cpus=4):
        resized, replayed, fixed, history = resized_then_replayed(workdir)
    print(f"world history of the resized run (from step, workers): {history}")
    differs = (fixed / COMPARED[0]).read_bytes() != (resized / COMPARED[0]).read_bytes()
    print(f"a fixed 3-worker run's base differs from the resized run's: {'yes' if differs else 'no'}")
    worlds = [workers for _, workers in history]
    same = all((resized / name).read_bytes() == (replayed / name).read_bytes() for name in COMPARED)
    ledgers = [json.loads((folder / "state.json").read_text())["ledger"] for folder in (resized, replayed)]
    identical = worlds == list(WORLDS) and same and ledgers[0] == ledgers[1]
    return f"replay of a run resized 3 -> 2 -> 3 workers bit-identical: {'yes' if identical else 'no'}"


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="elastic-replay-") as scratch:
        print(measure(Path(scratch)))


if __name__ == "__main__":
    main()
