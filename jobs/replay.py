"""Entry point for ``ray job submit``: counterfactual replay of a recorded experiment.

    ray job submit --working-dir . -- python jobs/replay.py digits-governed \\
        --exclude-corpus digits-writers --database sqlite:////shared/govray.db

The same as ``govray replay``.
"""

from __future__ import annotations

import sys

from govray.cli import main

if __name__ == "__main__":
    sys.exit(main(["replay", *sys.argv[1:]]))
