"""The main demo: a governed 2-worker run of the digits example on local Ray + SQLite.

It verifies the signed depth policy and shows which parameters each corpus may update, ingests
the three credentialed corpora with Ray Data into route-partitioned shards, trains on two Ray Train
workers with the governance-aware allreduce (progress bar), prints validation accuracy and the
per-corpus x per-layer ledger, and lists the experiment in the embedded tracking store.

Run from the repository root: ``python -m jobs.demo``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from govray.cli import main

EXPERIMENT = Path(__file__).resolve().parent / "examples" / "digits" / "experiment.yaml"


def demo() -> int:
    steps = [
        ("the signed policy, resolved against the model", ["policy", "check", str(EXPERIMENT)]),
        ("ingest and governed training on 2 Ray Train workers", ["run", str(EXPERIMENT)]),
        ("the experiment in the tracking store", ["experiment", "list", "--config", str(EXPERIMENT)]),
    ]
    for title, argv in steps:
        print(f"\n== {title}: govray {' '.join(argv)}", flush=True)
        code = main(argv)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(demo())
