"""``govray attest CHECKPOINT`` and ``govray verify ENVELOPE``: signed statements of what a model
is and what trained it, checkable without govray's database."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from govray.cli.common import Database, console, open_store

if TYPE_CHECKING:
    from govray.core.keys import TrustConfig


def attest(
    checkpoint: Path = typer.Argument(..., help="A checkpoint directory of a govray run."),
    model_signing: bool = typer.Option(
        False,
        "--model-signing",
        help="Also sign the directory for OpenSSF model_signing (the platform's ECDSA key).",
    ),
    database: str | None = Database,
) -> None:
    """Verify the checkpoint (under the operator's trust; its manifest the one the tracking store
    recorded when it was sealed), then write its provenance and coverage statements, made and signed
    by the platform's signer (this process holds no key), under STORAGE/attestations/RUN/ (and,
    with --model-signing, an OpenSSF model signature that ``model_signing verify key`` checks)."""
    from govray.signer.attesting import attest as attest_through_signer
    from govray.tracking.lineage import checkpoint_at
    from govray.train.checkpoints.manifest import CheckpointError

    store = open_store(database)
    try:
        record = checkpoint_at(store, checkpoint)
    finally:
        store.close()
    if record is None:
        raise CheckpointError(
            f"{checkpoint}: not a checkpoint the tracking store recorded: only a sealed checkpoint of a "
            "run is attested"
        )
    written = attest_through_signer(
        checkpoint, model_signature=model_signing, recorded_manifest=record.manifest_digest
    )
    console.print(f"provenance: {written.provenance}\ncoverage:   {written.coverage}", highlight=False)
    if written.model_signature is not None:
        console.print(f"model signature: {written.model_signature}", highlight=False)


def verify(
    envelope: Path = typer.Argument(
        ..., help="An attestation envelope (DSSE JSON) or an OpenSSF model signature (Sigstore bundle)."
    ),
    model_dir: Path = typer.Option(..., "--model-dir", help="The directory holding the model files."),
    trust: Path = typer.Option(..., "--trust", help="Trust file listing the platform keys to accept."),
    policy: Path | None = typer.Option(
        None, "--policy", help="Also check this policy file is the attested one."
    ),
    require_root: bool = typer.Option(
        False,
        "--require-root",
        help="Refuse an attestation made under another trust root than --trust's "
        "(the operator's root: govray keys export-root).",
    ),
    recompute: bool = typer.Option(
        False,
        "--recompute-ledger",
        help="Also recompute the ledger from the recorded schedule and compare it with the attested "
        "one (uses the coverage statement beside a provenance envelope).",
    ),
) -> None:
    """Check the signature (trusted, unrevoked key), every subject digest against the files, and
    optionally the policy and the ledger; exits non-zero naming what broke. A model signature is
    checked by ``model_signing``'s own verifier: every file of the directory, none more."""
    from govray.core.keys import load_trust
    from govray.provenance.attest import AttestationError
    from govray.provenance.model_signature import is_model_signature, verify_model_signature
    from govray.provenance.recompute import check_attested_ledger
    from govray.provenance.statement_types import COVERAGE_TYPE
    from govray.provenance.verify import verify_attestation

    trusted = load_trust(trust)
    if is_model_signature(envelope):
        if policy is not None or recompute or require_root:
            raise typer.BadParameter(
                "--policy, --require-root and --recompute-ledger check attestations, not model signatures"
            )
        signed = verify_model_signature(envelope, model_dir, trusted)
        console.print(f"verified: model_signing signature by {signed.signer}; {len(signed.files)} files")
        return
    verified = verify_attestation(envelope, model_dir=model_dir, trust=trusted, policy=policy)
    if require_root and verified.statement["predicateType"] == COVERAGE_TYPE:
        raise typer.BadParameter(
            "--require-root checks a provenance statement: the coverage one cites no root"
        )
    subjects = ", ".join(subject["name"] for subject in verified.statement["subject"])
    console.print(f"verified: {verified.statement['predicateType']} signed by {verified.signer}; {subjects}")
    if verified.statement["predicateType"] != COVERAGE_TYPE:
        console.print(policy_line(verified.statement), highlight=False)
        line, same = root_line(verified.statement, trusted)
        console.print(line, highlight=False)
        if require_root and not same:
            raise AttestationError(f"{envelope}: {line}")
    if recompute:
        coverage = envelope
        if verified.statement["predicateType"] != COVERAGE_TYPE:
            coverage = envelope.with_name(envelope.name.replace(".provenance.", ".coverage."))
            if coverage == envelope or not coverage.is_file():
                raise AttestationError(
                    f"{envelope}: no coverage statement beside it to recompute the ledger from"
                )
        statement = verify_attestation(coverage, model_dir=model_dir, trust=trusted, expected_kind="coverage")
        entries = check_attested_ledger(statement.statement, model_dir, trusted)
        console.print(f"ledger recomputed from the schedule: all {entries} attested entries match")


def root_line(statement: dict[str, Any], trusted: TrustConfig) -> tuple[str, bool]:
    """Whether a provenance statement was made under the trust root ``trusted`` is (the sha256 it
    cites against ``core.keys.trust_root``'s): the line to print, and whether they are the same."""
    from govray.core.keys import trust_root_sha256

    internal = statement["predicate"]["buildDefinition"]["internalParameters"]
    cited = (internal.get("trust_root") or {}).get("sha256")
    held = trust_root_sha256(trusted)
    if cited is None:
        return "trust root: this attestation cites none (made before attestations cited one)", False
    if cited == held:
        return f"trust root: sha256 {held}, the one this attestation was made under", True
    return (
        f"trust root: this attestation was made under sha256 {cited}; the trust file given is {held} "
        "(another root: ask the operator for theirs, govray keys export-root)",
        False,
    )


def policy_line(statement: dict[str, Any]) -> str:
    """What a provenance statement says of the policy: name, version, digest, and who signed it
    (an unsigned one is said so, loudly)."""
    from govray.governance.policy import UNSIGNED_POLICY

    policy = statement["predicate"]["buildDefinition"]["externalParameters"]["policy"]
    named = f"policy: {policy.get('name')} v{policy.get('version')} (sha256 {policy.get('sha256')})"
    signer = policy.get("signer")
    if signer == UNSIGNED_POLICY:
        return f"{named}, UNSIGNED: nobody vouched for it (the operator let the run through)"
    root = (policy.get("trust_root") or {}).get("sha256") or "none"
    return f"{named}, signed by {signer} (checked against the trust file with sha256 {root})"
