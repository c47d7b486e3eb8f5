"""The signer's keys in a PKCS#11 token (SoftHSM2, issue 49): made there by ``govray signer
init --backend pkcs11``, used there by ``govray signer serve``, never read out.

End to end: a 2-worker governed run on its own Ray node seals every checkpoint through that
signer; ``govray attest --model-signing`` has the signer attest the final checkpoint and sign
it for OpenSSF ``model_signing``; ``govray verify`` and the ``model_signing`` CLI (no govray in
it) accept both under the token's public keys. The token says its keys are sensitive and not
extractable and refuses to give their value; no file the signer wrote holds a private key. A wrong
PIN, and a token whose key was swapped after init, are refused before the signer serves.

SoftHSM2 comes from Debian (``tests/cluster/install_softhsm.sh``, run when it is missing); each
test makes its own token directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from govray.core.keys import PublicKey, TrustConfig, load_trust, save_trust
from govray.train.checkpoints.files import find_checkpoints, verify_checkpoint
from tests.helpers.builders import REPO
from tests.helpers.local_ray import LocalRayCluster

pytestmark = pytest.mark.cluster
pkcs11 = pytest.importorskip("pkcs11", reason="python-pkcs11 is in the dev extra")

MODULE = Path("/usr/lib/softhsm/libsofthsm2.so")
INSTALLER = Path(__file__).parent / "install_softhsm.sh"
PIN, SO_PIN, TOKEN = "4711-user", "0815-officer", "govray-test"


@dataclass(frozen=True)
class Token:
    """A SoftHSM2 token in its own directory: ``env`` points the library at it."""

    root: Path
    env: dict[str, str]
    pin_file: Path

    def init_signer(self, directory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return _govray(
            self.env,
            "signer",
            "init",
            "--dir",
            str(directory),
            "--backend",
            "pkcs11",
            "--option",
            f"module={MODULE}",
            "--option",
            f"token={TOKEN}",
            "--passphrase-file",
            str(self.pin_file),
            *extra,
        )


def _govray(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "govray", *args]
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture
def token() -> Iterator[Token]:
    if not MODULE.exists():
        subprocess.run(["bash", str(INSTALLER)], check=True, timeout=600)
    root = Path(tempfile.mkdtemp(prefix="gh-", dir="/tmp"))
    (root / "tokens").mkdir()
    config = root / "softhsm2.conf"
    config.write_text(f"directories.tokendir = {root / 'tokens'}\nobjectstore.backend = file\n")
    env = {**_clean_environment(), "SOFTHSM2_CONF": str(config)}
    subprocess.run(
        ["softhsm2-util", "--init-token", "--free", "--label", TOKEN, "--pin", PIN, "--so-pin", SO_PIN],
        env=env,
        check=True,
        capture_output=True,
    )
    pin_file = root / "pin"
    pin_file.write_text(PIN + "\n")
    pin_file.chmod(0o600)
    yield Token(root, env, pin_file)
    shutil.rmtree(root, ignore_errors=True)


def _clean_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}


def _serving(token: Token, directory: Path) -> subprocess.Popen[bytes]:
    socket = directory / "signer.sock"
    log = open(directory / "serve.log", "wb")  # noqa: SIM115 (the process holds it; closed with it)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "govray",
            "signer",
            "serve",
            "--dir",
            str(directory),
            "--socket",
            str(socket),
            "--passphrase-file",
            str(token.pin_file),
        ],
        env=token.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=directory,
    )
    log.close()
    for _ in range(300):
        if socket.exists() or process.poll() is not None:
            break
        time.sleep(0.1)
    assert socket.exists(), (directory / "serve.log").read_text()
    return process


def _public(directory: Path, name: str) -> PublicKey:
    import yaml

    return PublicKey.model_validate(yaml.safe_load((directory / f"{name}.pub").read_text()))


def test_a_run_sealed_attested_and_model_signed_through_a_pkcs11_token_verifies_and_the_key_stays_there(
    token: Token, monkeypatch: pytest.MonkeyPatch
) -> None:
    signer_dir = token.root / "signer"
    made = token.init_signer(signer_dir)
    assert made.returncode == 0, made.stderr
    assert not [path for path in signer_dir.iterdir() if path.suffix == ".key"]  # only public halves
    platform, model = _public(signer_dir, "platform"), _public(signer_dir, "platform-ecdsa")
    assert platform.keyid in made.stdout and model.keyid in made.stdout
    server = _serving(token, signer_dir)
    socket = signer_dir / "signer.sock"
    root = Path(tempfile.mkdtemp(prefix="gh-run-", dir="/tmp"))
    cluster = LocalRayCluster()
    try:
        from jobs.examples.digits.golden import GOLDEN_HPARAMS, golden_example

        example = golden_example(
            root,
            workers=2,
            max_length={"batches": 4},
            hparams=GOLDEN_HPARAMS,
            lr_schedule=False,
            checkpoint={"period": 2, "save_trial_latest": 10},
            policy={"file": "policies/digits.policy.yaml"},  # vouched for by the operator's trust
        )
        trust = root / "operator-trust.yaml"
        authorities = load_trust(root / "policies" / "trust.yaml")
        save_trust(TrustConfig(keys=[*authorities.keys, platform, model]), trust)
        cluster.start_head(num_cpus=2, env={"GOVRAY_SIGNER_SOCKET": str(socket)})
        cluster.wait_for_nodes(1)
        driver = {"GOVRAY_SIGNER_SOCKET": str(socket), "GOVRAY_TRUST": str(trust)}
        run = cluster.govray("run", str(example), env=driver)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        cluster.stop()
    operator = TrustConfig(keys=[platform, model])
    checkpoints = find_checkpoints(next((root / "storage" / "ray").iterdir()))
    assert len(checkpoints) == 2
    for folder in checkpoints:  # sealed with the token's Ed25519 key
        assert verify_checkpoint(folder, operator)[1] == platform.keyid
    final = checkpoints[-1]
    database = f"sqlite:///{root / 'storage' / 'govray.db'}"
    env = {**token.env, **driver}
    attested = _govray(env, "attest", str(final), "--model-signing", "--database", database)
    assert attested.returncode == 0, attested.stdout + attested.stderr
    envelopes = sorted((root / "storage" / "attestations").rglob("*.dsse.json"))
    signatures = sorted((root / "storage" / "attestations").rglob("*.model-signing.sig"))
    assert envelopes and len(signatures) == 1, attested.stdout
    for envelope in envelopes:
        verified = _govray(
            token.env, "verify", str(envelope), "--model-dir", str(final), "--trust", str(trust)
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert platform.keyid in verified.stdout
    checked = subprocess.run(
        [
            str(Path(sys.executable).parent / "model_signing"),
            "verify",
            "key",
            "--signature",
            str(signatures[0]),
            "--public_key",
            str(signer_dir / "platform-ecdsa.pub.pem"),
            str(final),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    server.terminate()
    server.wait(timeout=30)
    monkeypatch.setenv("SOFTHSM2_CONF", token.env["SOFTHSM2_CONF"])  # (read when the library loads)
    _the_keys_never_left_the_token(signer_dir)
    shutil.rmtree(root, ignore_errors=True)


def _the_keys_never_left_the_token(signer_dir: Path) -> None:
    library = pkcs11.lib(str(MODULE))
    library.reinitialize()
    with library.get_token(token_label=TOKEN).open(user_pin=PIN) as session:
        private = list(session.get_objects({pkcs11.Attribute.CLASS: pkcs11.ObjectClass.PRIVATE_KEY}))
        assert {key.label for key in private} == {"govray-platform", "govray-platform-ecdsa"}
        for key in private:
            assert key[pkcs11.Attribute.SENSITIVE] and not key[pkcs11.Attribute.EXTRACTABLE]
            assert key[pkcs11.Attribute.NEVER_EXTRACTABLE] and key[pkcs11.Attribute.LOCAL]
            with pytest.raises(pkcs11.exceptions.AttributeSensitive):
                key[pkcs11.Attribute.VALUE]
    for path in signer_dir.rglob("*"):
        if path.is_file():
            assert b"PRIVATE KEY" not in path.read_bytes(), path


def test_a_wrong_pin_and_a_token_key_swapped_under_the_signer_are_refused_before_it_serves(
    token: Token,
) -> None:
    signer_dir = token.root / "signer"
    assert token.init_signer(signer_dir).returncode == 0
    again = token.init_signer(signer_dir)
    assert again.returncode != 0 and "made already" in again.stderr
    wrong = token.root / "wrong-pin"
    wrong.write_text("0000\n")
    serve = ["signer", "serve", "--dir", str(signer_dir), "--socket", str(token.root / "s.sock")]
    refused = _govray(token.env, *serve, "--passphrase-file", str(wrong))
    assert refused.returncode != 0 and "PinIncorrect" in refused.stderr, refused.stderr
    # Another signer directory made a second pair under another label in the same token; this
    # signer's backend file now names that label: its keys are not the ones init made here.
    other = token.root / "other"
    assert token.init_signer(other, "--option", "label=another").returncode == 0
    backend = signer_dir / "backend.yaml"
    backend.write_text(backend.read_text().replace(f"token: {TOKEN}", f"token: {TOKEN}\n  label: another"))
    swapped = _govray(token.env, *serve, "--passphrase-file", str(token.pin_file))
    assert swapped.returncode != 0 and "swapped" in swapped.stderr, swapped.stderr
    assert not (token.root / "s.sock").exists()
