"""``govray keys list | generate | rotate | revoke``: the two signing roles' keys in a trust file.

Roles: ``policy-authority`` signs depth policies; ``platform`` signs checkpoints and attestations
(Ed25519) and OpenSSF model signatures (ECDSA P-256, ``--keytype ecdsa``).
Rotation adds a new key to the trust file (so signatures by the old key still verify) and, with
``--revoke-old``, revokes the old one at once: every signature by a revoked key is refused from
then on, whenever it was made.
"""

from __future__ import annotations

from pathlib import Path

import typer

from govray.cli.common import console, table
from govray.cli.policy import KeyTypeOption, keygen
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, KeyType, SigningKey, TrustConfig, load_trust, platform_key, save_trust

app = typer.Typer(help="Signing keys of the two roles, rotation and revocation.", no_args_is_help=True)
app.command("generate")(keygen)
TrustFile = typer.Option(..., "--trust", help="The trust file (YAML) to read and update.")


@app.command("list")
def list_keys(trust: Path = TrustFile) -> None:
    """Every key in the trust file: role, type, key id, when it was added, and revocation."""
    config = load_trust(trust)
    revoked = {entry.keyid: entry for entry in config.revoked}
    listing = table("role", "type", "key id", "added", "status")
    for key in config.keys:
        entry = revoked.get(key.keyid)
        status = (
            "trusted" if entry is None else f"revoked {entry.revoked_at.isoformat()} {entry.reason}".strip()
        )
        added = key.added_at.isoformat() if key.added_at else "-"
        listing.add_row(key.role.value, key.keytype.value, key.keyid, added, status)
    console.print(listing)


@app.command("rotate")
def rotate(
    out: Path = typer.Option(..., "--out", help="Path prefix of the new key: PREFIX.key and PREFIX.pub."),
    role: KeyRole = typer.Option(..., "--role", help="The role whose key rotates."),
    trust: Path = TrustFile,
    revoke_old: list[str] = typer.Option(
        [], "--revoke-old", help="Key id(s) of the same role to revoke now."
    ),
    reason: str = typer.Option("rotated", "--reason", help="Why the old keys are revoked."),
    keytype: KeyType = KeyTypeOption,
) -> None:
    """Generate a new key for ``role``, trust it, and optionally revoke old keys of that role."""
    config = load_trust(trust) if trust.exists() else TrustConfig()
    for keyid in revoke_old:
        _require_role(config, keyid, role)
    key = SigningKey.generate(role, keytype)
    private, public = key.save(out)
    config.add(key.public_key)
    for keyid in revoke_old:
        config.revoke(keyid, reason=reason)
    save_trust(config, trust)
    console.print(
        f"{role.value} key [bold]{key.keyid}[/] trusted in {trust}\n  private: {private}\n  public:  {public}"
    )
    for keyid in revoke_old:
        console.print(f"  revoked {keyid} ({reason})")


@app.command("trust-platform")
def trust_platform(
    trust: Path = typer.Option(..., "--trust", help="The trust file to add the key to (created if missing)."),
    base: Path | None = typer.Option(
        None, "--from", help="Start a new trust file from this one (e.g. policies/trust.yaml)."
    ),
) -> None:
    """Trust this machine's platform keys (``$GOVRAY_HOME/keys/platform.key``, which signs its
    checkpoints and attestations, and ``platform-ecdsa.key``, which signs its OpenSSF model
    signatures), so ``govray verify`` and ``govray serve --trust`` accept them."""
    source = trust if trust.exists() else base
    config = load_trust(source) if source is not None else TrustConfig()
    for keytype in KeyType:
        key = platform_key(keytype=keytype)
        config.add(key.public_key)
        console.print(f"platform {keytype.value} key [bold]{key.keyid}[/] trusted in {trust}")
    save_trust(config, trust)


@app.command("pem")
def pem(keyid: str = typer.Argument(..., help="Key id of an ecdsa key."), trust: Path = TrustFile) -> None:
    """Print an ecdsa key of the trust file as PEM: what ``model_signing verify key --public_key``
    reads."""
    for key in load_trust(trust).keys:
        if key.keyid == keyid:
            if key.keytype != KeyType.ECDSA:
                raise SignatureError(f"key {keyid} is {key.keytype.value}; model_signing reads ecdsa keys")
            typer.echo(key.public, nl=False)
            return
    raise SignatureError(f"key {keyid} is not in the trust file")


@app.command("revoke")
def revoke(
    keyid: str = typer.Argument(..., help="Key id to revoke."),
    trust: Path = TrustFile,
    reason: str = typer.Option(..., "--reason", help="Why (kept in the trust file)."),
) -> None:
    """Revoke a key: every signature it made is refused from now on."""
    config = load_trust(trust)
    config.revoke(keyid, reason=reason)
    save_trust(config, trust)
    console.print(f"revoked {keyid} in {trust} ({reason})")


def _require_role(config: TrustConfig, keyid: str, role: KeyRole) -> None:
    for key in config.keys:
        if key.keyid == keyid:
            if key.role != role:
                raise SignatureError(f"key {keyid} is a {key.role.value} key, not {role.value}")
            return
    raise SignatureError(f"key {keyid} is not in the trust file")
