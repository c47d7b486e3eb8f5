"""Small builders many tests share: signed policies, corpora, experiment files."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from govray.core.keys import SigningKey
from govray.governance.policy import sign_policy

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "jobs" / "examples" / "text"

BASE_CREDENTIAL: dict[str, Any] = {
    "license_class": "public-domain",
    "jurisdiction": "US",
    "sensitivity": "public",
    "source_type": "public-dataset",
    "modality": "tabular",
    "tdm_opt_out": False,
    "collection_period": {"start": "2020-01-01", "end": "2020-12-31"},
}


def write_signed_policy(
    directory: Path, policy: dict[str, Any], key: SigningKey, name: str = "policy"
) -> Path:
    """Write POLICY.yaml and POLICY.yaml.sig (signed by ``key``); return the policy path."""
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    path.with_name(path.name + ".sig").write_text(sign_policy(path, key).to_json())
    return path


def table_rows(count: int, start: int = 0, **extra: list[Any]) -> list[dict[str, Any]]:
    rows = [{"x": float(i) / 7.0, "y": i % 3, "text": f"row {i}"} for i in range(start, start + count)]
    for column, values in extra.items():
        for row, value in zip(rows, values, strict=True):
            row[column] = value
    return rows


def write_corpus(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` as parquet, jsonl or csv according to the file extension."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["x"])
            writer.writeheader()
            writer.writerows(rows)
    return path


def write_experiment(directory: Path, **overrides: Any) -> Path:
    """An experiment file in ``directory`` using the digits trial; ``overrides`` replace keys."""
    config: dict[str, Any] = {
        "name": "test-experiment",
        "trial": "jobs.examples.digits.trial:DigitsTrial",
        "hyperparameters": {"hidden": 16, "dropout": 0.0},
        "data": {"holdout_fraction": 0.2, "corpora": []},
        "policy": {"file": "policy.yaml", "trust": "trust.yaml"},
        "storage_path": "storage",
        "seed": 1,
    }
    config.update(overrides)
    path = directory / "experiment.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def text_experiment(directory: Path) -> dict[str, Any]:
    """The text example's experiment document, its paths made absolute, storage in ``directory``."""
    raw: dict[str, Any] = yaml.safe_load((TEXT / "experiment.yaml").read_text())
    for corpus in raw["data"]["corpora"]:
        corpus["path"] = str(TEXT / corpus["path"])
        if "canaries" in corpus:
            corpus["canaries"]["file"] = str(TEXT / corpus["canaries"]["file"])
    raw["policy"] = {key: str((TEXT / path).resolve()) for key, path in raw["policy"].items()}
    raw["storage_path"] = str(directory / "storage")
    return raw


def governed_step(spec: Any, worker: Any = None, settings: Any = None) -> Any:
    """The ``GovernedStep`` of ``spec`` as a worker builds it (its ``WorkerContext``, its trial),
    on ``worker`` (default: rank 0 of 1), under other training ``settings`` when given (they go
    into the spec: the parallelism twin reads the precision there, the trial the rest)."""
    from govray.train.context import WorkerContext
    from govray.train.parallel.worker import Worker
    from govray.train.step.governed import GovernedStep
    from govray.train.trial import make_trial

    if settings is not None:
        spec = spec.model_copy(update={"settings": settings})
    context = WorkerContext.of(spec, worker if worker is not None else Worker(0, 1))
    return GovernedStep(context, make_trial(spec.trial, spec.hparams, spec.settings))
