"""The command line: the example's policy workflow and ingest, with meaningful exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from govray.cli import main
from tests.helpers.builders import REPO


def test_keygen_sign_verify_and_a_tampered_policy_exits_5(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    shutil.copy(REPO / "policies" / "digits.policy.yaml", policy)
    trust = tmp_path / "trust.yaml"
    assert main(["policy", "keygen", "--out", str(tmp_path / "authority"), "--trust", str(trust)]) == 0
    assert main(["policy", "sign", str(policy), "--key", str(tmp_path / "authority.key")]) == 0
    assert main(["policy", "verify", str(policy), "--trust", str(trust)]) == 0
    assert "OK policy 'digits' v1" in capsys.readouterr().out
    policy.write_text(policy.read_text().replace("min: -2", "min: 0"))
    assert main(["policy", "verify", str(policy), "--trust", str(trust)]) == 5
    assert "does not match its signature" in capsys.readouterr().err
    (tmp_path / "policy.yaml.sig").unlink()
    assert main(["policy", "verify", str(policy), "--trust", str(trust)]) == 5
    assert "policy.yaml.sig" in capsys.readouterr().err


def test_committed_example_policy_verifies_against_the_committed_trust_file() -> None:
    policies = REPO / "policies"
    assert (
        main(
            [
                "policy",
                "verify",
                str(policies / "digits.policy.yaml"),
                "--trust",
                str(policies / "trust.yaml"),
            ]
        )
        == 0
    )


@pytest.mark.usefixtures("ray_session")
def test_example_check_ingest_and_list(example_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(example_copy)]) == 0
    checked = capsys.readouterr().out
    assert "licensed" in checked and "hidden.weight, hidden.bias, head.weight, head.bias" in checked
    assert main(["data", "ingest", str(example_copy)]) == 0
    out = capsys.readouterr().out
    assert "wrote shards" in out
    for corpus, rows in [("digits-public", 900), ("digits-licensed", 500), ("digits-writers", 397)]:
        assert corpus in out and f" {rows} " in out
    manifest = json.loads(
        next((example_copy.parent / "storage" / "shards").glob("*/manifest.json")).read_text()
    )
    assert {route["route"]: route["corpus_counts"] for route in manifest["routes"]} == {
        "public": {"digits-public": manifest["corpora"][0]["train_rows"]},
        "licensed": {"digits-licensed": manifest["corpora"][1]["train_rows"]},
        "pii": {"digits-writers": manifest["corpora"][2]["train_rows"]},
    }
    assert main(["experiments", "list", "--config", str(example_copy)]) == 0
    assert "digits-governed" in capsys.readouterr().out


def test_unsigned_policy_needs_the_flag_and_is_audited(
    example_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (example_copy.parent / "policies" / "digits.policy.yaml.sig").unlink()
    assert main(["policy", "check", str(example_copy)]) == 5
    assert "is unsigned" in capsys.readouterr().err
    assert main(["policy", "check", str(example_copy), "--allow-unsigned-policy"]) == 0
    from govray.config.experiment import load_experiment
    from govray.tracking.audit import AuditEventType, AuditLog
    from govray.tracking.store import TrackingStore

    log = AuditLog(TrackingStore.open(load_experiment(example_copy).database_url))
    assert [event.event_type for event in log.list()] == [
        AuditEventType.RUN_REFUSED,
        AuditEventType.POLICY_UNSIGNED_ALLOWED,
    ]


def test_bad_experiment_file_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "e.yaml"
    path.write_text("name: x\ntrial: a.b:C\ndata: {corpora: []}\npolicy: {file: p.yaml}\n")
    assert main(["policy", "check", str(path)]) == 2
    assert "data.corpora should have at least 1 item" in capsys.readouterr().err


def test_python_dash_m_and_the_console_script_are_the_same() -> None:
    module = subprocess.run(
        [sys.executable, "-m", "govray", "--help"], capture_output=True, text=True, check=True
    )
    script = shutil.which("govray")
    assert script is not None, "the govray console script is installed"
    console = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    assert module.stdout.replace("python -m govray", "govray").split() == console.stdout.split()


@pytest.mark.usefixtures("ray_session")
def test_changed_row_warns_and_strict_refuses_naming_the_corpus(
    example_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["data", "ingest", str(example_copy)]) == 0
    capsys.readouterr()
    licensed = example_copy.parent / "data" / "licensed.jsonl"
    lines = licensed.read_text().splitlines()
    lines[3] = lines[3].replace('"label": ', '"label": 1') if '"label": ' in lines[3] else lines[3]
    licensed.write_text("\n".join(lines) + "\n")
    assert main(["data", "ingest", str(example_copy), "--strict"]) == 7
    assert "corpus 'digits-licensed' changed since the previous run" in capsys.readouterr().err
    assert main(["data", "ingest", str(example_copy)]) == 0
    out = capsys.readouterr().out
    assert "warning:" in out and "corpus 'digits-licensed' changed" in out
    assert "digits-public" not in out.split("warning:")[1].splitlines()[0]


def test_policy_check_names_every_credential_no_rule_takes_before_ray_starts(
    example_copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``policy check`` is the whole check: a corpus-level credential and a per-row value set that
    no rule takes are both named (with their rows and the closest rule), exit 4, and Ray is never
    started (``ray.init`` fails this test if called)."""
    import ray

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("policy check started Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    policies = example_copy.parent / "policies"
    (policies / "digits.policy.yaml.sig").unlink()
    policy = policies / "digits.policy.yaml"
    text = policy.read_text()
    text = text.replace("sensitivity: [public, internal, confidential]", "sensitivity: [public, internal]")
    text = text.replace(
        "match: {sensitivity: [pii, special-category]}", "match: {sensitivity: [pii], jurisdiction: [DE, FR]}"
    )
    policy.write_text(text)
    assert main(["policy", "check", str(example_copy), "--allow-unsigned-policy"]) == 4
    said = " ".join(capsys.readouterr().err.split())
    assert "2 credential(s) of the data would be refused by ingest" in said
    assert (
        "corpus 'digits-licensed' matches no rule in policy 'digits' v1; closest rule 'licensed' "
        "(sensitivity: 'confidential' is not one of public, internal)"
    ) in said
    assert (
        "corpus 'digits-writers' (rows with jurisdiction 'NL', sensitivity 'pii': 132 rows) matches no "
        "rule in policy 'digits' v1; closest rule 'pii' (jurisdiction: 'NL' is not one of DE, FR)"
    ) in said
    assert "digits-public" not in said  # (its credential is taken)
    policy.write_text(
        text.replace("jurisdiction: [DE, FR]", "jurisdiction: [DE, FR, NL]").replace(
            "sensitivity: [public, internal]", "sensitivity: [public, internal, confidential]"
        )
    )
    assert main(["policy", "check", str(example_copy), "--allow-unsigned-policy"]) == 0
