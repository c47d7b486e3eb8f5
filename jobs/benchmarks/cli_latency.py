"""How long the ``govray`` command takes to answer when it has little to do.

    python -m jobs.benchmarks.cli_latency [--runs 5] [--database URL]

Times fresh processes, as a person at a terminal starts them: ``python -m govray --help`` and a
command that only reads the tracking store (``govray model list --database URL``: a store made
here with one experiment, one trial and one audit event, or the one given, e.g. the demo's
``sqlite:///demo/storage/govray.db``). Against two baselines timed in the same rounds: the
interpreter starting (``python -c pass``) and ``python -c "import torch"``, which is what a command
that imports the training stack pays before it does anything. Each is the median of ``--runs``
rounds (one untimed round first warms the file cache), the commands interleaved in each round so
that a busy machine slows them all alike. Targets: ``--help`` at most 0.5 s, a store-only command
at most 1.5 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.database import masked
from govray.tracking.store import TrackingStore

REPO = Path(__file__).resolve().parents[2]
TARGETS_S = {"govray --help": 0.5, "govray model list": 1.5}


def small_store(directory: Path) -> str:
    """A SQLite tracking store with an experiment, a trial and an audit event; its URL."""
    url = f"sqlite:///{directory / 'tracking.db'}"
    store = TrackingStore.open(url)
    experiment = store.create_experiment("digits", "{}", "c" * 64, str(directory / "storage"))
    assert experiment.id is not None
    store.create_trial(experiment.id, "{}", seed=7)
    AuditLog(store).append(AuditEventType.EXPERIMENT_CREATED, {"name": "digits"}, experiment_id=experiment.id)
    store.close()
    return url


def seconds(command: list[str]) -> float:
    """Wall time of one fresh process running ``command``; it must exit 0."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
    return took


def measure(commands: dict[str, list[str]], runs: int) -> dict[str, float]:
    """The median wall time of each command over ``runs`` interleaved rounds."""
    for command in commands.values():  # warm the file cache; not counted
        seconds(command)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, command in commands.items():
            times[name].append(seconds(command))
    return {name: statistics.median(taken) for name, taken in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds to take the median of (default 5)")
    parser.add_argument("--database", help="a tracking store URL (default: a small one made here)")
    options = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="govray-cli-latency-") as scratch:
        database = options.database or small_store(Path(scratch))
        medians = measure(
            {
                "python -c pass": [python, "-c", "pass"],
                "python -c 'import torch'": [python, "-c", "import torch"],
                "govray --help": [python, "-m", "govray", "--help"],
                "govray model list": [python, "-m", "govray", "model", "list", "--database", database],
            },
            options.runs,
        )
    start, torch = medians["python -c pass"], medians["python -c 'import torch'"]
    store = masked(options.database) if options.database else "a small SQLite store made here"
    print(f"median of {options.runs} fresh processes each; store: {store}")
    print(f"{'command':<26} {'seconds':>8} {'/ start':>8} {'/ torch':>8}  target")
    for name, median in medians.items():
        target = TARGETS_S.get(name)
        verdict = "" if target is None else f"<= {target:g} s: {'met' if median <= target else 'MISSED'}"
        print(f"{name:<26} {median:>8.3f} {median / start:>8.2f} {median / torch:>8.2f}  {verdict}")


if __name__ == "__main__":
    main()
