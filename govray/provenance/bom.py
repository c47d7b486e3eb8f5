"""A CycloneDX 1.6 ML-BOM of a registered model version (JSON), for teams that file SBOMs.

- ``metadata.component``: the model, a ``machine-learning-model`` component: the base weights'
  sha256 as its hash, every file of the version's directory as a nested ``file`` component with
  its sha256, each adapter as a nested ``machine-learning-model``, the removed adapters and the
  excluded corpora as properties, and a model card whose datasets are the corpora that trained it;
- one ``data`` component per corpus: its fingerprint as the SHA-256 hash, its credential (per-row
  credential columns too) and sizes as properties, ``govray:examples-in-model`` the examples that
  reached this version (as the EU training-content summary counts them);
- the signed depth policy as a ``data`` component of type ``configuration``, by its sha256;
- every other resolved dependency of the provenance attestation (the checkpoint a fine-tuning run
  started from, its base model's attestation, the version an adapter was removed from);
- ``dependencies``: the model depends on the policy and on what its provenance attestation
  resolved (corpora left out of this version are listed, not depended on).

Properties use the ``govray:`` namespace. The attestation's envelope sha256 ties the BOM to the
statement ``govray verify`` checks.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from pathlib import Path
from typing import Any

from govray.core.canonical import file_sha256
from govray.core.version import GOVRAY_VERSION
from govray.provenance.eu_summary import CorpusSource, EuSummary

SPEC_VERSION = "1.6"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def cyclonedx_bom(
    directory: Path,
    summary: EuSummary,
    provenance: dict[str, Any],
    *,
    model_uri: str,
    removed_adapters: tuple[str, ...],
    attestation_sha256: str,
) -> dict[str, Any]:
    """The ML-BOM of the model in ``directory`` (a registered version's), from its training-content
    ``summary`` and its provenance statement (``provenance``, an in-toto Statement v1)."""
    general = summary.general
    corpora = [corpus for group in summary.sources for corpus in group.corpora]
    excluded = set(summary.processing.excluded_corpora)
    build = provenance["predicate"]["buildDefinition"]
    policy = build["externalParameters"]["policy"]
    policy_ref = f"govray:policy/{policy['name']}/{policy['version']}"
    model = {
        "type": "machine-learning-model",
        "bom-ref": model_uri,
        "name": general.model,
        "version": general.version,
        "hashes": [_sha256(general.base_model_sha256)],
        "properties": _properties(
            {
                "govray:base-model-sha256": general.base_model_sha256,
                "govray:policy": general.policy,
                "govray:policy-sha256": general.policy_sha256,
                "govray:policy-signer": general.policy_signer,
                "govray:step": general.step,
                "govray:examples-in-model": general.examples,
                "govray:provenance-attestation-sha256": attestation_sha256,
            },
            [("govray:adapter", name) for name in general.adapters]
            + [("govray:removed-adapter", name) for name in removed_adapters]
            + [("govray:excluded-corpus", name) for name in sorted(excluded)],
        ),
        "components": _model_files(directory, model_uri),
        "modelCard": {
            "modelParameters": {
                "datasets": [{"ref": _corpus_ref(c.corpus_id)} for c in corpora if c.examples],
            },
        },
    }
    dependencies = [_dependency(item) for item in build["resolvedDependencies"]]
    components = [_corpus(corpus) for corpus in corpora]
    components.append(
        {
            "type": "data",
            "bom-ref": policy_ref,
            "name": str(policy["name"]),
            "version": str(policy["version"]),
            "hashes": [_sha256(str(policy["sha256"]))],
            "data": [{"type": "configuration", "name": f"depth policy {policy['name']}"}],
        }
    )
    corpus_refs = {_corpus_ref(c.corpus_id) for c in corpora}
    components.extend(component for component, _ in dependencies if component["bom-ref"] not in corpus_refs)
    depends_on = [policy_ref] + [
        component["bom-ref"] for component, item in dependencies if not _left_out(item, excluded)
    ]
    return {
        "$schema": "http://cyclonedx.org/schema/bom-1.6.schema.json",
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{uuid.uuid4()}",
        "version": 1,
        "metadata": {
            "timestamp": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
            "tools": {"components": [{"type": "application", "name": "govray", "version": GOVRAY_VERSION}]},
            "component": model,
        },
        "components": components,
        "dependencies": [
            {"ref": model_uri, "dependsOn": sorted(set(depends_on))},
            *({"ref": component["bom-ref"]} for component in components),
        ],
    }


def _model_files(directory: Path, model_uri: str) -> list[dict[str, Any]]:
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        adapter = re.fullmatch(r"adapter-(.+)\.safetensors", name)
        files.append(
            {
                "type": "machine-learning-model" if adapter else "file",
                "bom-ref": f"{model_uri}/{name}",
                "name": adapter.group(1) if adapter else name,
                "hashes": [_sha256(file_sha256(path))],
                **({"properties": _properties({"govray:file": name}, [])} if adapter else {}),
            }
        )
    return files


def _corpus(corpus: CorpusSource) -> dict[str, Any]:
    credential = [(f"govray:credential:{key}", value) for key, value in sorted(corpus.credential.items())]
    columns = [(f"govray:credential-column:{k}", v) for k, v in sorted(corpus.credential_columns.items())]
    return {
        "type": "data",
        "bom-ref": _corpus_ref(corpus.corpus_id),
        "name": corpus.corpus_id,
        "hashes": [_sha256(corpus.fingerprint)],
        "properties": _properties(
            {
                "govray:fingerprint": corpus.fingerprint,
                "govray:license-class": corpus.license_class,
                "govray:source-type": corpus.source_type,
                "govray:role": corpus.role,
                "govray:rows": corpus.rows,
                "govray:train-rows": corpus.train_rows,
                "govray:holdout-rows": corpus.holdout_rows,
                "govray:examples-in-model": corpus.examples,
                "govray:excluded": corpus.excluded,
            },
            credential
            + columns
            + [("govray:jurisdiction", j) for j in corpus.jurisdictions]
            + [("govray:sensitivity", s) for s in corpus.sensitivities],
        ),
        "data": [
            {
                "type": "dataset",
                "name": corpus.corpus_id,
                "classification": ", ".join(corpus.sensitivities),
                **({"description": corpus.description} if corpus.description else {}),
            }
        ],
    }


def _dependency(item: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A resolved dependency of the provenance statement as a component (corpora: their ref)."""
    uri = str(item.get("uri", ""))
    digest = str(item.get("digest", {}).get("sha256", ""))
    if uri.startswith("govray:corpus/"):
        return {"bom-ref": _corpus_ref(uri.removeprefix("govray:corpus/"))}, item
    component: dict[str, Any] = {
        "type": "machine-learning-model",
        "bom-ref": uri,
        "name": str(item.get("name", uri)),
        "properties": _properties({"govray:uri": uri}, sorted(item.get("annotations", {}).items())),
    }
    if _SHA256.match(digest):
        component["hashes"] = [_sha256(digest)]
    return component, item


def _left_out(item: dict[str, Any], excluded: set[str]) -> bool:
    return bool(item.get("annotations", {}).get("excluded")) or item.get("name") in excluded


def _corpus_ref(corpus_id: str) -> str:
    return f"govray:corpus/{corpus_id}"


def _sha256(digest: str) -> dict[str, str]:
    return {"alg": "SHA-256", "content": digest}


def _properties(named: dict[str, Any], repeated: list[tuple[str, Any]]) -> list[dict[str, str]]:
    """CycloneDX properties (name/value strings); a mapping or list value is written as JSON."""
    pairs = [*named.items(), *repeated]
    return [{"name": name, "value": _text(value)} for name, value in pairs if value not in ("", None)]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)
