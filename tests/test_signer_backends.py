"""Where the signer's keys are held (``govray.signer.backends``, issue 49): a key backend chosen
at ``govray signer init``, its creation audited, its keys checked at every unlock against the
public halves init wrote. A plugin (``tests/helpers/kms_plugin.py``, written as a cloud KMS's
would be) is loaded by ``MODULE:CLASS``; its keys sign DSSE envelopes and OpenSSF model
signatures that verify, without a private key ever reaching the signer's process. The PKCS#11
backend is tested end to end against SoftHSM2 in the cluster tier (``tests/cluster/
test_pkcs11_signer.py``), which installs it."""

from __future__ import annotations

import json
from pathlib import Path

import model_signing
import pytest

from govray.cli import main
from govray.core.dsse import sign_envelope, verify_envelope
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, KeyType, SigningKey, TrustConfig
from govray.provenance.model_signature import sign_model, verify_model_signature
from govray.signer.backends import BACKEND_FILE, create_keys, read_backend, unlock_keys
from tests.helpers.kms_plugin import VaultKey

PLUGIN = "tests.helpers.kms_plugin:VaultKms"


def test_a_plugins_keys_sign_envelopes_and_model_signatures_that_verify_and_never_enter_the_signer(
    tmp_path: Path,
) -> None:
    signer_dir, vault = tmp_path / "signer", tmp_path / "vault"
    keys, _ = create_keys(signer_dir, PLUGIN, {"vault": str(vault)}, None)
    assert keys.platform.held and keys.model is not None and keys.model.held
    assert read_backend(signer_dir) == (PLUGIN, {"vault": str(vault)})
    assert sorted(path.name for path in signer_dir.iterdir()) == [
        "audit.jsonl",
        BACKEND_FILE,
        "platform-ecdsa.pub",
        "platform-ecdsa.pub.pem",
        "platform.pub",
    ]  # public halves only: the private ones are the vault's
    [entry] = [json.loads(line) for line in (signer_dir / "audit.jsonl").read_text().splitlines()]
    assert entry["held_in"] == PLUGIN and entry["keys"] == {
        "ed25519": keys.platform.keyid,
        "ecdsa": keys.model.keyid,
    }
    with pytest.raises(SignatureError, match="never written to a file"):
        keys.platform.save(tmp_path / "exported")
    unlocked = unlock_keys(signer_dir, None)
    assert unlocked.model is not None
    trust = TrustConfig(keys=[unlocked.platform.public_key, unlocked.model.public_key])
    before = VaultKey.signed
    envelope = sign_envelope(b'{"step": 4}', "application/vnd.test+json", unlocked.platform)
    payload, keyid = verify_envelope(
        envelope, trust, KeyRole.PLATFORM, expected_type="application/vnd.test+json", what="test"
    )
    assert (payload, keyid) == (b'{"step": 4}', keys.platform.keyid)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "weights.bin").write_bytes(bytes(range(256)) * 64)
    signature = sign_model(model_dir, tmp_path / "model.sig", unlocked.model)
    assert VaultKey.signed == before + 2  # both signatures were the vault's
    assert verify_model_signature(signature, model_dir, trust).signer == keys.model.keyid
    public = tmp_path / "model.pub.pem"
    public.write_text(keys.model.public_key.public)
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(model_dir, signature)
    (model_dir / "weights.bin").write_bytes(b"changed")
    with pytest.raises(ValueError):
        model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(
            model_dir, signature
        )


def test_keys_swapped_under_the_signer_a_wrong_role_and_a_second_init_are_refused(tmp_path: Path) -> None:
    signer_dir, vault = tmp_path / "signer", tmp_path / "vault"
    create_keys(signer_dir, PLUGIN, {"vault": str(vault)}, None)
    with pytest.raises(SignatureError, match="made already"):
        create_keys(signer_dir, PLUGIN, {"vault": str(tmp_path / "vault2")}, None)
    # The vault's key replaced after init (a KMS key re-pointed): not the key init made.
    (vault / "ed25519.key").unlink()
    (vault / "ed25519.pub").unlink()
    SigningKey.generate(KeyRole.PLATFORM).save(vault / "ed25519")
    with pytest.raises(SignatureError, match="swapped under the signer"):
        unlock_keys(signer_dir, None)
    # A backend answering a policy authority's key where the platform's belongs.
    other = tmp_path / "other"
    with pytest.raises(SignatureError, match="where the platform's ed25519 key belongs"):
        create_keys(other, PLUGIN, {"vault": str(tmp_path / "vault3"), "role": "policy-authority"}, None)


def test_the_file_backend_needs_its_passphrase_and_bad_backends_are_named(tmp_path: Path) -> None:
    signer_dir = tmp_path / "signer"
    keys, _ = create_keys(signer_dir, "file", {}, b"correct horse")
    assert not keys.platform.held and (signer_dir / "platform.key").is_file()
    assert not (signer_dir / BACKEND_FILE).read_text().count("correct horse")  # never a secret
    assert unlock_keys(signer_dir, b"correct horse").platform.keyid == keys.platform.keyid
    with pytest.raises(SignatureError, match="needs its secret"):
        unlock_keys(signer_dir, None)
    with pytest.raises(SignatureError, match="passphrase is wrong"):
        unlock_keys(signer_dir, b"wrong")
    with pytest.raises(SignatureError, match="no key backend 'nosuch'"):
        create_keys(tmp_path / "a", "nosuch", {}, None)
    with pytest.raises(SignatureError, match="cannot be loaded"):
        create_keys(tmp_path / "b", "tests.helpers.nosuch:Backend", {}, None)
    with pytest.raises(SignatureError, match="takes no options"):
        create_keys(tmp_path / "c", "file", {"module": "x"}, b"pass")
    (signer_dir / BACKEND_FILE).write_text("backend: [file]\n")
    with pytest.raises(SignatureError, match="a backend file is"):
        unlock_keys(signer_dir, b"correct horse")


def test_signer_init_with_a_plugin_backend_asks_no_secret_and_prints_the_key_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    signer_dir = tmp_path / "signer"
    code = main(
        ["signer", "init", "--dir", str(signer_dir), "--backend", PLUGIN, "--option", f"vault={tmp_path}/v"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    keys = unlock_keys(signer_dir, None)
    assert keys.model is not None and keys.platform.keyid in printed and keys.model.keyid in printed
    assert keys.model.public_key.keytype == KeyType.ECDSA
    assert (
        main(["signer", "init", "--dir", str(tmp_path / "x"), "--backend", PLUGIN, "--option", "vault"]) == 2
    )
