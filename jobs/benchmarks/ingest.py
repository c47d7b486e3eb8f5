"""Ingest throughput: rows per second of ``govray.data.ingest`` on a generated corpus.

Two training corpora of small rows (parquet, several files each), with per-row license and
sensitivity columns so rows spread over three routes and the holdout; the policy is unsigned (a
benchmark, not a run). Each measured run re-ingests with ``force=True`` after one warm-up run that
starts Ray's workers.

Run: ``python -m jobs.benchmarks.ingest`` (``--rows N`` per corpus, ``--runs R``). The last line::

    ingest: N rows in S s: X rows/s (median of R runs)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from govray.config.experiment import load_experiment
from govray.core.runtime import ensure_ray
from govray.data.ingest import ingest
from govray.governance.policy import load_verified_policy

POLICY: dict[str, Any] = {
    "name": "ingest-benchmark",
    "version": 1,
    "adapters": {"pii-lora": {"targets": ["hidden"]}},
    "rules": [
        {"name": "public", "match": {"license_class": "public-domain"}, "route": "all"},
        {"name": "licensed", "match": {"license_class": "licensed"}, "route": {"depth": {"min": -1}}},
        {"name": "pii", "match": {"sensitivity": "pii"}, "route": {"adapter": "pii-lora"}},
    ],
}
CREDENTIAL: dict[str, Any] = {
    "license_class": "public-domain",
    "jurisdiction": "US",
    "sensitivity": "public",
    "source_type": "public-dataset",
    "modality": "tabular",
    "tdm_opt_out": False,
    "collection_period": {"start": "2020-01-01", "end": "2020-12-31"},
}
LICENSES = ("public-domain", "licensed", "proprietary")


def write_corpus(directory: Path, rows: int, files: int, seed: int) -> None:
    """``rows`` rows in ``files`` parquet files: x, y, text, and the credential columns."""
    directory.mkdir(parents=True)
    per_file = -(-rows // files)
    for number, start in enumerate(range(0, rows, per_file)):
        index = range(start, min(rows, start + per_file))
        table = pa.table(
            {
                "x": [((i * 7919 + seed) % 1000) / 7.0 for i in index],
                "y": [i % 3 for i in index],
                "text": [f"row {seed}-{i}" for i in index],
                "lic": [LICENSES[(i * 31 + seed) % 3] for i in index],
                # proprietary rows are pii (the adapter route); the others match a rule first
                "sens": ["pii" if (i * 31 + seed) % 3 == 2 else "public" for i in index],
            }
        )
        pq.write_table(table, directory / f"part-{number:03d}.parquet")


def experiment(root: Path, rows: int, files: int) -> Path:
    for seed, name in enumerate(("first", "second")):
        write_corpus(root / name, rows, files, seed)
    (root / "policy.yaml").write_text(yaml.safe_dump(POLICY, sort_keys=False))
    columns = {"license_class": "lic", "sensitivity": "sens"}
    config = {
        "name": "ingest-benchmark",
        "trial": "jobs.examples.digits.trial:DigitsTrial",
        "hyperparameters": {"hidden": 16, "dropout": 0.0},
        "data": {
            "holdout_fraction": 0.1,
            "corpora": [
                {"id": name, "path": name, "credential": CREDENTIAL, "credential_columns": columns}
                for name in ("first", "second")
            ],
        },
        "policy": {"file": "policy.yaml"},
        "storage_path": "storage",
        "seed": 1,
    }
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000, help="rows per corpus")
    parser.add_argument("--files", type=int, default=4, help="parquet files per corpus")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    ensure_ray()
    with tempfile.TemporaryDirectory() as workdir:
        config = load_experiment(experiment(Path(workdir), args.rows, args.files))
        policy = load_verified_policy(config.policy.file, None, None, allow_unsigned=True)
        ingest(config, policy, force=True)  # warm-up: Ray's workers and imports
        seconds = []
        for _ in range(args.runs):
            start = time.perf_counter()
            result = ingest(config, policy, force=True)
            seconds.append(time.perf_counter() - start)
        total = sum(corpus.rows for corpus in result.manifest.corpora)
        files = sum(len(route.files) for route in result.manifest.routes)
        print(f"runs: {', '.join(f'{s:.2f} s' for s in seconds)}; {files} training files")
        median = statistics.median(seconds)
        rate = f"{total / median:,.0f} rows/s"
        print(f"ingest: {total} rows in {median:.2f} s: {rate} (median of {args.runs} runs)")


if __name__ == "__main__":
    main()
