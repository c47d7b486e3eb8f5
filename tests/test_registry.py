"""The model registry: versions of checkpoints with tags; removing an adapter makes a new version
without its file, its tensors out of the ledger, and an attestation naming the excluded corpora;
fine-tuning from a version lists that version's attestation as the base model."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from govray.cli import main
from govray.config.searcher import Length
from govray.core.errors import AttestationError
from govray.core.keys import platform_key, platform_trust
from govray.platform.registry.register import register, remove_adapter, set_tags, start_reference
from govray.platform.registry.versions import (
    RegisteredVersion,
    RegistryError,
    envelope_sha256,
    provenance_record,
    resolve,
    version_attestations,
    versions,
)
from govray.platform.run.runner import run_trial
from govray.provenance.recompute import check_attested_ledger
from govray.provenance.row_reach import row_reach
from govray.provenance.verify import verify_attestation
from govray.tracking.audit import AuditLog
from govray.tracking.registry import list_models
from govray.train.checkpoints.files import MODEL_FILE, CheckpointState, find_checkpoints
from govray.train.step.ledger import Ledger
from tests.helpers.golden import GoldenRun

MODEL = "digits-local"
ADAPTER = "pii-lora"


def statement(envelope_json: str) -> dict[str, Any]:
    return json.loads(base64.b64decode(json.loads(envelope_json)["payload"]))


def ledger_of(directory: Path) -> Ledger:
    return Ledger.from_json(
        CheckpointState.model_validate_json((directory / "state.json").read_text()).ledger
    )


@pytest.fixture(scope="module")
def registered(golden_local_epoch: GoldenRun) -> RegisteredVersion:
    final = find_checkpoints(golden_local_epoch.outcome.run_dir)[-1]
    return register(
        golden_local_epoch.store, MODEL, final, description="one epoch", tags={"stage": "candidate"}
    )


@pytest.fixture(scope="module")
def without_pii(golden_local_epoch: GoldenRun, registered: RegisteredVersion) -> RegisteredVersion:
    return remove_adapter(golden_local_epoch.store, registered.ref, ADAPTER)


def test_a_registered_version_resolves_lists_and_keeps_its_tags(
    golden_local_epoch: GoldenRun, registered: RegisteredVersion
) -> None:
    store = golden_local_epoch.store
    assert resolve(store, f"{MODEL}:{registered.version}").record.id == registered.record.id
    assert registered.tags == {"stage": "candidate"} and registered.directory == Path(
        registered.checkpoint.path
    )
    assert registered.checkpoint.trial_id == golden_local_epoch.outcome.trial_id
    tagged = set_tags(store, registered.ref, {"approved-by": "legal"}, remove=["stage"])
    assert tagged.tags == {"approved-by": "legal"} == resolve(store, registered.ref).tags
    with pytest.raises(RegistryError, match="has no tag 'stage'"):
        set_tags(store, registered.ref, {}, remove=["stage"])
    with pytest.raises(RegistryError, match="letters, digits"):
        set_tags(store, registered.ref, {"bad tag!": "x"})
    assert (MODEL, len(versions(store, MODEL))) in [(m.name, n) for m, n in list_models(store)]
    actions = [json.loads(e.payload_json) for e in AuditLog(store).list(event_type="registry.changed")]
    assert {"register", "tag"} <= {a["action"] for a in actions if a["model"] == MODEL}
    with pytest.raises(RegistryError, match="no registered model 'nope'"):
        resolve(store, "nope:1")
    with pytest.raises(RegistryError, match="has no version 99"):
        resolve(store, f"{MODEL}:99")
    with pytest.raises(RegistryError, match="expected a number from 1 to"):
        resolve(store, "digits:one")


def test_registering_attests_the_checkpoint_for_the_version(
    golden_local_epoch: GoldenRun, registered: RegisteredVersion
) -> None:
    records = version_attestations(golden_local_epoch.store, registered)
    assert len(records) == 2 and all(r.checkpoint_id == registered.checkpoint.id for r in records)
    trust = platform_trust(platform_key())
    for record in records:
        path = registered.directory.parent / f"verify-{record.id}.dsse.json"
        path.write_text(record.envelope_json)
        try:
            verify_attestation(path, model_dir=registered.directory, trust=trust)
        finally:
            path.unlink()


def test_a_checkpoint_the_store_does_not_know_is_refused(
    golden_local_epoch: GoldenRun, tmp_path: Path
) -> None:
    with pytest.raises(RegistryError, match="not a checkpoint this tracking store recorded"):
        register(golden_local_epoch.store, MODEL, tmp_path)


def test_removing_the_adapter_makes_a_version_without_its_file_tensors_or_corpora(
    registered: RegisteredVersion, without_pii: RegisteredVersion
) -> None:
    assert (
        without_pii.version == registered.version + 1 and without_pii.record.parent_id == registered.record.id
    )
    assert without_pii.removed_adapters == (ADAPTER,)
    assert not (without_pii.directory / f"adapter-{ADAPTER}.safetensors").exists()
    base, source_base = (
        load_file(without_pii.directory / MODEL_FILE),
        load_file(registered.directory / MODEL_FILE),
    )
    assert base.keys() == source_base.keys() and all(base[k].equal(source_base[k]) for k in base)

    source = ledger_of(registered.directory)
    kept = ledger_of(without_pii.directory)
    assert not [t for t in kept.tensors() if t.startswith("adapter/")]
    assert kept.entries == {
        k: e for k, e in source.entries.items() if not k[1].startswith(f"adapter/{ADAPTER}/")
    }
    only_adapter = {
        c for c in source.corpora() if all(t.startswith(f"adapter/{ADAPTER}/") for t in _tensors(source, c))
    }
    assert without_pii.excluded_corpora == tuple(sorted(only_adapter)) == ("digits-writers",)


def test_the_new_version_is_attested_with_the_excluded_corpora_and_its_source(
    golden_local_epoch: GoldenRun, registered: RegisteredVersion, without_pii: RegisteredVersion
) -> None:
    store = golden_local_epoch.store
    record = provenance_record(store, without_pii)
    provenance = statement(record.envelope_json)
    assert [s["name"] for s in provenance["subject"]] == [MODEL_FILE]
    parameters = provenance["predicate"]["buildDefinition"]["externalParameters"]
    assert parameters["excluded_corpora"] == ["digits-writers"] and parameters["removed_adapters"] == [
        ADAPTER
    ]
    dependencies = {d["name"]: d for d in provenance["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert dependencies["digits-writers"]["annotations"]["excluded"] is True
    assert dependencies["source-model"]["uri"] == f"govray:model/{MODEL}/{registered.version}"
    assert dependencies["source-model"]["digest"]["sha256"] == envelope_sha256(
        provenance_record(store, registered)
    )

    trust = platform_trust(platform_key())
    stem = without_pii.directory.parents[2] / "attestations" / "models" / MODEL / str(without_pii.version)
    written = stem.with_name(f"{stem.name}.provenance.dsse.json")
    assert written.read_text() == record.envelope_json
    assert verify_attestation(written, model_dir=without_pii.directory, trust=trust).statement == provenance
    # The source version's attestation names the adapter file, which the new version lacks.
    source_envelope = without_pii.directory.parent / "source.dsse.json"
    source_envelope.write_text(provenance_record(store, registered).envelope_json)
    with pytest.raises(AttestationError, match=f"adapter-{ADAPTER}.safetensors: attested but missing"):
        verify_attestation(source_envelope, model_dir=without_pii.directory, trust=trust)
    source_envelope.unlink()
    # Its coverage is what the schedule gives, less the removed adapter's tensors.
    coverage = written.with_name(written.name.replace(".provenance.", ".coverage."))
    verified = verify_attestation(coverage, model_dir=without_pii.directory, trust=trust)
    assert check_attested_ledger(verified.statement, without_pii.directory, trust) == len(
        ledger_of(without_pii.directory).entries
    )


def test_an_adapter_the_version_lacks_is_refused_by_name(
    golden_local_epoch: GoldenRun, without_pii: RegisteredVersion
) -> None:
    with pytest.raises(RegistryError, match=f"carries no adapter '{ADAPTER}' \\(adapters: none\\)"):
        remove_adapter(golden_local_epoch.store, without_pii.ref, ADAPTER)


def test_fine_tuning_from_a_version_lists_its_attestation_as_the_base_model(
    golden_local_epoch: GoldenRun, without_pii: RegisteredVersion
) -> None:
    store = golden_local_epoch.store
    config = golden_local_epoch.config
    short = config.model_copy(
        update={"searcher": config.searcher.model_copy(update={"max_length": Length(batches=3)})}
    )
    outcome = run_trial(
        short,
        golden_local_epoch.checked,
        store.get_experiment(config.name),
        golden_local_epoch.shard_root,
        store,
        report_every=3,
        start_checkpoint=without_pii.directory,
        start_model=start_reference(store, without_pii),
    )
    final = find_checkpoints(outcome.run_dir)[-1]
    envelope = final.parents[2] / "attestations" / final.parent.name / f"{final.name}.provenance.dsse.json"
    provenance = statement(envelope.read_text())
    dependencies = {d["name"]: d for d in provenance["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert dependencies["base-model"]["uri"] == f"govray:model/{MODEL}/{without_pii.version}"
    assert dependencies["base-model"]["digest"]["sha256"] == envelope_sha256(
        provenance_record(store, without_pii)
    )
    assert (
        json.loads(store.get_trial(outcome.trial_id).source_checkpoint_json or "{}")["model"]
        == without_pii.ref
    )
    # The recorded schedule, plus the version's ledger it started from, gives exactly that ledger.
    trust = platform_trust(platform_key())
    coverage = envelope.with_name(envelope.name.replace(".provenance.", ".coverage."))
    assert check_attested_ledger(
        verify_attestation(coverage, model_dir=final, trust=trust).statement, final, trust
    )
    # The run starts from the version's ledger: nothing of the removed adapter's past reaches it.
    started = ledger_of(final)
    for (corpus, tensor), entry in ledger_of(without_pii.directory).entries.items():
        assert started.entries[corpus, tensor].examples >= entry.examples


def test_the_cli_lists_describes_and_refuses_with_exit_17(
    golden_local_epoch: GoldenRun, without_pii: RegisteredVersion, capsys: pytest.CaptureFixture[str]
) -> None:
    database = ["--database", golden_local_epoch.config.database_url]
    assert main(["model", "describe", without_pii.ref, *database]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["excluded_corpora"] == ["digits-writers"] and described["removed_adapters"] == [ADAPTER]
    assert main(["model", "versions", MODEL, *database]) == 0
    assert "digits-writers" in capsys.readouterr().out
    assert main(["model", "tag", without_pii.ref, "reviewed=yes", *database]) == 0
    assert resolve(golden_local_epoch.store, without_pii.ref).tags == {"reviewed": "yes"}
    assert main(["model", "remove-adapter", without_pii.ref, "--adapter", ADAPTER, *database]) == 17
    assert "carries no adapter" in capsys.readouterr().err


def _tensors(ledger: Ledger, corpus: str) -> list[str]:
    return [tensor for name, tensor in ledger.entries if name == corpus]


def test_the_row_lookup_names_the_versions_that_still_carry_a_pii_row(
    golden_local_epoch: GoldenRun,
    registered: RegisteredVersion,
    without_pii: RegisteredVersion,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An erasure request's answer: the version with the PII adapter carries the row, the one
    without that adapter does not — in the CLI's table too, not only its JSON."""
    store = golden_local_epoch.store
    trial_id = golden_local_epoch.outcome.trial_id
    for row in range(20):
        reach = next(t for t in row_reach(store, "digits-writers", row).trials if t.trial_id == trial_id)
        if reach.step_count:
            break
    else:
        pytest.fail("none of the first 20 PII rows reached a step of a whole epoch")
    carried = {(m.model, m.version): m.carries_row for m in reach.models if m.model == MODEL}
    assert carried == {(MODEL, registered.version): True, (MODEL, without_pii.version): False}
    database = ["--database", golden_local_epoch.config.database_url]
    from govray.cli.common import console

    monkeypatch.setattr(console, "width", 250)  # (a terminal wide enough that no cell folds)
    assert main(["lineage", "row", "digits-writers", str(row), *database]) == 0
    shown = capsys.readouterr().out
    assert f"{MODEL}:{registered.version} carries it" in shown
    assert f"{MODEL}:{without_pii.version} not: removed {ADAPTER}" in shown
    assert f"trial {trial_id} updated: adapter/{ADAPTER}/hidden: lora_A, lora_B" in " ".join(shown.split())
