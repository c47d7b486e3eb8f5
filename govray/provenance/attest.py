"""Signed attestations of a checkpoint that a third party can verify without govray's database.

Two in-toto Statement v1 documents about the same subjects — the model files by sha256, the base
(``model.safetensors``) and each adapter (``adapter-NAME.safetensors``) separately — each in a
DSSE envelope signed with the platform's Ed25519 key (payload type
``application/vnd.in-toto+json``):

- **provenance** (predicate ``https://slsa.dev/provenance/v1``): ``externalParameters`` hold the
  trial, hyperparameters, seed, steps, excluded corpora and the config and policy digests;
  ``internalParameters`` the schedule, the reproducibility record and ``replay_equivalence``
  (``{"exact": bool, "tolerance": {"rtol", "atol"}, "basis"}``: exact on CPU and in deterministic
  mode, else the stated tolerance a replay's weights meet) and ``precision`` (the setting;
  trainable tensors, their optimizer state and reduction in float32; the frozen base's dtypes);
  ``resolvedDependencies`` one descriptor per corpus (its fingerprint as the sha256 digest, its
  credential and row counts as annotations, and the checkpoint a forked run started from);
  ``byproducts`` the coverage matrix (corpus by layer → examples) and the last memorization report;
- **coverage** (predicate ``https://govray.dev/attestation/coverage/v1``): every (corpus, tensor)
  ledger entry with its layer — examples, tokens and steps that directly reached that tensor —
  and the schedule inputs it is recomputable from.

Envelopes are written to ``STORAGE/attestations/RUN/CHECKPOINT.{provenance,coverage}.dsse.json``
(beside the checkpoint: its own signed manifest admits no extra file). The platform's signer makes
them (``sign_attestation``, in its own process: ``govray.signer``); whoever asked writes them::

    signed = sign_attestation(checkpoint_dir, key, trust)   # the signer: verify, build, sign
    written = write_attestation(signed)                      # -> Attestation(provenance=..., coverage=...)
    verified = verify_attestation(written.provenance, model_dir=checkpoint_dir, trust=trust)

On request (every registered version asks) the checkpoint directory also gets an OpenSSF model
signature, ``CHECKPOINT.model-signing.sig`` beside the envelopes (``govray.provenance.model_signature``).

Verifying them (signature, statement, every subject's digest) is :mod:`govray.provenance.verify`.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.core.canonical import canonical_json, file_sha256
from govray.core.dsse import sign_envelope, signing_time
from govray.core.errors import AttestationError
from govray.core.keys import SigningKey, TrustConfig, trust_root_sha256
from govray.core.settings import operator_trust
from govray.provenance.locations import attestation_prefix, signature_path, signed_run_spec
from govray.provenance.model_signature import sign_model
from govray.provenance.predicates import Derivation, coverage, provenance
from govray.provenance.statement_types import COVERAGE_TYPE, PAYLOAD_TYPE, PROVENANCE_TYPE, STATEMENT_TYPE
from govray.train.checkpoints.base_file import materialize_base
from govray.train.checkpoints.files import (
    MODEL_FILE,
    CheckpointError,
    load_checkpoint,
    model_file,
)
from govray.train.checkpoints.manifest import (
    MANIFEST_FILE,
    SIGNATURE_FILE,
    Manifest,
    refuse_unrecorded_manifest,
)
from govray.train.checkpoints.whole_file import shards_only, whole_model_sha256

KINDS = ("provenance", "coverage")
ADAPTER_FILE = re.compile(r"adapter-[^/]+\.safetensors")


@dataclass(frozen=True)
class Attestation:
    """The envelopes written for one checkpoint."""

    provenance: Path
    coverage: Path
    subjects: dict[str, str]  # model file name → sha256
    model_signature: Path | None = None  # the OpenSSF model signature, when asked for


def model_subjects(
    directory: Path, trust: TrustConfig, manifest: Manifest | None = None
) -> list[dict[str, Any]]:
    """The model files of a checkpoint or model directory, by name and sha256: the base (the run's
    base file when the checkpoint refers to it: ``govray.train.checkpoints.base_file``; of a sharded
    checkpoint, the ``model.safetensors`` its shards, verified against ``trust``, put together,
    hashed streaming and never written: ``govray.train.checkpoints.whole_file``), then each adapter
    in name order. With the folder's verified ``manifest``, the files and digests are the ones it
    lists: nothing is read again after it verified (a file swapped or added since is not named)."""
    listed = manifest.files if manifest is not None else None
    base = model_file(directory)
    if listed is not None and MODEL_FILE in listed:
        digest = listed[MODEL_FILE]
    elif shards_only(directory):
        try:
            digest = whole_model_sha256(directory, trust)
        except CheckpointError as error:
            raise AttestationError(str(error)) from None
    elif base.is_file():
        digest = file_sha256(base)
    elif base != directory / MODEL_FILE:
        raise AttestationError(f"{base}: missing (the base model {directory} refers to by sha256)")
    else:
        raise AttestationError(f"{directory}: no {MODEL_FILE} (not a checkpoint or model directory)")
    if listed is not None:
        adapters = {name: d for name, d in sorted(listed.items()) if ADAPTER_FILE.fullmatch(name)}
    else:
        adapters = {path.name: file_sha256(path) for path in sorted(directory.glob("adapter-*.safetensors"))}
    return [
        {"name": MODEL_FILE, "digest": {"sha256": digest}},
        *({"name": name, "digest": {"sha256": d}} for name, d in adapters.items()),
    ]


@dataclass(frozen=True)
class SignedAttestation:
    """Both envelopes of one checkpoint (JSON text, as written), its subjects, the prefix their
    files go to by default, and the OpenSSF model signature (a Sigstore bundle's JSON) when asked
    for: what the platform's signer answers, nothing written yet."""

    envelopes: dict[str, str]  # kind → envelope JSON
    subjects: dict[str, str]
    prefix: Path
    model_signature: str | None = None


def sign_attestation(
    checkpoint: Path,
    key: SigningKey,
    trust: TrustConfig,
    *,
    model_key: SigningKey | None = None,
    derivation: Derivation | None = None,
    recorded_manifest: str | None = None,
    derivations: Callable[[str], Derivation | None] | None = None,
    sealed_here: Callable[[str], bool] | None = None,
) -> SignedAttestation:
    """Verify ``checkpoint`` under ``trust`` (a tampered one is refused; ``recorded_manifest``:
    the manifest's sha256 the tracking store recorded when it was sealed, another manifest is
    ``CheckpointError``, exit 10), build both statements from what verified and sign them with
    ``key``; with ``model_key`` (the platform's ECDSA key) also sign the directory for
    ``model_signing``. Writes nothing: the platform's signer runs this (``govray.signer``), and
    every statement it signs is one it built from files it verified, never bytes a caller chose.
    ``derivations``: the derivation the signer recorded when it sealed a derived version, by the
    sha256 of its manifest (``Signer.derive``). ``sealed_here``: whether the signer's own record
    holds a standing seal of a manifest (by sha256): another one is ``CheckpointError`` (exit 10),
    however well it verifies."""
    if recorded_manifest is not None:
        refuse_unrecorded_manifest(checkpoint, recorded_manifest)
    try:
        loaded = load_checkpoint(checkpoint, trust)
        spec = signed_run_spec(checkpoint, trust)  # the run spec as the verified manifest lists it
    except CheckpointError as error:
        raise AttestationError(f"refusing to attest: {error}") from None
    if recorded_manifest is not None:  # (and still the recorded one, once verified)
        refuse_unrecorded_manifest(checkpoint, recorded_manifest)
    if sealed_here is not None and not sealed_here(loaded.manifest_digest):
        raise CheckpointError(
            f"{checkpoint}: its manifest (sha256 {loaded.manifest_digest}) is not one the platform's "
            "signer sealed, or a later seal of its run superseded it (the signer's own record): not attested"
        )
    if derivation is None and derivations is not None:
        derivation = derivations(loaded.manifest_digest)
    routing = spec.routing
    subjects = model_subjects(checkpoint, trust, loaded.manifest)  # (as verified: nothing read again)
    moment = signing_time()
    predicate = provenance(
        spec,
        loaded.state,
        routing,
        checkpoint,
        derivation,
        finished_on=moment,
        trust_root=trust_root_sha256(trust),
    )
    statements = {
        "provenance": _statement(subjects, PROVENANCE_TYPE, predicate),
        "coverage": _statement(subjects, COVERAGE_TYPE, coverage(loaded.state, routing)),
    }
    envelopes = {
        kind: sign_envelope(canonical_json(statement), PAYLOAD_TYPE, key, moment).to_json()
        for kind, statement in statements.items()
    }
    bundle = None
    if model_key is not None:
        with tempfile.TemporaryDirectory() as scratch:
            verified = {**loaded.manifest.files, MANIFEST_FILE: loaded.manifest_digest, SIGNATURE_FILE: None}
            kept_aside = loaded.manifest.referenced or ()  # (a frozen base: in the folder when materialized)
            signature = sign_model(checkpoint, Path(scratch) / "model.sig", model_key, verified, kept_aside)
            bundle = signature.read_text()
    return SignedAttestation(
        envelopes,
        {s["name"]: s["digest"]["sha256"] for s in subjects},
        attestation_prefix(checkpoint, spec),
        bundle,
    )


def write_attestation(signed: SignedAttestation, destination: Path | None = None) -> Attestation:
    """Write ``signed``'s envelopes to ``DESTINATION.KIND.dsse.json`` (by default its prefix,
    ``STORAGE/attestations/RUN/CHECKPOINT``) and its model signature beside them."""
    destination = destination if destination is not None else signed.prefix
    destination.parent.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in KINDS:
        path = destination.with_name(f"{destination.name}.{kind}.dsse.json")
        path.write_text(signed.envelopes[kind])
        paths[kind] = path
    signature = None
    if signed.model_signature is not None:
        signature = signature_path(destination)
        signature.write_text(signed.model_signature)
    return Attestation(**paths, subjects=dict(signed.subjects), model_signature=signature)


def attest_checkpoint(
    checkpoint: Path,
    key: SigningKey,
    trust: TrustConfig | None = None,
    *,
    model_key: SigningKey | None = None,
    derivation: Derivation | None = None,
    destination: Path | None = None,
    recorded_manifest: str | None = None,
) -> Attestation:
    """Verify ``checkpoint`` (under ``trust``, by default the operator's: ``operator_trust``,
    never the keys its own ``run.json`` lists), sign both statements with ``key`` in this process
    and write them (``sign_attestation``, ``write_attestation``); with ``model_key`` also an
    OpenSSF model signature of the directory. ``derivation`` attests a model version made by
    removing adapters. A run's launch and the operator's commands attest through the platform's
    signer instead (``govray.signer.attesting.attest``): they hold no key."""
    if model_key is not None:  # the OpenSSF signature covers the folder's files: the base file among them
        materialize_base(checkpoint)
    signed = sign_attestation(
        checkpoint,
        key,
        trust if trust is not None else operator_trust(),
        model_key=model_key,
        derivation=derivation,
        recorded_manifest=recorded_manifest,
    )
    return write_attestation(signed, destination)


def _statement(
    subjects: list[dict[str, Any]], predicate_type: str, predicate: dict[str, Any]
) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": predicate_type,
        "predicate": predicate,
    }
