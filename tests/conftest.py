"""Shared fixtures: one Ray instance per test session, keys, signed policies, small corpora."""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from govray.keys import KeyRole, SigningKey, TrustConfig, save_trust
from govray.policy import sign_policy

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_CONFIG = REPO / "jobs" / "examples" / "digits" / "experiment.yaml"

BASE_CREDENTIAL: dict[str, Any] = {
    "license_class": "public-domain",
    "jurisdiction": "US",
    "sensitivity": "public",
    "source_type": "public-dataset",
    "modality": "tabular",
    "tdm_opt_out": False,
    "collection_period": {"start": "2020-01-01", "end": "2020-12-31"},
}


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole session (Ray takes seconds to start on 2 cores)."""
    import ray

    from govray.runtime import ensure_ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ensure_ray()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def authority_key() -> SigningKey:
    return SigningKey.generate(KeyRole.POLICY_AUTHORITY)


@pytest.fixture(scope="session")
def trust(authority_key: SigningKey) -> TrustConfig:
    return TrustConfig(keys=[authority_key.public_key])


@pytest.fixture
def trust_file(tmp_path: Path, trust: TrustConfig) -> Path:
    path = tmp_path / "trust.yaml"
    save_trust(trust, path)
    return path


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


@pytest.fixture
def example_copy(tmp_path: Path) -> Path:
    """A copy of the digits example (data, policy, trust) whose storage lies in ``tmp_path``."""
    root = tmp_path / "example"
    shutil.copytree(REPO / "jobs" / "examples" / "digits" / "data", root / "data")
    shutil.copytree(REPO / "policies", root / "policies")
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["policy"] = {"file": "policies/digits.policy.yaml", "trust": "policies/trust.yaml"}
    raw["storage_path"] = "storage"
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path
