"""`govray keys`: keys of both roles in a trust file, rotation that keeps old signatures valid until
the old key is revoked, and revocation that refuses every signature the key made."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from govray.cli import main
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig, load_trust, trust_root, trust_root_sha256
from tests.helpers.builders import REPO


def keyid_in(output: str) -> str:
    found = re.search(r"key ([0-9a-f]{64})", output)
    assert found, output
    return found.group(1)


def test_rotation_and_revocation_of_the_policy_authority(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trust = tmp_path / "trust.yaml"
    policy = Path(shutil.copy(REPO / "policies" / "digits.policy.yaml", tmp_path / "policy.yaml"))
    assert (
        main(
            [
                "keys",
                "generate",
                "--role",
                "policy-authority",
                "--out",
                str(tmp_path / "old"),
                "--trust",
                str(trust),
            ]
        )
        == 0
    )
    old = keyid_in(capsys.readouterr().out)
    assert (
        main(
            [
                "keys",
                "generate",
                "--role",
                "platform",
                "--out",
                str(tmp_path / "platform"),
                "--trust",
                str(trust),
            ]
        )
        == 0
    )
    platform = keyid_in(capsys.readouterr().out)
    assert main(["policy", "sign", str(policy), "--key", str(tmp_path / "old.key")]) == 0
    assert main(["policy", "verify", str(policy), "--trust", str(trust)]) == 0

    # Rotating without revoking: the old signature still verifies, the new key is trusted too.
    capsys.readouterr()
    assert (
        main(
            [
                "keys",
                "rotate",
                "--role",
                "policy-authority",
                "--out",
                str(tmp_path / "new"),
                "--trust",
                str(trust),
            ]
        )
        == 0
    )
    new = keyid_in(capsys.readouterr().out)
    assert main(["policy", "verify", str(policy), "--trust", str(trust)]) == 0
    assert {key.keyid for key in load_trust(trust).keys} == {old, new, platform}, (old, new, platform)

    # Revoking the old key refuses its signature, whenever it was made; the new key signs again.
    assert main(["keys", "revoke", old, "--trust", str(trust), "--reason", "laptop stolen"]) == 0
    capsys.readouterr()
    assert main(["policy", "verify", str(policy), "--trust", str(trust)]) == SignatureError.exit_code
    assert f"key {old} was revoked" in capsys.readouterr().err
    assert main(["policy", "sign", str(policy), "--key", str(tmp_path / "new.key")]) == 0
    assert main(["policy", "verify", str(policy), "--trust", str(trust)]) == 0

    capsys.readouterr()
    assert main(["keys", "list", "--trust", str(trust)]) == 0
    listing = capsys.readouterr().out
    assert "laptop stolen" in listing and listing.count("trusted") == 2


def test_rotation_revokes_only_keys_of_its_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trust = tmp_path / "trust.yaml"
    assert (
        main(["keys", "generate", "--role", "platform", "--out", str(tmp_path / "p"), "--trust", str(trust)])
        == 0
    )
    platform = keyid_in(capsys.readouterr().out)
    command = [
        "keys",
        "rotate",
        "--role",
        "policy-authority",
        "--out",
        str(tmp_path / "a"),
        "--trust",
        str(trust),
    ]
    assert main([*command, "--revoke-old", platform]) == SignatureError.exit_code
    assert f"key {platform} is a platform key, not policy-authority" in capsys.readouterr().err
    assert [key.role for key in load_trust(trust).keys] == [KeyRole.PLATFORM]  # nothing changed
    assert not (tmp_path / "a.key").exists()
    assert (
        main(["keys", "revoke", "0" * 64, "--trust", str(trust), "--reason", "x"]) == SignatureError.exit_code
    )
    assert "is not in the trust file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("role", "remedy"),
    [
        (KeyRole.PLATFORM, "run `govray keys trust-platform --trust TRUST_FILE` there"),
        (KeyRole.POLICY_AUTHORITY, "`govray keys list --trust TRUST_FILE` lists them"),
    ],
)
def test_a_refusal_by_an_untrusted_key_says_how_to_trust_one(role: KeyRole, remedy: str) -> None:
    with pytest.raises(SignatureError) as refused:
        TrustConfig().trusted_key("ab" * 32, role)
    assert str(refused.value).startswith(f"key {'ab' * 32} is not trusted for role '{role.value}' (")
    assert str(refused.value).endswith(f"{remedy})")


def test_the_trust_root_is_the_keys_revocations_and_authorities_not_when_a_key_was_added(
    tmp_path: Path,
) -> None:
    """What an attestation cites: the same root whenever its keys were loaded and in whatever
    order listed; another key or a revocation is another root; the exported bytes are a trust file."""
    platform, authority = (SigningKey.generate(role) for role in (KeyRole.PLATFORM, KeyRole.POLICY_AUTHORITY))
    first = TrustConfig(keys=[platform.public_key, authority.public_key])
    reloaded = [
        key.model_copy(update={"added_at": None}) for key in (authority.public_key, platform.public_key)
    ]
    assert trust_root(TrustConfig(keys=reloaded)) == trust_root(first)
    revoked = first.model_copy(deep=True)
    revoked.revoke(authority.keyid, reason="leaked")
    widened = first.model_copy(deep=True)
    widened.add(SigningKey.generate(KeyRole.PLATFORM).public_key)
    assert len({trust_root_sha256(trust) for trust in (first, revoked, widened)}) == 3
    exported = tmp_path / "root.json"
    exported.write_bytes(trust_root(revoked))
    assert trust_root(load_trust(exported)) == exported.read_bytes()
