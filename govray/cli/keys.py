"""``govray keys init | list | generate | rotate | revoke | trust-tsa | export-root``: this machine's
platform keys (created once, explicitly), the signing roles' keys in a trust file, the
time-stamping authorities whose timestamps give signatures their trusted time, and the operator's
public trust root that attestations cite.

Roles: ``policy-authority`` signs depth policies; ``platform`` signs checkpoints and attestations
(Ed25519) and OpenSSF model signatures (ECDSA P-256, ``--keytype ecdsa``).
Rotation adds a new key to the trust file (so signatures by the old key still verify) and, with
``--revoke-old``, revokes the old one at once. A revocation has a moment (``--at``: when the key
was compromised, default now): a signature whose RFC 3161 timestamp (from an authority the trust
file lists: ``trust-tsa``) is earlier stays valid, every other signature by the key is refused.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import typer

from govray.cli.common import console, table
from govray.cli.policy import KeyTypeOption, keygen
from govray.core.errors import SignatureError
from govray.core.key_creation import init_platform_keys
from govray.core.keys import (
    KeyRole,
    KeyType,
    SigningKey,
    TrustConfig,
    load_trust,
    platform_key_path,
    platform_public_key,
    save_trust,
)

app = typer.Typer(help="Signing keys of the two roles, rotation and revocation.", no_args_is_help=True)
app.command("generate")(keygen)
TrustFile = typer.Option(..., "--trust", help="The trust file (YAML) to read and update.")


@app.command("init")
def init(
    exist_ok: bool = typer.Option(
        False, "--exist-ok", help="Keys there already are no error: print their key ids (for scripts)."
    ),
) -> None:
    """Create this machine's platform keys under GOVRAY_HOME/keys (Ed25519 for checkpoints and
    attestations, ECDSA for model signatures), once, recorded in GOVRAY_HOME/keys/audit.jsonl:
    what the development signer signs with. Nothing creates them silently."""
    held = [key for keytype in KeyType if (key := platform_public_key(keytype=keytype)) is not None]
    if exist_ok and len(held) == len(KeyType):
        for key in held:
            console.print(f"platform {key.keytype.value} key [bold]{key.keyid}[/] exists", highlight=False)
        return
    for created in init_platform_keys():
        path = platform_key_path(keytype=created.public_key.keytype)
        console.print(
            f"platform {created.public_key.keytype.value} key [bold]{created.keyid}[/] created: {path}",
            highlight=False,
        )


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
        key = platform_public_key(keytype=keytype)
        if key is None:
            raise SignatureError(
                f"no platform {keytype.value} key on this machine ({platform_key_path(keytype=keytype)}): "
                "`govray keys init` creates them"
            )
        config.add(key)
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
    at: str | None = typer.Option(
        None, "--at", help="When the key was compromised (ISO 8601; UTC without a zone; default now)."
    ),
) -> None:
    """Revoke a key as of a moment: its signatures stamped (RFC 3161) before it stay valid, every
    other one it made is refused."""
    moment = None
    if at is not None:
        try:
            parsed = datetime.fromisoformat(at)
        except ValueError:
            raise typer.BadParameter(f"{at!r} is not an ISO 8601 moment", param_hint="--at") from None
        moment = parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)
    config = load_trust(trust)
    config.revoke(keyid, reason=reason, at=moment)
    save_trust(config, trust)
    console.print(f"revoked {keyid} in {trust} ({reason})")


@app.command("trust-tsa")
def trust_tsa(
    certificate: Path = typer.Argument(..., help="The authority's root certificate (PEM)."),
    trust: Path = TrustFile,
) -> None:
    """Trust an RFC 3161 time-stamping authority's root certificate: its timestamps give the
    signatures they stamp a trusted time (what a revocation's moment is compared with)."""
    from cryptography import x509

    pem = certificate.read_text()
    try:
        loaded = x509.load_pem_x509_certificate(pem.encode())
    except ValueError as error:
        raise SignatureError(f"{certificate}: not a PEM certificate: {error}") from None
    config = load_trust(trust)
    if pem not in config.timestamp_authorities:
        config.timestamp_authorities.append(pem)
    save_trust(config, trust)
    console.print(f"trusted time-stamping authority {loaded.subject.rfc4514_string()} in {trust}")


@app.command("export-root")
def export_root(
    out: Path | None = typer.Option(None, "--out", help="Write the root here (default: standard output)."),
) -> None:
    """Write the operator's public trust root: the platform keys, revocations and time-stamping
    authorities every checkpoint and attestation here is verified against (this machine's platform
    key and the settings' ``trust`` file), as canonical JSON. Attestations cite its sha256
    (``internalParameters.trust_root``); hand the file to whoever verifies them (``govray verify
    --trust FILE`` says whether it is the root an attestation was made under)."""
    from govray.core.canonical import sha256_hex
    from govray.core.keys import trust_root
    from govray.core.settings import operator_trust

    root = trust_root(operator_trust())
    if out is None:
        typer.echo(root.decode())
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(root)
    console.print(f"wrote the operator's trust root to {out}: sha256 {sha256_hex(root)}", highlight=False)


def _require_role(config: TrustConfig, keyid: str, role: KeyRole) -> None:
    for key in config.keys:
        if key.keyid == keyid:
            if key.role != role:
                raise SignatureError(f"key {keyid} is a {key.role.value} key, not {role.value}")
            return
    raise SignatureError(f"key {keyid} is not in the trust file")
