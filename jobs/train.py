"""Entry point for ``ray job submit``: a governed training run of one experiment file.

    ray job submit --working-dir . -- python jobs/train.py --config jobs/examples/digits/experiment.yaml
    govray submit EXPERIMENT.yaml --address http://HEAD:8265   # the same, with pins and checks

The same as ``govray run CONFIG``; inside a Ray job the driver joins the job's cluster.
"""

from __future__ import annotations

import argparse
import sys

from govray.cli import main


def parse(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="experiment file (YAML)")
    parser.add_argument("--allow-unsigned-policy", action="store_true")
    args = parser.parse_args(argv)
    flags = ["--allow-unsigned-policy"] if args.allow_unsigned_policy else []
    # A resubmitted job continues the trial its dead driver left behind.
    return ["run", args.config, "--resume-interrupted", *flags]


if __name__ == "__main__":
    # A job that `govray submit` sent first checks this node's packages against its pins (exit 22).
    sys.exit(main(["job", "verify-pins"]) or main(parse(sys.argv[1:])))
