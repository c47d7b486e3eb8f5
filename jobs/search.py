"""Entry point for ``ray job submit``: the hyperparameter search of one experiment file.

    ray job submit --working-dir . -- python jobs/search.py --config EXPERIMENT.yaml
    govray submit EXPERIMENT.yaml --search --address http://HEAD:8265   # the same, with pins and checks

The same as ``govray job search --config CONFIG`` (what ``govray submit --search`` runs): this
node's packages checked against the job's pins, then ``govray search CONFIG``; resubmitting an
interrupted search resumes it (Tune's ``Tuner.restore``) without rerunning finished trials. A job's
log is no terminal: the search's progress comes as plain lines (``search 3/4 trials · 1 running ·
...``; README, "Hyperparameter search"), one per change at most every 5 s, instead of Ray Tune's
tables.
"""

from __future__ import annotations

import sys

from govray.cli import main


def parse(argv: list[str]) -> list[str]:
    """The CLI arguments this script runs: ``govray job search`` with ``argv`` (``--config CONFIG
    [--allow-unsigned-policy]``)."""
    return ["job", "search", *argv]


if __name__ == "__main__":
    sys.exit(main(parse(sys.argv[1:])))
