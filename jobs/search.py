"""Entry point for ``ray job submit``: the hyperparameter search of one experiment file.

    ray job submit --working-dir . -- python jobs/search.py --config EXPERIMENT.yaml

The same as ``govray search CONFIG``; resubmitting an interrupted search resumes it (Tune's
``Tuner.restore``) without rerunning finished trials.
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
    sys.exit(main(parse(sys.argv[1:])))
