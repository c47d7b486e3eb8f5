"""Data at scale: a worker's memory against the corpus's size, ingest against plain Ray Data, and
erasure lookups in a large corpus.

    python -m jobs.benchmarks.data_scale                      # 10^6 and 10^7 rows
    python -m jobs.benchmarks.data_scale --sizes 100000 1000000 --steps 50     # a quick look

For each size a corpus is generated (not committed: eight float features and a label per row,
in parquet files of 10^6 rows, under ``--work``) and ingested twice in the same run: by govray
(validation, credentials, routing, row hashes, holdout split, route-partitioned shards) and by
plain Ray Data (``read_parquet`` → ``write_parquet`` of the same files), on the same local Ray; at
the largest size both are repeated, alternating, ``--rounds`` times in all (each later ingest
forced: shards written again, not reused) and the ratio is that of the medians;
a floor is timed too: reading the files and computing every row's hash (``row_hashes``, one Ray
task per file), which any ingest that keeps the row hash must spend.
A worker alone in a fresh process (``bounded_worker``, no Ray) then trains ``--steps`` governed
steps of a run over it, validates and measures memorization, and reports its peak RSS. At the
largest size a short trial is recorded in the tracking store and random rows are looked up as
``govray lineage row`` does (``row_reach``).

Last lines:

    worker peak RSS ratio (10^7 / 10^6 rows): X.XXX          (target <= 1.2)
    ingest / plain Ray Data read+write throughput: X.XXX    (target >= 0.7; medians of --rounds)
    row lookup p99 at 10^7 rows: X.X ms                     (target <= 50)
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from govray.core.runtime import ensure_ray
from govray.data.ingest import ingest as ingest_shards
from govray.data.rowhash import row_hashes
from govray.platform.run.runner import run_trial
from govray.provenance.row_reach import row_reach
from jobs.benchmarks.bounded_worker import train_alone
from jobs.examples.digits.golden import copy_example, opened, save_experiment

ROWS_PER_FILE = 1_000_000
CORPUS = "scale-public"


def generate(directory: Path, rows: int) -> list[Path]:
    """``rows`` rows of eight features and a label in files of ``ROWS_PER_FILE``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(rows)
    files = []
    for number, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        count = min(ROWS_PER_FILE, rows - start)
        features = rng.standard_normal((count, 8), dtype=np.float32)
        columns: dict[str, Any] = {f"f{i}": features[:, i] for i in range(8)}
        columns["label"] = (features[:, 0] > 0).astype(np.int64) + 2 * (features[:, 1] > 0)
        path = directory / f"part-{number:04d}.parquet"
        pq.write_table(pa.table(columns), path)
        files.append(path)
    return files


def experiment(root: Path, rows: int, steps: int) -> Path:
    raw = copy_example(root)
    generate(root / "data" / "scale", rows)
    public = dict(raw["data"]["corpora"][0], id=CORPUS, path="data/scale")
    public.pop("format", None)
    raw["trial"] = "jobs.benchmarks.scale_trial:ScaleTrial"
    raw["hyperparameters"] = {"lr": 0.01, "batch_size": 64}
    raw["data"] = {"holdout_fraction": 0.01, "eval_rows": 2000, "corpora": [public]}
    raw["resources"] = {"workers": 1, "cpus_per_worker": 1}
    raw["searcher"]["max_length"] = {"batches": steps}
    raw.pop("lr_schedule", None)
    return save_experiment(root, raw)


def plain_ray_data(files: list[Path], out: Path) -> float:
    """Seconds for Ray Data to read the files and write them back as parquet."""
    started = time.perf_counter()
    ray.data.read_parquet([str(file) for file in files]).write_parquet(str(out))
    return time.perf_counter() - started


@ray.remote
def _hash_file(path: str) -> int:
    return len(row_hashes(pq.read_table(path))[0])


def hashing_alone(files: list[Path]) -> float:
    """Seconds to read the files and compute every row's hash (``row_hashes``), one Ray task per
    file: the least any ingest that keeps the row hash must spend beyond a plain copy."""
    started = time.perf_counter()
    ray.get([_hash_file.remote(str(file)) for file in files])
    return time.perf_counter() - started


def lookup_p99(
    config: Any, checked: Any, experiment_record: Any, shard_root: Path, store: Any, rows: int, lookups: int
) -> float:
    """p99 milliseconds of ``row_reach`` for random rows, after one short recorded trial."""
    run_trial(config, checked, experiment_record, shard_root, store, report_every=10)
    rng = random.Random(rows)
    row_reach(store, CORPUS, 0)  # warm: store connection, manifest, run spec
    times = []
    for _ in range(lookups):
        row = rng.randrange(rows)
        started = time.perf_counter()
        row_reach(store, CORPUS, row)
        times.append(time.perf_counter() - started)
    times.sort()
    return 1000 * times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs=2, default=[1_000_000, 10_000_000])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument(
        "--rounds", type=int, default=3, help="plain and ingest pairs at the largest size (medians)"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="govray-data-scale-"))
    ensure_ray()
    results: dict[int, dict[str, Any]] = {}
    for rows in args.sizes:
        root = work / f"rows-{rows}"
        shutil.rmtree(root, ignore_errors=True)
        path = experiment(root, rows, args.steps)
        files = sorted((root / "data" / "scale").glob("*.parquet"))
        plain = plain_ray_data(files, root / "plain")
        hashing = hashing_alone(files)
        started = time.perf_counter()
        config, store, checked, record, ingested = opened(path)
        ingest = time.perf_counter() - started
        if rows == args.sizes[1] and args.rounds > 1:
            plains, ingests = [plain], [ingest]
            for _ in range(args.rounds - 1):
                shutil.rmtree(root / "plain")
                plains.append(plain_ray_data(files, root / "plain"))
                started = time.perf_counter()
                ingest_shards(config, checked.policy, force=True)
                ingests.append(time.perf_counter() - started)
            print(
                f"{rows:>11,} rows, {args.rounds} rounds: plain Ray Data "
                + ", ".join(f"{seconds:.1f}" for seconds in plains)
                + " s; ingest "
                + ", ".join(f"{seconds:.1f}" for seconds in ingests)
                + " s",
                flush=True,
            )
            plain, ingest = statistics.median(plains), statistics.median(ingests)
        peak = train_alone(root, config, checked, ingested.root, config.default_hparams(), args.steps)
        results[rows] = {"plain_s": plain, "ingest_s": ingest, "hashing_s": hashing, **peak}
        print(
            f"{rows:>11,} rows: ingest {ingest:7.1f} s ({rows / ingest:>9,.0f} rows/s), plain Ray Data "
            f"{plain:6.1f} s ({rows / plain:>10,.0f} rows/s), row hashes alone {hashing:6.1f} s; "
            f"worker peak RSS {peak['peak_rss'] / 2**20:7.1f} MiB",
            flush=True,
        )
        if rows == args.sizes[1]:
            results[rows]["lookup_ms"] = lookup_p99(
                config, checked, record, ingested.root, store, rows, args.lookups
            )
    small, large = (results[size] for size in args.sizes)
    print(
        f"at {large['plain_s'] / 0.7:.1f} s (plain / 0.7) ingest would meet the target; reading and "
        f"hashing the rows alone took {large['hashing_s']:.1f} s"
    )
    label = {size: f"10^{round(math.log10(size))}" for size in args.sizes}
    print(
        f"worker peak RSS ratio ({label[args.sizes[1]]} / {label[args.sizes[0]]} rows): "
        f"{large['peak_rss'] / small['peak_rss']:.3f}"
    )
    print(f"ingest / plain Ray Data read+write throughput: {large['plain_s'] / large['ingest_s']:.3f}")
    print(f"row lookup p99 at {label[args.sizes[1]]} rows: {large['lookup_ms']:.1f} ms")


if __name__ == "__main__":
    main()
