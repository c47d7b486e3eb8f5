"""The policy and who signed it are in the provenance: a signed run's attestation names the
policy envelope's signer and the trust file it was checked against, and the code snapshot the
workers imported; a run under a policy nobody signed says ``unsigned`` everywhere a reader looks
(``govray verify``, the lineage page, the training-content summary, the BOM), and ``model
register`` refuses it unless the operator allows it for that experiment — then audited."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlmodel import select

from govray.cli import main
from govray.cli.export import to_markdown
from govray.config.serve import ServeSettings
from govray.core.canonical import file_sha256
from govray.core.keys import KeyRole, load_trust
from govray.governance.policy import UNSIGNED_POLICY
from govray.platform.registry.register import register
from govray.platform.registry.versions import RegistryError
from govray.provenance.eu_summary import eu_summary
from govray.tracking.lineage import attestations, checkpoints
from govray.tracking.tables import AuditEvent, ModelVersion
from govray.train.checkpoints.files import find_checkpoints
from govray.train.runspec import RUN_SPEC_FILE, read_run_spec
from jobs.examples.digits.golden import golden_example
from serve.app import create_app
from tests.helpers.attest import statement_of
from tests.helpers.builders import REPO
from tests.helpers.golden import GoldenRun, golden_run_at
from tests.helpers.lineage_server import copy_store


@dataclass(frozen=True)
class Written:
    path: Path  # the provenance envelope, as the store keeps it
    statement: dict[str, Any]  # its statement


def final_provenance(run: GoldenRun, tmp_path: Path) -> Written:
    final = checkpoints(run.store, run.outcome.trial_id)[-1]
    assert final.id is not None
    for index, record in enumerate(attestations(run.store, final.id)):
        path = tmp_path / f"attestation-{index}.dsse.json"
        path.write_text(record.envelope_json)
        statement = statement_of(path)
        if statement["predicateType"] == "https://slsa.dev/provenance/v1":
            return Written(path, statement)
    raise AssertionError("the run's final checkpoint has no provenance attestation")


@pytest.fixture(scope="module")
def unsigned_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> GoldenRun:
    """Four steps of the digits example, one worker, under its policy with no signature (the
    experiment lets it through: audited at preflight)."""
    root = tmp_path_factory.mktemp("unsigned")
    path = golden_example(
        root,
        workers=1,
        max_length={"batches": 4},
        lr_schedule=False,
        name="digits-unsigned",
        policy={
            "file": "policies/digits.policy.yaml",
            "signature": "policies/none.sig",
            "allow_unsigned": True,
        },
    )
    return golden_run_at(path)


def test_a_signed_runs_provenance_names_the_policy_signer_its_trust_root_and_the_code(
    golden_run: GoldenRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = final_provenance(golden_run, tmp_path)
    parameters = written.statement["predicate"]["buildDefinition"]["externalParameters"]
    trust_file = golden_run.config.policy.trust
    authority = [key.keyid for key in load_trust(trust_file).keys if key.role == KeyRole.POLICY_AUTHORITY]
    assert parameters["policy"]["signer"] in authority
    assert parameters["policy"]["trust_root"] == {"sha256": file_sha256(trust_file)}
    spec = read_run_spec(find_checkpoints(golden_run.outcome.run_dir)[-1] / RUN_SPEC_FILE)
    code = spec.reproducibility["code"]
    assert parameters["code"] == {"module": code["module"], "sha256": code["digest"], "files": code["files"]}
    assert parameters["code"]["files"] and all(len(digest) == 64 for digest in code["files"].values())
    final = find_checkpoints(golden_run.outcome.run_dir)[-1]
    trust = tmp_path / "trust.yaml"
    assert main(["keys", "trust-platform", "--trust", str(trust)]) == 0
    assert main(["verify", str(written.path), "--model-dir", str(final), "--trust", str(trust)]) == 0
    said = capsys.readouterr().out
    assert f"signed by {parameters['policy']['signer']}" in said and "UNSIGNED" not in said


def test_an_unsigned_policy_run_says_so_in_verify_the_summary_and_its_attestation(
    unsigned_run: GoldenRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    written = final_provenance(unsigned_run, tmp_path)
    policy = written.statement["predicate"]["buildDefinition"]["externalParameters"]["policy"]
    assert policy["signer"] == UNSIGNED_POLICY
    final = find_checkpoints(unsigned_run.outcome.run_dir)[-1]
    trust = tmp_path / "trust.yaml"
    assert main(["keys", "trust-platform", "--trust", str(trust)]) == 0
    assert main(["verify", str(written.path), "--model-dir", str(final), "--trust", str(trust)]) == 0
    assert "UNSIGNED: nobody vouched for it" in capsys.readouterr().out
    summary = eu_summary(final, model="digits-unsigned", version="0")
    assert summary.general.policy_signer == UNSIGNED_POLICY
    assert "UNSIGNED: nobody vouched for it" in to_markdown(summary)


def test_register_refuses_an_unsigned_policy_run_unless_the_operator_allows_it_then_audits_it(
    unsigned_run: GoldenRun, operator_settings: Path
) -> None:
    store, final = unsigned_run.store, find_checkpoints(unsigned_run.outcome.run_dir)[-1]
    operator_settings.write_text(yaml.safe_dump({"unsigned_policies": ["another-experiment"]}))
    with pytest.raises(RegistryError, match="trained under a policy nobody signed .*unsigned_policies"):
        register(store, "digits-unsigned", final)
    with store.session() as session:
        assert not session.exec(select(ModelVersion)).all()
    operator_settings.write_text(yaml.safe_dump({"unsigned_policies": ["digits-unsigned"]}))
    version = register(store, "digits-unsigned", final)
    with store.session() as session:
        details = [json.loads(event.payload_json) for event in session.exec(select(AuditEvent)).all()]
    (allowed,) = [d for d in details if d.get("action") == "register" and d.get("model") == "digits-unsigned"]
    assert allowed["unsigned_policy_allowed_for"] == "digits-unsigned"
    # The page says so too, where a reviewer looks.
    trust = operator_settings.parent / "serve-trust.yaml"
    assert main(["keys", "trust-platform", "--trust", str(trust)]) == 0
    with TestClient(create_app(ServeSettings(database_url=store.url, trust=trust))) as client:
        page = client.get(f"/lineage/models/digits-unsigned/{version.version}")
    assert page.status_code == 200
    assert 'id="policy-signer" class="failed">UNSIGNED' in page.text


def test_register_refuses_a_policy_whose_signer_the_operators_trust_does_not_list(
    golden_run: GoldenRun, tmp_path: Path, operator_settings: Path
) -> None:
    """The experiment's own trust file vouched for the policy at preflight; when the operator
    names a trust file, its policy authorities decide what may be registered."""
    store = copy_store(golden_run, tmp_path / "storage")
    final = Path(checkpoints(store, golden_run.outcome.trial_id)[-1].path)
    platform_only = tmp_path / "platform-only.yaml"
    assert main(["keys", "trust-platform", "--trust", str(platform_only)]) == 0
    operator_settings.write_text(yaml.safe_dump({"trust": str(platform_only)}))
    with pytest.raises(RegistryError, match="does not list as a policy authority"):
        register(store, "vouched", final)
    with_authority = tmp_path / "with-authority.yaml"
    committed = REPO / "policies" / "trust.yaml"
    assert main(["keys", "trust-platform", "--trust", str(with_authority), "--from", str(committed)]) == 0
    operator_settings.write_text(yaml.safe_dump({"trust": str(with_authority)}))
    assert register(store, "vouched", final).version == 1
