"""Worker memory does not grow with the corpus: a worker trains, validates and measures
memorization on a corpus several times larger than a memory cap set for its growth, reading only
its slots' row groups (ARCHITECTURE.md, "Data at scale")."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.benchmarks.bounded_worker import train_alone
from jobs.benchmarks.scale_trial import FEATURES
from jobs.examples.digits.golden import copy_example, opened, save_experiment

pytestmark = pytest.mark.cluster

PAYLOAD = 4 << 10  # bytes of incompressible payload per row (the trial never reads it)
CAP = 64 << 20  # how much more a worker may hold for the large corpus than for a quarter of it
STEPS = 60


def corpus(path: Path, rows: int) -> int:
    """``rows`` rows of the data_scale trial's eight features and label, each with a random
    payload; returns its size on disk."""
    rng = np.random.default_rng(rows)
    features = rng.standard_normal((rows, len(FEATURES)), dtype=np.float32)
    columns: dict[str, Any] = {name: features[:, index] for index, name in enumerate(FEATURES)}
    columns["label"] = (features[:, 0] > 0).astype(np.int64)
    columns["payload"] = pa.array([rng.bytes(PAYLOAD) for _ in range(rows)], pa.binary())
    pq.write_table(pa.table(columns), path, row_group_size=1024, compression="zstd")
    return path.stat().st_size


def trained(root: Path, rows: int) -> tuple[int, dict[str, Any]]:
    raw = copy_example(root)
    size = corpus(root / "data" / "large.parquet", rows)
    public = dict(raw["data"]["corpora"][0], id="payloads", path="data/large.parquet")
    raw["trial"] = "jobs.benchmarks.scale_trial:ScaleTrial"
    raw["hyperparameters"] = {"lr": 0.01}
    raw["data"] = {"holdout_fraction": 0.05, "eval_rows": 256, "corpora": [public]}
    raw["searcher"]["max_length"] = {"batches": STEPS}
    config, _store, checked, _experiment, ingested = opened(save_experiment(root, raw))
    hparams = {**config.default_hparams(), "batch_size": 16}
    return size, train_alone(root, config, checked, ingested.root, hparams, STEPS)


def test_a_corpus_several_times_larger_than_the_workers_memory_cap_trains_to_completion(
    ray_session: None, tmp_path: Path
) -> None:
    # Both corpora outgrow what a worker bounds (its row-group cache, its open files, the probe's
    # samples); the larger by six times the cap.
    small_size, small = trained(tmp_path / "small", 32_000)
    large_size, large = trained(tmp_path / "large", 128_000)
    assert large_size - small_size > 5 * CAP  # the corpus grew by several times the cap
    assert large["ledger"] == large["examples"] >= STEPS * 16 - 15  # every step read its slot
    assert math.isfinite(large["validation_loss"])
    grown = large["peak_rss"] - small["peak_rss"]
    assert grown < CAP, f"the worker's peak RSS grew by {grown / 2**20:.0f} MiB with the corpus"
