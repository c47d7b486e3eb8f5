"""Who vouches for a policy is the operator's choice, not the engineer's (issue 49, item 2): where
the settings name a trust file, a run's policy is checked against the policy authorities it lists
— an experiment naming its own ``policy.trust`` is refused, and a policy the engineer signed with a
key they minted does not verify — and an unsigned policy runs only for an experiment the settings'
``unsigned_policies`` names, audited as allowed by it. On a development machine (no trust file in
the settings) the experiment's own trust file still stands for the operator's.

Policy checks run in process (the trial's model is built on the meta device): no Ray."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlmodel import select

from govray.cli import main
from govray.config.experiment import ExperimentConfig, load_experiment
from govray.core.canonical import file_sha256
from govray.core.errors import ConfigError, SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig, save_trust
from govray.platform.run.preflight import check_policy
from govray.tracking.audit import AuditEventType
from govray.tracking.store import TrackingStore
from govray.tracking.tables import AuditEvent
from tests.helpers.builders import write_signed_policy


def experiment(path: Path, **policy: Any) -> ExperimentConfig:
    """The example copy at ``path`` with its experiment file's ``policy`` section replaced."""
    raw = yaml.safe_load(path.read_text())
    raw["policy"] = policy
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_experiment(path)


def audited(store: TrackingStore, kind: AuditEventType) -> list[dict[str, Any]]:
    with store.session() as session:
        events = session.exec(select(AuditEvent).where(AuditEvent.event_type == kind.value)).all()
    return [json.loads(event.payload_json) for event in events]


@pytest.fixture
def operator_trust_file(example_copy: Path, operator_settings: Path) -> Path:
    """The operator's trust file — this machine's platform keys and the committed policy
    authority (which signed the example's policy) — named by the settings."""
    path = operator_settings.parent / "operator-trust.yaml"
    committed = example_copy.parent / "policies" / "trust.yaml"
    assert main(["keys", "trust-platform", "--trust", str(path), "--from", str(committed)]) == 0
    operator_settings.write_text(yaml.safe_dump({"trust": str(path)}))
    return path


@pytest.fixture
def engineers_policy(example_copy: Path) -> tuple[Path, Path]:
    """The example's policy widened by the engineer (every rule lets every layer learn), signed by
    a policy authority they minted, and a trust file listing it: ``(policy, trust)``."""
    root = example_copy.parent / "engineer"
    root.mkdir()
    policy = yaml.safe_load((example_copy.parent / "policies" / "digits.policy.yaml").read_text())
    policy["version"] += 1
    minted = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
    trust = root / "trust.yaml"
    save_trust(TrustConfig(keys=[minted.public_key]), trust)
    return write_signed_policy(root, policy, minted, name="digits.policy"), trust


def test_with_an_operator_trust_the_policy_is_checked_against_its_authorities_and_cites_it(
    example_copy: Path, operator_trust_file: Path
) -> None:
    config = experiment(example_copy, file="policies/digits.policy.yaml")  # no policy.trust
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    assert checked.policy_trust_sha256 == file_sha256(operator_trust_file)
    (verified,) = audited(store, AuditEventType.POLICY_VERIFIED)
    assert verified["keyid"] == checked.policy_signer != "unsigned"
    # The same file named by the experiment too is no contradiction.
    same = experiment(example_copy, file="policies/digits.policy.yaml", trust=str(operator_trust_file))
    assert check_policy(same, store, allow_unsigned=False).policy_signer == checked.policy_signer


def test_an_experiment_naming_its_own_trust_file_is_refused_where_the_operator_names_one(
    example_copy: Path, operator_trust_file: Path, engineers_policy: tuple[Path, Path]
) -> None:
    policy, trust = engineers_policy
    config = experiment(example_copy, file=str(policy), trust=str(trust))
    store = TrackingStore.open(config.database_url)
    with pytest.raises(ConfigError, match=r"policy\.trust .*only the policy authorities it lists vouch"):
        check_policy(config, store, allow_unsigned=False)
    # Without policy.trust the engineer's own authority is checked against the operator's: refused.
    config = experiment(example_copy, file=str(policy))
    with pytest.raises(SignatureError, match="is not trusted for role 'policy-authority'"):
        check_policy(config, store, allow_unsigned=False)
    assert len(audited(store, AuditEventType.RUN_REFUSED)) == 2
    assert audited(store, AuditEventType.POLICY_VERIFIED) == []


def test_on_a_development_machine_the_experiments_trust_file_vouches(
    example_copy: Path, engineers_policy: tuple[Path, Path]
) -> None:
    """No settings file: the engineer is their own operator, and the signer they chose is what
    the provenance will name (a registry under an operator's trust then refuses it)."""
    policy, trust = engineers_policy
    config = experiment(example_copy, file=str(policy), trust=str(trust))
    checked = check_policy(config, TrackingStore.open(config.database_url), allow_unsigned=False)
    assert checked.policy_trust_sha256 == file_sha256(trust)


def test_an_unsigned_policy_runs_only_for_an_experiment_the_operator_allows_and_says_who_allowed_it(
    example_copy: Path, operator_trust_file: Path, operator_settings: Path
) -> None:
    config = experiment(example_copy, file="policies/digits.policy.yaml", signature="nowhere.sig")
    store = TrackingStore.open(config.database_url)
    with pytest.raises(SignatureError, match=f"experiment '{config.name}' asks to run an unsigned policy"):
        check_policy(config, store, allow_unsigned=True)
    asked_in_file = experiment(
        example_copy, file="policies/digits.policy.yaml", signature="nowhere.sig", allow_unsigned=True
    )
    with pytest.raises(SignatureError, match="unsigned_policies"):
        check_policy(asked_in_file, store, allow_unsigned=False)
    assert audited(store, AuditEventType.POLICY_UNSIGNED_ALLOWED) == []
    settings = {"trust": str(operator_trust_file), "unsigned_policies": [config.name]}
    operator_settings.write_text(yaml.safe_dump(settings))
    with pytest.raises(SignatureError, match="is unsigned"):  # allowed, but nobody asked
        check_policy(config, store, allow_unsigned=False)
    assert check_policy(config, store, allow_unsigned=True).policy_signer == "unsigned"
    (allowed,) = audited(store, AuditEventType.POLICY_UNSIGNED_ALLOWED)
    assert allowed["allowed_by"] == "unsigned_policies"
    assert allowed["experiment"] == config.name
