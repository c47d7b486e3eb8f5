"""Attestations made by the platform's signer, for the processes that hold no key.

A run's launch (at the trial's end: it imports the trial, so it must not hold the platform key),
``govray attest`` and ``govray model register`` ask the platform's signer (``signer_socket``) to
attest a checkpoint. The signer verifies it under the operator's trust, builds the provenance and
coverage statements from what verified, and signs them (``Signer.attest``): nothing the asking
process wrote is signed, and only the operator's OS users may ask. This writes what it answered
where the attestations go (``govray.provenance.attest.write_attestation``).

Example::

    written = attest(checkpoint, recorded_manifest=row.manifest_digest)   # -> Attestation
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from govray.core.errors import SignatureError
from govray.provenance.attest import KINDS as ATTESTATION_KINDS
from govray.provenance.attest import Attestation, SignedAttestation, write_attestation
from govray.signer.local import signer_socket
from govray.tracking.lineage import checkpoints, final_checkpoint_record, record_attestation
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.base_file import materialize_base
from govray.train.checkpoints.files import MODEL_FILE, find_checkpoints
from govray.train.checkpoints.signer import SignerClient


def attest(
    checkpoint: Path,
    *,
    model_signature: bool = False,
    recorded_manifest: str | None = None,
    destination: Path | None = None,
    socket: Path | None = None,
) -> Attestation:
    """Have the platform's signer (``socket``, by default ``signer_socket()``) attest
    ``checkpoint`` — its manifest ``recorded_manifest`` when given (another: ``CheckpointError``,
    exit 10) — and write both envelopes under ``destination`` (by default
    ``STORAGE/attestations/RUN/CHECKPOINT``); with ``model_signature`` also its OpenSSF model
    signature (the base file the checkpoint refers to is put in its folder first: the signature
    covers every file there)."""
    if model_signature:
        materialize_base(checkpoint)
    client = SignerClient(socket if socket is not None else signer_socket())
    answer = client.attest(str(Path(checkpoint).resolve()), recorded_manifest, model_signature)
    return write_attestation(_signed(answer, model_signature), destination)


def attest_trial_end(store: TrackingStore, trial_id: int, run_dir: Path | None = None) -> Attestation | None:
    """Attest a finished trial's final checkpoint through the signer — the last under ``run_dir``,
    or (a search trial, whose checkpoints Ray Tune keeps) the last active one the store recorded —
    and keep both envelopes in the tracking store (``attestations``, by checkpoint and base-model
    digest); None when the trial wrote no checkpoint."""
    recorded = checkpoints(store, trial_id)
    if run_dir is not None:
        found = find_checkpoints(run_dir)
        final = found[-1] if found else None
    else:
        kept = final_checkpoint_record(store, trial_id)
        final = Path(kept.path) if kept is not None else None
    if final is None:
        return None
    row = next((c for c in recorded if Path(c.path).resolve() == final.resolve()), None)
    written = attest(final, recorded_manifest=row.manifest_digest if row is not None else None)
    subject = written.subjects[MODEL_FILE]
    for path in (written.provenance, written.coverage):
        record_attestation(store, row.id if row is not None else None, subject, path.read_text())
    return written


def _signed(answer: dict[str, Any], model_signature: bool) -> SignedAttestation:
    """The signer's answer as a ``SignedAttestation`` (an answer missing a part is refused: a
    signer of another version, or not govray's)."""
    envelopes, subjects = answer.get("envelopes"), answer.get("subjects")
    bundle, prefix = answer.get("model_signature"), answer.get("prefix")
    if (
        not isinstance(envelopes, dict)
        or sorted(envelopes) != sorted(ATTESTATION_KINDS)
        or not all(isinstance(text, str) for text in envelopes.values())
        or not isinstance(subjects, dict)
        or not isinstance(prefix, str)
        or (model_signature and not isinstance(bundle, str))
    ):
        raise SignatureError(
            "the signer's answer to attest is not an attestation (a signer of another version?)"
        )
    return SignedAttestation(
        dict(envelopes), dict(subjects), Path(prefix), bundle if model_signature else None
    )
