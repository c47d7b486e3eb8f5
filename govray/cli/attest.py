"""``govray attest CHECKPOINT`` and ``govray verify ENVELOPE``: signed statements of what a model
is and what trained it, checkable without govray's database."""

from __future__ import annotations

from pathlib import Path

import typer

from govray.attest import attest_checkpoint, verify_attestation
from govray.cli.common import console
from govray.keys import load_trust


def attest(
    checkpoint: Path = typer.Argument(..., help="A checkpoint directory of a govray run."),
) -> None:
    """Verify the checkpoint, then write its provenance and coverage statements, signed by the
    platform key, under STORAGE/attestations/RUN/."""
    written = attest_checkpoint(checkpoint)
    console.print(f"provenance: {written.provenance}\ncoverage:   {written.coverage}", highlight=False)


def verify(
    envelope: Path = typer.Argument(..., help="An attestation envelope (DSSE JSON)."),
    model_dir: Path = typer.Option(..., "--model-dir", help="The directory holding the model files."),
    trust: Path = typer.Option(..., "--trust", help="Trust file listing the platform keys to accept."),
    policy: Path | None = typer.Option(
        None, "--policy", help="Also check this policy file is the attested one."
    ),
) -> None:
    """Check the signature (trusted, unrevoked key), every subject digest against the files, and
    optionally the policy; exits non-zero naming what broke."""
    verified = verify_attestation(envelope, model_dir=model_dir, trust=load_trust(trust), policy=policy)
    subjects = ", ".join(subject["name"] for subject in verified.statement["subject"])
    console.print(f"verified: {verified.statement['predicateType']} signed by {verified.signer}; {subjects}")
