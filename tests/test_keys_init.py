"""This machine's platform keys are created once, explicitly (``govray keys init``), and recorded;
nothing creates one on use (a signer, a run, a verification on a machine without them says so), and
verifying reads only the public half."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from govray.cli import main
from govray.core.errors import SignatureError
from govray.core.keys import (
    KeyType,
    platform_key,
    platform_key_path,
    platform_public_key,
)
from govray.core.settings import operator_trust
from govray.signer.local import dev_signer


@pytest.fixture
def fresh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("GOVRAY_HOME", str(home))
    return home


def test_nothing_creates_a_platform_key_on_use(fresh_home: Path) -> None:
    for keytype in KeyType:
        with pytest.raises(SignatureError, match="govray keys init"):
            platform_key(keytype=keytype)
    with pytest.raises(SignatureError, match="no platform key to verify against.*govray keys init"):
        operator_trust()
    # A run's launch finds no signer to start, and says how to make one; a check of the policy
    # verifies no checkpoint and needs none.
    with pytest.raises(SignatureError, match="no signer.*govray keys init"):
        dev_signer()
    assert operator_trust(required=False).keys == []
    assert not (fresh_home / "keys").exists()


def test_keys_init_creates_both_keys_once_and_records_who_did(
    fresh_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keys", "init"]) == 0
    printed = capsys.readouterr().out
    created = dict(re.findall(r"platform (ed25519|ecdsa) key ([0-9a-f]{64}) created", printed))
    assert set(created) == {"ed25519", "ecdsa"}, printed
    for keytype in KeyType:
        private = platform_key_path(keytype=keytype)
        assert oct(private.stat().st_mode & 0o777) == "0o600"
        assert platform_key(keytype=keytype).keyid == created[keytype.value]
    [entry] = [json.loads(line) for line in (fresh_home / "keys" / "audit.jsonl").read_text().splitlines()]
    assert entry["event"] == "platform_keys_created" and entry["uid"] == os.getuid()
    assert entry["keys"] == created and entry["host"]
    # Once: a second init is refused and changes nothing; --exist-ok names the keys there.
    assert main(["keys", "init"]) == SignatureError.exit_code
    assert "exists" in capsys.readouterr().err
    assert main(["keys", "init", "--exist-ok"]) == 0
    assert (
        dict(re.findall(r"platform (ed25519|ecdsa) key ([0-9a-f]{64}) exists", capsys.readouterr().out))
        == created
    )
    assert len((fresh_home / "keys" / "audit.jsonl").read_text().splitlines()) == 1


def test_verifying_reads_the_public_half_only(fresh_home: Path) -> None:
    """With the private key files gone (a verifier's machine, a worker node), the operator's trust
    is still this machine's platform key."""
    assert main(["keys", "init"]) == 0
    keyid = platform_key().keyid
    for keytype in KeyType:
        platform_key_path(keytype=keytype).unlink()
    assert [key.keyid for key in operator_trust().keys] == [keyid]
    public = platform_public_key()
    assert public is not None and public.keyid == keyid
