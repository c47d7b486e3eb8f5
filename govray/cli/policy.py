"""``govray policy keygen | sign | verify | check``."""

from __future__ import annotations

from pathlib import Path

import typer

from govray.cli.common import AllowUnsigned, ConfigArgument, console, open_experiment, table
from govray.core.dsse import read_envelope
from govray.core.errors import PolicyError
from govray.core.keys import KeyRole, KeyType, SigningKey, TrustConfig, load_trust, save_trust

app = typer.Typer(help="Manage signed depth policies.", no_args_is_help=True)

KeyTypeOption = typer.Option(
    KeyType.ED25519,
    "--keytype",
    help="ed25519 (policies, manifests, attestations) or ecdsa (P-256: OpenSSF model signatures).",
)


@app.command()
def keygen(
    out: Path = typer.Option(..., "--out", help="Path prefix: writes PREFIX.key and PREFIX.pub."),
    role: KeyRole = typer.Option(KeyRole.POLICY_AUTHORITY, "--role", help="Which role the key signs for."),
    trust: Path | None = typer.Option(None, "--trust", help="Add the public key to this trust file."),
    keytype: KeyType = KeyTypeOption,
) -> None:
    """Generate a key pair for a signing role (Ed25519; ECDSA P-256 for the platform's model signatures)."""
    key = SigningKey.generate(role, keytype)
    private, public = key.save(out)
    console.print(
        f"{role.value} key [bold]{key.keyid}[/]\n  private: {private} (keep secret)\n  public:  {public}"
    )
    if trust is not None:
        config = load_trust(trust) if trust.exists() else TrustConfig()
        config.add(key.public_key)
        save_trust(config, trust)
        console.print(f"  trusted in {trust}")


@app.command()
def sign(
    policy: Path = typer.Argument(..., help="Policy file (YAML)."),
    key: Path = typer.Option(..., "--key", help="The policy authority's private key (.key)."),
    out: Path | None = typer.Option(None, "--out", help="Signature file (default: POLICY.sig)."),
) -> None:
    """Sign a policy with the policy authority's key (a DSSE envelope over its digest)."""
    from govray.governance.policy import sign_policy

    envelope = sign_policy(policy, SigningKey.load(key))
    target = out or policy.with_name(policy.name + ".sig")
    target.write_text(envelope.to_json())
    console.print(f"signed {policy} with key {envelope.signatures[0].keyid} → {target}")


@app.command()
def verify(
    policy: Path = typer.Argument(..., help="Policy file (YAML)."),
    trust: Path = typer.Option(..., "--trust", help="Trust file listing the policy authority keys."),
    signature: Path | None = typer.Option(None, "--signature", help="Signature file (default: POLICY.sig)."),
) -> None:
    """Verify a policy's signature; exits 5 when it does not verify."""
    from govray.governance.policy import load_verified_policy

    target = signature or policy.with_name(policy.name + ".sig")
    read_envelope(target)  # a clear error for a missing or malformed envelope
    verified = load_verified_policy(policy, target, load_trust(trust))
    assert verified.signature is not None
    signed = verified.signature
    console.print(
        f"[green]OK[/] policy '{verified.policy.name}' v{verified.policy.version} sha256 {verified.digest} "
        f"signed by {signed.keyid} at {signed.signed_at.isoformat()}"
    )


@app.command()
def check(config_path: Path = ConfigArgument, allow_unsigned: bool = AllowUnsigned) -> None:
    """Verify the experiment's policy, resolve it against the trial's model and match every
    credential of the data against it (each corpus's, and each distinct value set of its
    credential columns), before Ray starts: everything no rule takes is named, with the closest
    rule; exits 4 then."""
    from govray.data.credential_check import unmatched_credentials
    from govray.platform.run.preflight import check_policy

    config, store = open_experiment(config_path)
    checked = check_policy(config, store, allow_unsigned=allow_unsigned)
    policy, routing = checked.policy, checked.routing
    if problems := unmatched_credentials(config.data.corpora, policy.policy):
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise PolicyError(f"{len(problems)} credential(s) of the data would be refused by ingest:\n{listed}")
    state = f"signed by {policy.signature.keyid[:16]}…" if policy.signature else "[yellow]UNSIGNED[/]"
    layers = ", ".join(routing.layers)
    console.print(f"policy '{policy.policy.name}' v{policy.policy.version} ({state}); layers: {layers}")
    listing = table("route", "may update", "frozen share")
    for route in routing.routes:
        allowed = routing.allowed(route)
        if route in routing.adapter_targets:
            updates = f"adapter on {', '.join(routing.adapter_targets[route])} only"
        else:
            updates = ", ".join(allowed)
        listing.add_row(route, updates, f"{routing.masked_fraction(route):.1%}")
    console.print(listing)
