"""OpenSSF model signatures: every registered version's directory is signed so that the
``model_signing`` package (its own CLI and API, not govray's code) verifies it and refuses it after
any byte changes; ``govray verify`` accepts the same signature and refuses it once the platform's
ECDSA key is revoked in the trust file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import model_signing
import pytest
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from securesystemslib.signer import SSlibKey

from govray.cli import main
from govray.core.canonical import file_sha256
from govray.core.keys import KeyRole, KeyType, SigningKey, TrustConfig, platform_key, save_trust
from govray.platform.registry.versions import RegisteredVersion, model_signature_of
from govray.provenance.model_signature import (
    PREDICATE_TYPE,
    ModelSignatureError,
    read_bundle,
    sign_model,
    signed_files,
)
from tests.helpers.golden import RegisteredPair

MODEL_SIGNING = [sys.executable, "-m", "model_signing"]


def public_pem(tmp_path: Path) -> Path:
    path = tmp_path / "platform-ecdsa.pub.pem"
    path.write_text(platform_key(keytype=KeyType.ECDSA).public_key.public)
    return path


def model_signing_cli(signature: Path, public: Path, model_dir: Path) -> subprocess.CompletedProcess[str]:
    """``model_signing verify key --signature SIG --public_key PUB MODEL_DIR``, the package's CLI."""
    arguments = ["verify", "key", "--signature", str(signature), "--public_key", str(public), str(model_dir)]
    return subprocess.run(
        [*MODEL_SIGNING, *arguments],
        capture_output=True,
        text=True,
        timeout=120,
    )


def model_signing_api(signature: Path, public: Path, model_dir: Path) -> None:
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(model_dir, signature)


def test_model_signing_verifies_every_registered_version(
    registered_pair: RegisteredPair, tmp_path: Path
) -> None:
    public = public_pem(tmp_path)
    for version in (registered_pair.version, registered_pair.without_adapter):
        signature = model_signature_of(version)
        done = model_signing_cli(signature, public, version.directory)
        assert done.returncode == 0 and "Verification succeeded" in done.stdout, done.stdout + done.stderr
        statement_files = set(signed_files(read_bundle(signature)))
        on_disk = {str(p.relative_to(version.directory)) for p in version.directory.rglob("*") if p.is_file()}
        assert statement_files == on_disk  # every file of the directory, by digest
    payload = read_bundle(model_signature_of(registered_pair.version))
    assert payload["mediaType"].startswith("application/vnd.dev.sigstore.bundle")
    assert PREDICATE_TYPE == "https://model_signing/signature/v1.0"


def _change_a_byte(directory: Path) -> None:
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))


def _add_a_file(directory: Path) -> None:
    (directory / "notes.txt").write_text("added after signing\n")


def _remove_a_file(directory: Path) -> None:
    (directory / "state.json").unlink()


@pytest.mark.parametrize("tamper", [_change_a_byte, _add_a_file, _remove_a_file])
def test_model_signing_refuses_a_changed_added_or_removed_file(
    registered_pair: RegisteredPair, tmp_path: Path, tamper: Callable[[Path], None]
) -> None:
    version: RegisteredVersion = registered_pair.without_adapter
    public = public_pem(tmp_path)
    copy = Path(shutil.copytree(version.directory, tmp_path / "model"))
    model_signing_api(model_signature_of(version), public, copy)  # an exact copy verifies
    tamper(copy)
    with pytest.raises(ValueError, match="Signature mismatch"):
        model_signing_api(model_signature_of(version), public, copy)
    done = model_signing_cli(model_signature_of(version), public, copy)
    assert done.returncode != 0 and "Verification failed" in done.stderr, done.stdout + done.stderr


def test_govray_verify_accepts_the_signature_and_refuses_it_once_the_key_is_revoked(
    registered_pair: RegisteredPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = registered_pair.version
    signature, trust = model_signature_of(version), tmp_path / "trust.yaml"
    ecdsa = platform_key(keytype=KeyType.ECDSA)
    save_trust(TrustConfig(keys=[platform_key().public_key, ecdsa.public_key]), trust)
    verify = ["verify", str(signature), "--model-dir", str(version.directory), "--trust", str(trust)]
    assert main(verify) == 0
    assert f"model_signing signature by {ecdsa.keyid}" in capsys.readouterr().out

    save_trust(TrustConfig(keys=[platform_key().public_key]), trust)  # the ECDSA key not trusted
    assert main(verify) == 16
    assert "no ecdsa key in the trust file" in capsys.readouterr().err

    assert main(["keys", "trust-platform", "--trust", str(trust)]) == 0
    assert main(["keys", "revoke", ecdsa.keyid, "--trust", str(trust), "--reason", "leaked"]) == 0
    capsys.readouterr()
    assert main(verify) == 16
    assert f"key {ecdsa.keyid} was revoked" in capsys.readouterr().err
    # model_signing itself knows no trust file: only govray's verify reads the revocation.
    assert model_signing_cli(signature, public_pem(tmp_path), version.directory).returncode == 0


def test_the_ecdsa_platform_key_has_the_keyid_securesystemslib_computes(tmp_path: Path) -> None:
    key = SigningKey.generate(KeyRole.PLATFORM, KeyType.ECDSA)
    private, _ = key.save(tmp_path / "platform-ecdsa")
    assert SSlibKey.from_crypto(load_pem_public_key(key.public_key.public.encode())).keyid == key.keyid
    assert SigningKey.load(private).keyid == key.keyid
    assert (tmp_path / "platform-ecdsa.pub.pem").read_text() == key.public_key.public
    signature = key.sign(b"payload")
    assert key.public_key.verify(signature, b"payload") and not key.public_key.verify(signature, b"other")


def test_a_folder_changed_between_its_verification_and_model_signings_hashing_is_not_signed(
    tmp_path: Path,
) -> None:
    """``model_signing`` hashes the folder again after the signer verified it: a file swapped in
    between, one added or one removed makes no model signature (the bundle is checked against
    the files as verified, and nothing is returned)."""
    key = SigningKey.generate(KeyRole.PLATFORM, KeyType.ECDSA)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"verified weights")
    (folder / "manifest.sig").write_text("{}")
    verified: dict[str, str | None] = {"model.safetensors": file_sha256(folder / "model.safetensors")}
    verified["manifest.sig"] = None  # (any bytes)
    signature = tmp_path / "model.sig"
    assert signed_files(read_bundle(sign_model(folder, signature, key, verified))) == (
        "manifest.sig",
        "model.safetensors",
    )
    (folder / "model.safetensors").write_bytes(b"swapped weights")
    with pytest.raises(ModelSignatureError, match=r"changed after it was verified \(model.safetensors\)"):
        sign_model(folder, signature, key, verified)
    assert not signature.exists()
    (folder / "model.safetensors").write_bytes(b"verified weights")
    (folder / "extra.bin").write_bytes(b"added")
    with pytest.raises(ModelSignatureError, match=r"changed after it was verified \(extra.bin\)"):
        sign_model(folder, signature, key, verified)
    (folder / "extra.bin").unlink()
    (folder / "manifest.sig").unlink()
    with pytest.raises(ModelSignatureError, match=r"changed after it was verified \(manifest.sig\)"):
        sign_model(folder, signature, key, verified)
