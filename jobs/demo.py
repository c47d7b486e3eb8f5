"""The main demo: the digits example under its signed depth policy, on local Ray + SQLite.

For now it verifies the signed policy, resolves it against the model (which layers each
corpus may update), ingests the three credentialed corpora with Ray Data into route-partitioned
shards, and lists the experiment in the embedded tracking store. Governed training follows.

Run from the repository root: ``python -m jobs.demo``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from govray.cli import main

EXPERIMENT = Path(__file__).resolve().parent / "examples" / "digits" / "experiment.yaml"


def demo() -> int:
    steps = [
        ("verify the signed policy and resolve it against the model", ["policy", "check", str(EXPERIMENT)]),
        ("ingest the credentialed corpora with Ray Data", ["data", "ingest", str(EXPERIMENT)]),
        ("the experiment in the tracking store", ["experiments", "list", "--config", str(EXPERIMENT)]),
    ]
    for title, argv in steps:
        print(f"\n== {title}: govray {' '.join(argv)}", flush=True)
        code = main(argv)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(demo())
