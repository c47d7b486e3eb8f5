"""The hf_lm example as tests and benchmarks build it: a copy of its experiment file under a
directory of their own (absolute data and policy paths, storage there), a few steps long."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jobs.examples.digits.golden import save_experiment

EXAMPLE = Path(__file__).resolve().parent


def example_under(root: Path, steps: int, **training: Any) -> Path:
    """The example with absolute data and policy paths, storage under ``root``, ``steps`` steps,
    a checkpoint and a validation halfway and at the end; ``training`` settings override its own."""
    raw: dict[str, Any] = yaml.safe_load((EXAMPLE / "experiment.yaml").read_text())
    for corpus in raw["data"]["corpora"]:
        corpus["path"] = str((EXAMPLE / corpus["path"]).resolve())
        if "canaries" in corpus:
            corpus["canaries"] = {
                "file": str((EXAMPLE / corpus["canaries"]["file"]).resolve()),
                "references": 50,
            }
    raw["policy"] = {key: str((EXAMPLE / value).resolve()) for key, value in raw["policy"].items()}
    raw["storage_path"] = "storage"
    raw["searcher"]["max_length"] = {"batches": steps}
    raw["checkpoint"] = {"period": max(1, steps // 2), "save_trial_latest": 10}
    raw["min_validation_period"] = max(1, steps // 2)
    raw["training"] = {**raw.get("training", {}), **training}
    return save_experiment(root, raw)
