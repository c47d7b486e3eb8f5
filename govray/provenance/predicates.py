"""What govray's attestations say about a checkpoint: the SLSA provenance predicate (parameters,
the schedule, precision, the corpora and base model it depends on, byproducts) and govray's
coverage predicate (every ledger entry by corpus, tensor and layer). ``govray.provenance.attest``
wraps them in signed in-toto statements about the model files.

Example::

    root = trust_root_sha256(trust)
    predicate = provenance(spec, loaded.state, spec.routing, checkpoint, finished_on=moment, trust_root=root)
    counts = coverage(loaded.state, spec.routing)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from safetensors import safe_open

from govray.core.canonical import canonical_json, sha256_hex
from govray.core.errors import AttestationError
from govray.data.shards import ShardManifest, ShardSet
from govray.governance.routing import RoutingTable, adapter_of_tensor, layer_label
from govray.train.checkpoints.files import (
    CheckpointState,
    model_file,
)
from govray.train.reproduce.record import ReproducibilityRecord
from govray.train.runspec import RunSpec
from govray.train.step.ledger import Ledger

BUILD_TYPE = "https://govray.dev/buildtypes/governed-training/v1"
BUILDER_ID = "https://govray.dev/builder/platform"


@dataclass(frozen=True)
class Derivation:
    """How a model version was derived from an attested one without training: the adapters it no
    longer carries, the corpora that leaves out entirely, and the source's provenance envelope."""

    removed_adapters: tuple[str, ...]
    excluded_corpora: tuple[str, ...]
    source_uri: str  # govray:model/NAME/VERSION
    source_attestation_sha256: str  # of the source version's provenance envelope


def provenance(
    spec: RunSpec,
    state: CheckpointState,
    routing: RoutingTable,
    checkpoint: Path,
    derivation: Derivation | None = None,
    *,
    finished_on: datetime,
    trust_root: str,
) -> dict[str, Any]:
    """The SLSA Provenance v1 predicate of a checkpoint (or of a model version derived from one);
    ``trust_root``: the sha256 of the trust root the checkpoint was verified against
    (``core.keys.trust_root``), cited so a verifier checks it holds the same one."""
    manifest = ShardSet.open(Path(spec.shard_root)).manifest
    excluded = sorted({*spec.excluded_corpora, *(derivation.excluded_corpora if derivation else ())})
    matrix = coverage_matrix(Ledger.from_json(state.ledger), routing)
    return {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": _external_parameters(spec, excluded, derivation),
            "internalParameters": {
                "step": state.step,
                "epoch": state.epoch,
                "schedule_sha256": state.schedule_digest,
                # The operator's trust root the checkpoint verified against (govray keys export-root).
                "trust_root": {"sha256": trust_root},
                "shards": manifest.key,
                "reproducibility": state.reproducibility,
                # [[from_step, workers], ...]: the world sizes it trained on. Summation order follows
                # them: a replay that reproduces these weights bit for bit follows the same history.
                "world_history": world_history(state),
                # Removal = replay: bit for bit, or within this stated tolerance (GPUs).
                "replay_equivalence": _replay_equivalence(state.reproducibility),
                "precision": precision_statement(
                    spec.settings.precision if spec.settings is not None else None, routing, checkpoint
                ),
            },
            "resolvedDependencies": _dependencies(manifest, excluded, state, derivation),
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


def _external_parameters(spec: RunSpec, excluded: list[str], derivation: Derivation | None) -> dict[str, Any]:
    """What the run was asked to do: trial, hyperparameters, seeds, length, exclusions, policy."""
    return {
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
            # The policy envelope's signer keyid, or "unsigned" (a run the operator let through).
            "signer": spec.policy_signer,
            "trust_root": {"sha256": spec.policy_trust_sha256},
        },
        # The code the workers imported: the trial's snapshot, file by file.
        "code": _code(spec.reproducibility),
    }


def _code(reproducibility: dict[str, Any]) -> dict[str, Any]:
    code = reproducibility.get("code") or {}
    return {"module": code.get("module"), "sha256": code.get("digest"), "files": code.get("files", {})}


def _dependencies(
    manifest: ShardManifest, excluded: list[str], state: CheckpointState, derivation: Derivation | None
) -> list[dict[str, Any]]:
    """What the model was built from: every corpus (with its credential and counts), the weights
    it started from, and for a derived version the source model."""
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
    return dependencies


def world_history(state: CheckpointState) -> list[list[int]]:
    """The checkpoint's world-size history: [from step, workers] from step 0, and at each resize."""
    return [[int(step), int(workers)] for step, workers in state.world_history]


_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def precision_statement(setting: str | None, routing: RoutingTable, checkpoint: Path) -> dict[str, Any]:
    """What the run computed and kept numbers in: its precision setting (bf16 / fp16: autocast, or
    FSDP's mixed precision); every trainable tensor (adapters included), its optimizer state and
    its reduction in float32 (``train/step/trainable.py``); and the dtypes the frozen base tensors — no
    route may update them — are stored in (they keep the dtype the base was loaded in), read
    from the base file's header (a sharded checkpoint: rank 0's shard file)."""
    frozen = {
        alias
        for index, info in enumerate(routing.parameters)
        if not any(mask[index] for mask in routing.masks.values())
        for alias in (info.name, *info.aliases)
    }
    path = model_file(checkpoint)
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


def _layer_name(index: int | None, names: list[str], tensor: str) -> str:
    return layer_label(names[index] if index is not None else None, adapter_of_tensor(tensor))
