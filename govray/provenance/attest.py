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
(beside the checkpoint: its own signed manifest admits no extra file)::

    written = attest_checkpoint(checkpoint_dir)           # -> Attestation(provenance=..., coverage=...)
    verified = verify_attestation(written.provenance, model_dir=checkpoint_dir, trust=trust)

On request (every registered version asks) the checkpoint directory also gets an OpenSSF model
signature, ``CHECKPOINT.model-signing.sig`` beside the envelopes (``govray.provenance.model_signature``).

Verifying them (signature, statement, every subject's digest) is :mod:`govray.provenance.verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.core.canonical import canonical_json, file_sha256
from govray.core.dsse import sign_envelope, signing_time
from govray.core.errors import AttestationError
from govray.core.keys import KeyType, SigningKey, TrustConfig, platform_key, trust_root_sha256
from govray.core.settings import operator_trust
from govray.provenance.locations import attestation_prefix, signature_path, signed_run_spec
from govray.provenance.model_signature import sign_model
from govray.provenance.predicates import Derivation, coverage, provenance
from govray.provenance.statement_types import COVERAGE_TYPE, PAYLOAD_TYPE, PROVENANCE_TYPE, STATEMENT_TYPE
from govray.tracking.lineage import checkpoints, final_checkpoint_record, record_attestation
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.base_file import materialize_base
from govray.train.checkpoints.files import (
    MODEL_FILE,
    CheckpointError,
    find_checkpoints,
    load_checkpoint,
    model_file,
)
from govray.train.checkpoints.manifest import refuse_unrecorded_manifest
from govray.train.checkpoints.whole_file import shards_only, whole_model_sha256

KINDS = ("provenance", "coverage")


@dataclass(frozen=True)
class Attestation:
    """The envelopes written for one checkpoint."""

    provenance: Path
    coverage: Path
    subjects: dict[str, str]  # model file name → sha256
    model_signature: Path | None = None  # the OpenSSF model signature, when asked for


def model_subjects(directory: Path, trust: TrustConfig) -> list[dict[str, Any]]:
    """The model files of a checkpoint or model directory, by name and sha256: the base (the run's
    base file when the checkpoint refers to it: ``govray.train.checkpoints.base_file``; of a sharded
    checkpoint, the ``model.safetensors`` its shards, verified against ``trust``, put together,
    hashed streaming and never written: ``govray.train.checkpoints.whole_file``), then each adapter in name
    order."""
    base = model_file(directory)
    if shards_only(directory):
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
    adapters = sorted(directory.glob("adapter-*.safetensors"))
    return [
        {"name": MODEL_FILE, "digest": {"sha256": digest}},
        *({"name": path.name, "digest": {"sha256": file_sha256(path)}} for path in adapters),
    ]


def attest_checkpoint(
    checkpoint: Path,
    key: SigningKey | None = None,
    trust: TrustConfig | None = None,
    *,
    derivation: Derivation | None = None,
    destination: Path | None = None,
    model_signature: bool = False,
    recorded_manifest: str | None = None,
) -> Attestation:
    """Verify ``checkpoint`` (a tampered one is refused), build both statements and write them
    signed by the platform key; returns the envelope paths. They go to
    ``STORAGE/attestations/RUN/CHECKPOINT.KIND.dsse.json`` unless ``destination`` (a path prefix)
    is given; ``derivation`` attests a model version made by removing adapters;
    ``model_signature`` also signs the directory for ``model_signing`` (the platform's ECDSA key)
    into ``DESTINATION.model-signing.sig``.

    The checkpoint is verified against ``trust`` (by default the operator's: ``operator_trust``),
    never the keys its own ``run.json`` lists; ``recorded_manifest``: the manifest's sha256 the
    tracking store recorded when it was sealed (a different manifest: ``CheckpointError``, exit 10)."""
    key = key if key is not None else platform_key()
    if model_signature:  # the OpenSSF signature covers the folder's files: the base file among them
        materialize_base(checkpoint)
    trust = trust if trust is not None else operator_trust()
    if recorded_manifest is not None:
        refuse_unrecorded_manifest(checkpoint, recorded_manifest)
    try:
        loaded = load_checkpoint(checkpoint, trust)
        spec = signed_run_spec(checkpoint, trust)  # the run spec as the verified manifest lists it
    except CheckpointError as error:
        raise AttestationError(f"refusing to attest: {error}") from None
    if recorded_manifest is not None:  # (and still the recorded one, once verified)
        refuse_unrecorded_manifest(checkpoint, recorded_manifest)
    routing = spec.routing
    subjects = model_subjects(checkpoint, trust)
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
    if destination is None:
        destination = attestation_prefix(checkpoint, spec)
    destination.parent.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind, statement in statements.items():
        envelope = sign_envelope(canonical_json(statement), PAYLOAD_TYPE, key, moment)
        path = destination.with_name(f"{destination.name}.{kind}.dsse.json")
        path.write_text(envelope.to_json())
        paths[kind] = path
    signature = None
    if model_signature:
        signature = sign_model(checkpoint, signature_path(destination), platform_key(keytype=KeyType.ECDSA))
    return Attestation(
        **paths, subjects={s["name"]: s["digest"]["sha256"] for s in subjects}, model_signature=signature
    )


def attest_trial_end(store: TrackingStore, trial_id: int, run_dir: Path | None = None) -> Attestation | None:
    """Attest a finished trial's final checkpoint — the last under ``run_dir``, or (a search trial,
    whose checkpoints Ray Tune keeps) the last active one the store recorded — and keep both
    envelopes in the tracking store (``attestations``, by checkpoint and base-model digest); None
    when the trial wrote no checkpoint."""
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
    written = attest_checkpoint(final, recorded_manifest=row.manifest_digest if row is not None else None)
    subject = written.subjects[MODEL_FILE]
    for path in (written.provenance, written.coverage):
        record_attestation(store, row.id if row is not None else None, subject, path.read_text())
    return written


def _statement(
    subjects: list[dict[str, Any]], predicate_type: str, predicate: dict[str, Any]
) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": predicate_type,
        "predicate": predicate,
    }
