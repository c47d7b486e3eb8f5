"""Signed experiments of small corpora the ingest tests build, and their verified policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from govray.config.experiment import load_experiment
from govray.core.keys import SigningKey, load_trust
from govray.governance.policy import VerifiedPolicy, load_verified_policy
from tests.helpers.builders import BASE_CREDENTIAL, write_experiment, write_signed_policy

POLICY: dict[str, Any] = {
    "name": "ingest-test",
    "version": 1,
    "adapters": {"pii-lora": {"targets": ["hidden"]}},
    "rules": [
        {"name": "public", "match": {"license_class": "public-domain"}, "route": "all"},
        {"name": "licensed", "match": {"license_class": "licensed"}, "route": {"depth": {"min": -1}}},
        {"name": "pii", "match": {"sensitivity": "pii"}, "route": {"adapter": "pii-lora"}},
    ],
}
LICENSES = ["public-domain", "licensed", "proprietary"]


def corpus_spec(corpus_id: str, path: str, **extra: Any) -> dict[str, Any]:
    return {"id": corpus_id, "path": path, "credential": dict(BASE_CREDENTIAL), **extra}


def build(
    tmp_path: Path, key: SigningKey, trust_file: Path, corpora: list[dict[str, Any]], **overrides: Any
) -> Path:
    write_signed_policy(tmp_path, POLICY, key)
    return write_experiment(tmp_path, data={"holdout_fraction": 0.25, "corpora": corpora}, **overrides)


def verified(config_path: Path) -> tuple[Any, VerifiedPolicy]:
    config = load_experiment(config_path)
    assert config.policy.trust is not None
    return config, load_verified_policy(
        config.policy.file, config.policy.signature_path, load_trust(config.policy.trust)
    )
