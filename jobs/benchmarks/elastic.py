"""Elastic and preemptible governed training (issue 34): its three scenarios' lines, in order.

Each scenario is a module of its own whose ``measure(workdir)`` runs it on a local Ray and returns
its line (what else it measures, it prints):

1. ``elastic_notice``: a worker node drained with a preemption notice —
   ``steps lost to a preemption with notice: N`` (target 0);
2. ``elastic_kill``: a worker node killed without notice, then back —
   ``steps lost to a worker killed without notice: N (checkpoint period P)`` (target <= P);
3. ``elastic_replay``: a run resized 3 -> 2 -> 3 workers replayed —
   ``replay of a run resized 3 -> 2 -> 3 workers bit-identical: yes|no`` (target yes).

Run: ``python -m jobs.benchmarks.elastic`` from the repository root. A scenario whose module is
not there is skipped with a line saying so; the last lines are the scenarios' lines.
"""

from __future__ import annotations

import importlib
import tempfile
from pathlib import Path

SCENARIOS = ("elastic_notice", "elastic_kill", "elastic_replay")


def main() -> None:
    lines = []
    for name in SCENARIOS:
        try:
            module = importlib.import_module(f"jobs.benchmarks.{name}")
        except ModuleNotFoundError as missing:
            if missing.name != f"jobs.benchmarks.{name}":
                raise
            print(f"skipped: jobs/benchmarks/{name}.py is not in this tree")
            continue
        print(f"-- {name}", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"govray-{name}-") as workdir:
            lines.append(module.measure(Path(workdir)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
