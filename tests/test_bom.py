"""`govray export bom`: a CycloneDX 1.6 ML-BOM of a registered version that cyclonedx-python-lib's
schema validator (a library govray did not write) accepts, listing every file of the model by
sha256, every corpus with its credential, fingerprint and the examples that reached the model,
and the dependencies its provenance attestation resolved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from govray.cli import main
from govray.core.canonical import file_sha256
from govray.data.shards import ShardSet
from govray.platform.registry.versions import RegisteredVersion
from govray.provenance.eu_summary import eu_summary
from govray.provenance.locations import run_spec_of
from tests.helpers.golden import REMOVED_ADAPTER, RegisteredPair


def exported(pair: RegisteredPair, version: RegisteredVersion, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["export", "bom", version.ref, "--format", "cyclonedx", "--database", pair.store.url]) == 0
    return capsys.readouterr().out


def properties(component: dict[str, Any]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for entry in component.get("properties", []):
        found.setdefault(entry["name"], []).append(entry["value"])
    return found


@pytest.mark.parametrize("which", ["version", "without_adapter"])
def test_the_bom_validates_against_the_cyclonedx_1_6_schema(
    registered_pair: RegisteredPair, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    text = exported(registered_pair, getattr(registered_pair, which), capsys)
    validator = JsonStrictValidator(SchemaVersion.V1_6)
    assert validator.validate_str(text) is None
    broken = json.loads(text)
    broken["components"][0]["type"] = "corpus"  # the validator does refuse what the schema forbids
    assert validator.validate_str(json.dumps(broken)) is not None


def test_the_bom_lists_every_corpus_with_its_credential_and_count(
    registered_pair: RegisteredPair, capsys: pytest.CaptureFixture[str]
) -> None:
    version = registered_pair.without_adapter
    bom = json.loads(exported(registered_pair, version, capsys))
    spec = run_spec_of(version.directory)
    manifest = ShardSet.open(Path(spec.shard_root)).manifest
    summary = eu_summary(
        version.directory, model=version.model, version="x", excluded_corpora=version.excluded_corpora
    )
    examples = {c.corpus_id: c.examples for group in summary.sources for c in group.corpora}
    data = {c["name"]: c for c in bom["components"] if c["bom-ref"].startswith("govray:corpus/")}
    assert set(data) == {corpus.corpus_id for corpus in manifest.corpora}
    for corpus in manifest.corpora:
        component, listed = data[corpus.corpus_id], properties(data[corpus.corpus_id])
        assert component["type"] == "data"
        assert component["hashes"] == [{"alg": "SHA-256", "content": corpus.fingerprint}]
        for field, value in corpus.credential.items():
            shown = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            assert listed[f"govray:credential:{field}"] == [shown]
        assert listed["govray:examples-in-model"] == [str(examples[corpus.corpus_id])]
        assert listed["govray:rows"] == [str(corpus.rows)]
    assert sum(examples.values()) > 0
    for corpus in version.excluded_corpora:  # listed, with no example in the model, not depended on
        assert properties(data[corpus])["govray:examples-in-model"] == ["0"]
        assert f"govray:corpus/{corpus}" not in bom["dependencies"][0]["dependsOn"]


def test_the_model_component_hashes_every_file_and_names_policy_and_removed_adapters(
    registered_pair: RegisteredPair, capsys: pytest.CaptureFixture[str]
) -> None:
    version = registered_pair.without_adapter
    bom = json.loads(exported(registered_pair, version, capsys))
    model = bom["metadata"]["component"]
    assert model["type"] == "machine-learning-model" and model["bom-ref"] == version.uri
    files = {c["bom-ref"].rsplit("/", 1)[1]: c["hashes"][0]["content"] for c in model["components"]}
    on_disk = {p.name: file_sha256(p) for p in version.directory.iterdir() if p.is_file()}
    assert files == on_disk
    assert properties(model)["govray:removed-adapter"] == [REMOVED_ADAPTER]
    spec = run_spec_of(version.directory)
    policy = next(c for c in bom["components"] if c["bom-ref"].startswith("govray:policy/"))
    assert policy["hashes"][0]["content"] == spec.policy_digest
    depends = bom["dependencies"][0]
    assert depends["ref"] == version.uri and policy["bom-ref"] in depends["dependsOn"]
    assert registered_pair.version.uri in depends["dependsOn"]  # the version the adapter left
    source = properties(bom_of(registered_pair, capsys)["metadata"]["component"])
    assert source["govray:adapter"] == [REMOVED_ADAPTER] and "govray:removed-adapter" not in source


def bom_of(pair: RegisteredPair, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(exported(pair, pair.version, capsys))
    return loaded
