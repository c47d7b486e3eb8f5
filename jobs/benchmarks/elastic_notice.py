"""What a spot reclaim with notice costs a governed run: no step.

A 2-worker digits run (hidden 2304, 80 steps, a checkpoint every 50) on a local Ray cluster of a
head and two nodes; once its workers run, the node of one of them is drained for preemption with
15 s left (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``) and SIGKILLed at the
deadline (``tests/helpers/spot_drain.py``). The workers seal a checkpoint at the control-period
boundary after the notice and train nothing more; Ray Train restarts them on the nodes left.

Run: ``python -m jobs.benchmarks.elastic_notice``. The last line is::

    steps lost to a preemption with notice: N

N = the last step the first worker group trained minus the step the restart resumed from (rank
0 logs every step: the driver reports each). ``jobs/benchmarks/elastic.py`` prints it with the
other elastic scenarios.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.helpers.local_ray import LocalRayCluster
from tests.helpers.spot_drain import run_reclaimed

STEPS, PERIOD, DEADLINE_S = 80, 50, 15


def measure(workdir: Path) -> str:
    """Run the scenario under ``workdir``; returns its last line."""
    cluster = LocalRayCluster()
    try:
        reclaimed = run_reclaimed(cluster, workdir, steps=STEPS, period=PERIOD, deadline_s=DEADLINE_S)
    finally:
        cluster.stop()
    if reclaimed.returncode != 0:
        raise RuntimeError(f"the reclaimed run failed: {reclaimed.output[-3000:]}")
    print(
        f"notice for node {reclaimed.node[:12]} (ranks {reclaimed.ranks}, {DEADLINE_S} s left): sealed "
        f"after step {reclaimed.first_group_last_step}, resumed from step {reclaimed.resumed_from} "
        f"{reclaimed.restart_seconds:.1f} s after the seal; driver {reclaimed.seconds:.1f} s "
        f"(checkpoint period {PERIOD})"
    )
    return f"steps lost to a preemption with notice: {reclaimed.steps_lost}"


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        print(measure(Path(scratch)))


if __name__ == "__main__":
    main()
