"""Entry point for ``ray job submit``: the hyperparameter search of one experiment file.

    ray job submit --working-dir . -- python jobs/search.py --config EXPERIMENT.yaml
    govray submit EXPERIMENT.yaml --search --address http://HEAD:8265   # the same, with pins and checks

The same as ``govray search CONFIG``; resubmitting an interrupted search resumes it (Tune's
``Tuner.restore``) without rerunning finished trials. A job's log is no terminal: the search's
progress comes as plain lines (``search 3/4 trials · 1 running · ...``; README, "Hyperparameter
search"), one per change at most every 5 s, instead of Ray Tune's tables.
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
    return ["search", args.config, *(["--allow-unsigned-policy"] if args.allow_unsigned_policy else [])]


if __name__ == "__main__":
    # A job that `govray submit` sent first checks this node's packages against its pins (exit 22).
    sys.exit(main(["job", "verify-pins"]) or main(parse(sys.argv[1:])))
