"""A model version derived from a verified one by removing an adapter, as the platform's signer
checks it before sealing it.

``model remove-adapter`` stages the new version's folder (the source's base file, its other
adapters, its signed run spec, the derived state: ``derived_state``) and asks the signer to seal
it (``Signer.derive``). The signer verifies the source under the operator's trust, takes what was
removed and excluded before from the source's provenance attestation (verified, and about exactly
the source's model files), recomputes the derived state and every file the folder must hold
(``expected_files``) and seals the folder only if it holds exactly those; the derivation it
records is what a later attestation of the folder states. Nothing the asking process claims about
the derivation is signed.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from govray.core.canonical import file_sha256
from govray.core.dsse import Envelope, verify_envelope
from govray.core.errors import AttestationError
from govray.core.keys import KeyRole, TrustConfig
from govray.provenance.attest import model_subjects
from govray.provenance.predicates import Derivation
from govray.provenance.statement_types import PAYLOAD_TYPE, PROVENANCE_TYPE
from govray.train.checkpoints.files import MODEL_FILE, CheckpointState, stage_checkpoint
from govray.train.checkpoints.manifest import Manifest
from govray.train.runspec import RUN_SPEC_FILE, RunSpec
from govray.train.step.ledger import Ledger

EMPTY_OPTIMIZER: dict[str, Any] = {"state": {}, "param_groups": []}  # a registered version trains no more


def adapter_file(adapter: str) -> str:
    return f"adapter-{adapter}.safetensors"


def derived_state(state: CheckpointState, adapter: str) -> CheckpointState:
    """The state of the version without ``adapter``: its tensors out of the ledger, the adapter out
    of the list, the whole model held (no sharding), no clean-step bookkeeping."""
    kept = Ledger.from_json(state.ledger).without_adapter(adapter)
    return state.model_copy(
        update={
            "ledger": kept.to_json(),
            "adapters": [name for name in state.adapters if name != adapter],
            "clean_step": None,
            "clean_ledgers": {},
            "sharding": {},  # the version holds the whole model (a sharded source's, put together)
        }
    )


def derivation_of(
    spec: RunSpec,
    state: CheckpointState,
    adapter: str,
    source_statement: dict[str, Any],
    source_uri: str,
    envelope: bytes,
) -> Derivation:
    """What removing ``adapter`` from the source (its verified provenance statement,
    ``source_statement``; ``envelope``: that attestation's bytes) derives: the adapters removed so
    far and this one, and the corpora that reach no tensor any more (with those an earlier removal
    excluded; those the run itself excluded, ``spec``'s, every statement names anyway)."""
    external = source_statement["predicate"]["buildDefinition"]["externalParameters"]
    before = set(external.get("excluded_corpora", ())) - set(spec.excluded_corpora)
    ledger = Ledger.from_json(state.ledger)
    newly = set(ledger.corpora()) - set(ledger.without_adapter(adapter).corpora())
    return Derivation(
        removed_adapters=(*external.get("removed_adapters", ()), adapter),
        excluded_corpora=tuple(sorted(before | newly)),
        source_uri=source_uri,
        source_attestation_sha256=hashlib.sha256(envelope).hexdigest(),
    )


def verified_source_statement(
    envelope: bytes, source: Path, trust: TrustConfig, manifest: Manifest
) -> dict[str, Any]:
    """The provenance statement in ``envelope``, signed by a trusted platform key and about exactly
    the model files of ``source`` (by sha256); anything else is ``AttestationError``."""
    try:
        parsed = Envelope.model_validate_json(envelope)
    except ValueError:
        raise AttestationError("the source's attestation is not a DSSE envelope") from None
    payload, _ = verify_envelope(
        parsed, trust, KeyRole.PLATFORM, expected_type=PAYLOAD_TYPE, what="the source version's attestation"
    )
    statement = json.loads(payload)
    if statement.get("predicateType") != PROVENANCE_TYPE:
        raise AttestationError("the source's attestation is not a provenance statement")
    attested = {s["name"]: s["digest"]["sha256"] for s in statement.get("subject", [])}
    held = {s["name"]: s["digest"]["sha256"] for s in model_subjects(source, trust, manifest)}
    if attested != held:
        raise AttestationError(f"the source's attestation is not about {source}'s model files")
    return statement


def expected_files(
    source: Path, trust: TrustConfig, manifest: Manifest, spec: RunSpec, state: CheckpointState, adapter: str
) -> dict[str, str]:
    """Every file the derived version's folder holds, by sha256: the source's base and its other
    adapters (as its verified ``manifest`` lists them), its run spec as signed, and the derived
    state and (empty) optimizer as ``stage_checkpoint`` writes them."""
    subjects = {s["name"]: s["digest"]["sha256"] for s in model_subjects(source, trust, manifest)}
    files = {name: digest for name, digest in subjects.items() if name != adapter_file(adapter)}
    files[RUN_SPEC_FILE] = spec.sha256()
    with tempfile.TemporaryDirectory() as scratch:
        stage_checkpoint(Path(scratch), EMPTY_OPTIMIZER, state)
        files |= {path.name: file_sha256(path) for path in Path(scratch).iterdir()}
    if MODEL_FILE not in files:
        raise AttestationError(f"{source}: no base model file to derive a version from")
    return files


@dataclass(frozen=True)
class DerivedRecord:
    """What the signer keeps of a version it sealed as derived: by its manifest's sha256."""

    manifest_sha256: str
    derivation: Derivation

    def to_json(self) -> str:
        return json.dumps(
            {
                "manifest_sha256": self.manifest_sha256,
                "removed_adapters": list(self.derivation.removed_adapters),
                "excluded_corpora": list(self.derivation.excluded_corpora),
                "source_uri": self.derivation.source_uri,
                "source_attestation_sha256": self.derivation.source_attestation_sha256,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, line: str) -> DerivedRecord:
        entry = json.loads(line)
        return cls(
            entry["manifest_sha256"],
            Derivation(
                tuple(entry["removed_adapters"]),
                tuple(entry["excluded_corpora"]),
                entry["source_uri"],
                entry["source_attestation_sha256"],
            ),
        )
