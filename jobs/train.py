"""Entry point for ``ray job submit``: a governed training run of one experiment file.

    ray job submit --working-dir . -- python jobs/train.py --config jobs/examples/digits/experiment.yaml
    govray submit EXPERIMENT.yaml --address http://HEAD:8265   # the same, with pins and checks

The same as ``govray job train --config CONFIG`` (what ``govray submit`` runs): this node's packages
checked against the job's pins, then ``govray run CONFIG --resume-interrupted`` (a resubmitted job
continues the trial its dead driver left behind); inside a Ray job the driver joins the job's cluster.
"""

from __future__ import annotations

import sys

from govray.cli import main


def parse(argv: list[str]) -> list[str]:
    """The CLI arguments this script runs: ``govray job train`` with ``argv`` (``--config CONFIG
    [--allow-unsigned-policy]``)."""
    return ["job", "train", *argv]


if __name__ == "__main__":
    sys.exit(main(parse(sys.argv[1:])))
