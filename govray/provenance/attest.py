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
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from safetensors import safe_open

from govray.core.canonical import canonical_json, file_sha256, sha256_hex
from govray.core.dsse import sign_envelope, signing_time
from govray.core.errors import GovrayError
from govray.core.keys import KeyType, SigningKey, TrustConfig, platform_key, platform_trust
from govray.data.shards import ShardSet
from govray.governance.routing import RoutingTable, adapter_of_tensor, layer_label
from govray.provenance.model_signature import SIGNATURE_SUFFIX, sign_model
from govray.tracking.lineage import checkpoints, record_attestation
from govray.tracking.store import TrackingStore
from govray.train.checkpoint import (
    MODEL_FILE,
    RUN_SPEC_FILE,
    CheckpointError,
    CheckpointState,
    find_checkpoints,
    load_checkpoint,
    shard_owner,
)
from govray.train.ledger import Ledger
from govray.train.reproducibility import ReproducibilityRecord
from govray.train.runspec import RunSpec
from govray.train.trial import importable, make_trial, resolve_trial_routes

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PROVENANCE_TYPE = "https://slsa.dev/provenance/v1"
COVERAGE_TYPE = "https://govray.dev/attestation/coverage/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
BUILD_TYPE = "https://govray.dev/buildtypes/governed-training/v1"
BUILDER_ID = "https://govray.dev/builder/platform"
KINDS = ("provenance", "coverage")


class AttestationError(GovrayError):
    """An attestation cannot be made, or does not verify (the message says what broke)."""

    exit_code = 16


@dataclass(frozen=True)
class Attestation:
    """The envelopes written for one checkpoint."""

    provenance: Path
    coverage: Path
    subjects: dict[str, str]  # model file name → sha256
    model_signature: Path | None = None  # the OpenSSF model signature, when asked for


def model_subjects(directory: Path) -> list[dict[str, Any]]:
    """The model files of a checkpoint or model directory, by name and sha256: the base, then each
    adapter in name order."""
    if not (directory / MODEL_FILE).is_file():
        if any(shard_owner(path.name) is not None for path in directory.iterdir()):
            raise AttestationError(
                f"{directory}: a sharded (strategy fsdp) checkpoint without {MODEL_FILE}: the whole model "
                "is put together only in a validation's checkpoint and the trial's last; attest one of those"
            )
        raise AttestationError(f"{directory}: no {MODEL_FILE} (not a checkpoint or model directory)")
    files = [directory / MODEL_FILE, *sorted(directory.glob("adapter-*.safetensors"))]
    return [{"name": file.name, "digest": {"sha256": file_sha256(file)}} for file in files]


def run_spec_of(checkpoint: Path) -> RunSpec:
    """The spec of the run that wrote ``checkpoint``: its own signed copy (``run.json``), else, for
    a checkpoint written before it held one, ``STORAGE/ray/RUN/checkpoint_*`` →
    ``STORAGE/runs/RUN.json``."""
    run = checkpoint.resolve().parent
    own = checkpoint / RUN_SPEC_FILE
    path = own if own.is_file() else run.parent.parent / "runs" / f"{run.name}.json"
    if not path.is_file():
        raise AttestationError(f"{checkpoint}: no run spec at {path} (not a checkpoint of a govray run?)")
    return RunSpec.model_validate_json(path.read_text())


@dataclass(frozen=True)
class Derivation:
    """How a model version was derived from an attested one without training: the adapters it no
    longer carries, the corpora that leaves out entirely, and the source's provenance envelope."""

    removed_adapters: tuple[str, ...]
    excluded_corpora: tuple[str, ...]
    source_uri: str  # govray:model/NAME/VERSION
    source_attestation_sha256: str  # of the source version's provenance envelope


def attest_checkpoint(
    checkpoint: Path,
    key: SigningKey | None = None,
    trust: TrustConfig | None = None,
    *,
    derivation: Derivation | None = None,
    destination: Path | None = None,
    model_signature: bool = False,
) -> Attestation:
    """Verify ``checkpoint`` (a tampered one is refused), build both statements and write them
    signed by the platform key; returns the envelope paths. They go to
    ``STORAGE/attestations/RUN/CHECKPOINT.KIND.dsse.json`` unless ``destination`` (a path prefix)
    is given; ``derivation`` attests a model version made by removing adapters;
    ``model_signature`` also signs the directory for ``model_signing`` (the platform's ECDSA key)
    into ``DESTINATION.model-signing.sig``."""
    key = key if key is not None else platform_key()
    spec = run_spec_of(checkpoint)
    try:
        loaded = load_checkpoint(checkpoint, trust if trust is not None else platform_trust(key, spec.trust))
    except CheckpointError as error:
        raise AttestationError(f"refusing to attest: {error}") from None
    routing = routing_of(spec)
    subjects = model_subjects(checkpoint)
    moment = signing_time()
    predicate = provenance(spec, loaded.state, routing, checkpoint, derivation, finished_on=moment)
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


def signature_path(destination: Path) -> Path:
    """Where the OpenSSF model signature of the attestations at ``destination`` goes."""
    return destination.with_name(f"{destination.name}.{SIGNATURE_SUFFIX}")


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
        active = [c for c in recorded if c.state == "active"]
        final = Path(active[-1].path) if active else None
    if final is None:
        return None
    written = attest_checkpoint(final)
    row = next((c for c in recorded if Path(c.path).resolve() == final.resolve()), None)
    subject = written.subjects[MODEL_FILE]
    for path in (written.provenance, written.coverage):
        record_attestation(store, row.id if row is not None else None, subject, path.read_text())
    return written


def provenance(
    spec: RunSpec,
    state: CheckpointState,
    routing: RoutingTable,
    checkpoint: Path,
    derivation: Derivation | None = None,
    *,
    finished_on: datetime,
) -> dict[str, Any]:
    """The SLSA Provenance v1 predicate of a checkpoint (or of a model version derived from one)."""
    manifest = ShardSet.open(Path(spec.shard_root)).manifest
    excluded = sorted({*spec.excluded_corpora, *(derivation.excluded_corpora if derivation else ())})
    dependencies = [
        {
            "name": corpus.corpus_id,
            "uri": f"govray:corpus/{corpus.corpus_id}",
            "digest": {"sha256": corpus.fingerprint},
            "annotations": {
                "credential": corpus.credential,
                "credential_columns": corpus.credential_columns,
                "rows": corpus.rows,
                "train_rows": corpus.train_rows,
                "holdout_rows": corpus.holdout_rows,
                "route_counts": corpus.route_counts,
                "excluded": corpus.corpus_id in excluded,
            },
        }
        for corpus in manifest.corpora
    ]
    dependencies.extend(_start_dependencies(state.source))
    if derivation is not None:
        dependencies.append(
            {
                "name": "source-model",
                "uri": derivation.source_uri,
                "digest": {"sha256": derivation.source_attestation_sha256},
                "annotations": {"removed_adapters": list(derivation.removed_adapters)},
            }
        )
    matrix = coverage_matrix(Ledger.from_json(state.ledger), routing)
    return {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {
                "trial": spec.trial,
                "hyperparameters": spec.hparams,
                "seed": spec.seed,
                "trial_seed": spec.trial_seed,
                "max_steps": spec.max_steps,
                "excluded_corpora": excluded,
                "removed_adapters": list(derivation.removed_adapters if derivation else ()),
                "config": {"sha256": spec.config_digest},
                "policy": {
                    "name": spec.policy.name,
                    "version": spec.policy.version,
                    "sha256": spec.policy_digest,
                },
            },
            "internalParameters": {
                "step": state.step,
                "epoch": state.epoch,
                "schedule_sha256": state.schedule_digest,
                "shards": manifest.key,
                "reproducibility": state.reproducibility,
                # Removal = replay: bit for bit, or within this stated tolerance (GPUs).
                "replay_equivalence": _replay_equivalence(state.reproducibility),
                "precision": precision_statement(
                    spec.settings.precision if spec.settings is not None else None, routing, checkpoint
                ),
            },
            "resolvedDependencies": dependencies,
        },
        "runDetails": {
            "builder": {"id": BUILDER_ID},
            "metadata": {
                "invocationId": state.run or checkpoint.resolve().parent.name,
                "finishedOn": finished_on.isoformat(timespec="seconds").replace("+00:00", "Z"),
            },
            "byproducts": [
                _byproduct("coverage-matrix", matrix),
                _byproduct("memorization-report", state.memorization),
                _byproduct("decisions", {"gates": state.gates, "rollbacks": state.rollbacks}),
            ],
        },
    }


_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def precision_statement(setting: str | None, routing: RoutingTable, checkpoint: Path) -> dict[str, Any]:
    """What the run computed and kept numbers in: its precision setting (bf16 / fp16: autocast, or
    FSDP's mixed precision); every trainable tensor (adapters included), its optimizer state and
    its reduction in float32 (``train/trainable.py``); and the dtypes the frozen base tensors — no
    route may update them — are stored in (they keep the dtype the base was loaded in), read
    from the base file's header (a sharded checkpoint: rank 0's shard file)."""
    frozen = {
        alias
        for index, info in enumerate(routing.parameters)
        if not any(mask[index] for mask in routing.masks.values())
        for alias in (info.name, *info.aliases)
    }
    path = checkpoint / MODEL_FILE
    if not path.is_file():
        path = min(checkpoint.glob("model-shard-00000-of-*.safetensors"), default=path)
    dtypes: set[str] = set()
    if frozen and path.is_file():
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if name in frozen:
                    stored = handle.get_slice(name).get_dtype()
                    dtypes.add(_DTYPES.get(stored, stored))
    return {
        "setting": None if setting is None else str(setting),
        "trainable": "float32",
        "frozen_base": sorted(dtypes),
    }


def coverage(state: CheckpointState, routing: RoutingTable) -> dict[str, Any]:
    """govray's coverage predicate: what directly reached each parameter tensor, per corpus."""
    layers = routing.tensor_layers()
    names = list(routing.layers)
    return {
        "ledger": [
            {
                "corpus": corpus,
                "tensor": tensor,
                "layer": _layer_name(layers.get(tensor), names, tensor),
                "examples": entry.examples,
                "tokens": entry.tokens,
                "steps": entry.steps,
            }
            for corpus, tensor, entry in Ledger.from_json(state.ledger).rows()
        ],
        "contribution": "direct",  # the examples whose gradients updated the tensor, as scheduled
        "steps": state.step,
        "schedule": state.schedule,
        "schedule_sha256": state.schedule_digest,
    }


def coverage_matrix(ledger: Ledger, routing: RoutingTable) -> dict[str, dict[str, int]]:
    """corpus → layer (or ``adapter:NAME``) → the most examples that reached a tensor of it."""
    layers = routing.tensor_layers()
    names = list(routing.layers)
    matrix: dict[str, dict[str, int]] = {}
    for corpus, tensor, entry in ledger.rows():
        column = _layer_name(layers.get(tensor), names, tensor)
        row = matrix.setdefault(corpus, {})
        row[column] = max(row.get(column, 0), entry.examples)
    return matrix


def attestation_prefix(checkpoint: Path, spec: RunSpec) -> Path:
    """``STORAGE/attestations/RUN/CHECKPOINT``, for a run's own checkpoints and for the copies Ray
    Tune keeps elsewhere of a search trial's: the prefix of its attestations' file names."""
    if spec.run_dir and spec.run_name:
        return Path(spec.run_dir).parent.parent / "attestations" / spec.run_name / checkpoint.name
    run = checkpoint.resolve().parent
    return run.parent.parent / "attestations" / run.name / checkpoint.name


def _start_dependencies(source: dict[str, Any]) -> list[dict[str, Any]]:
    """What a run that started from trained weights depends on: that checkpoint and, when it was
    a registered model version, that version's own provenance attestation (lineage chains)."""
    if not source:
        return []
    found = [
        {
            "name": "start-checkpoint",
            "uri": f"govray:checkpoint/{source.get('path', '')}",
            "digest": {"sha256": str(source.get("manifest_sha256", ""))},
            "annotations": {k: v for k, v in source.items() if not k.startswith("model")},
        }
    ]
    if "model_uri" in source:
        found.append(
            {
                "name": "base-model",
                "uri": source["model_uri"],
                "digest": {"sha256": str(source.get("model_attestation_sha256", ""))},
                "annotations": {"attestation": source.get("model_attestation", "")},
            }
        )
    return found


def _statement(
    subjects: list[dict[str, Any]], predicate_type: str, predicate: dict[str, Any]
) -> dict[str, Any]:
    return {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": predicate_type,
        "predicate": predicate,
    }


def _byproduct(name: str, content: Any) -> dict[str, Any]:
    return {
        "name": name,
        "mediaType": "application/json",
        "digest": {"sha256": sha256_hex(canonical_json(content))},
        "annotations": {"content": content},
    }


def _replay_equivalence(recorded: dict[str, Any]) -> dict[str, Any]:
    try:
        record = ReproducibilityRecord.model_validate(recorded)
    except ValidationError as error:
        raise AttestationError(f"the checkpoint's reproducibility record is unreadable: {error}") from None
    return record.replay_equivalence().model_dump(mode="json")


def routing_of(spec: RunSpec) -> RoutingTable:
    """The routing table of the run ``spec`` describes: the one its run.json holds, else (a run
    recorded before it held one) its trial's model resolved by its policy on the meta device."""
    if spec.routing is not None:
        return spec.routing
    importable(spec.code_dir)  # where the trial's module was importable when it ran
    return resolve_trial_routes(spec.policy, make_trial(spec.trial, spec.hparams, spec.settings))


def _layer_name(index: int | None, names: list[str], tensor: str) -> str:
    return layer_label(names[index] if index is not None else None, adapter_of_tensor(tensor))
