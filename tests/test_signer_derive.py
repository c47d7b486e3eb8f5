"""``model remove-adapter``'s version is sealed by the platform's signer only as the signer
recomputes it from the verified source: the asking process stages the folder, the signer checks
every file (the base and the other adapters by digest, the run spec as signed, the derived state
and optimizer byte for byte) and records the derivation, which its attestation of the folder then
states. A folder that kept the adapter, kept its tensors in the ledger, swapped the base or holds
one file more is refused; so is a source attestation about another model or signed by a key the
operator does not trust."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from threading import Thread

import pytest

from govray.core.dsse import Envelope, sign_envelope
from govray.core.errors import AttestationError, SignatureError
from govray.core.keys import KeyRole, KeyType, SigningKey, platform_key
from govray.core.settings import operator_trust
from govray.platform.registry.versions import provenance_record, storage_of
from govray.provenance.derivation import EMPTY_OPTIMIZER, adapter_file, derived_state
from govray.provenance.locations import signed_run_spec
from govray.provenance.statement_types import PAYLOAD_TYPE
from govray.signer.attesting import attest
from govray.signer.server import SignerServer
from govray.signer.service import Signer
from govray.train.checkpoints.files import MODEL_FILE, load_checkpoint, model_file, stage_checkpoint
from govray.train.checkpoints.manifest import MANIFEST_FILE, SIGNATURE_FILE
from govray.train.checkpoints.signer import SignerClient
from govray.train.runspec import RUN_SPEC_FILE
from tests.helpers.attest import statement_of
from tests.helpers.golden import REMOVED_ADAPTER, RegisteredPair


@pytest.fixture(scope="module")
def signer_socket() -> Iterator[Path]:
    """A signer with this machine's platform keys, served by a thread (its own derivation record)."""
    short = Path(tempfile.mkdtemp(prefix="gv-", dir="/tmp"))
    signer = Signer(platform_key(), short / "state", platform_key(keytype=KeyType.ECDSA))
    server = SignerServer(signer, short / "s.sock")
    Thread(target=server.serve_forever, daemon=True).start()
    yield server.path
    server.shutdown()
    server.server_close()
    shutil.rmtree(short, ignore_errors=True)


def staged(
    pair: RegisteredPair, number: int, *, keep_adapter: bool = False, keep_ledger: bool = False
) -> Path:
    """The version of ``pair.version`` without REMOVED_ADAPTER staged as ``model remove-adapter``
    stages it, at ``STORAGE/models/NAME/NUMBER`` (or, asked, with what a bad-faith stager keeps)."""
    source = pair.version.directory
    trust = operator_trust()
    loaded = load_checkpoint(source, trust)
    directory = storage_of(pair.version) / "models" / pair.version.model / str(number)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    shutil.copy(model_file(source), directory / MODEL_FILE)
    for path in sorted(source.glob("adapter-*.safetensors")):
        if keep_adapter or path.name != adapter_file(REMOVED_ADAPTER):
            shutil.copy(path, directory / path.name)
    (directory / RUN_SPEC_FILE).write_text(signed_run_spec(source, trust).model_dump_json(indent=1))
    state = derived_state(loaded.state, REMOVED_ADAPTER)
    if keep_ledger:
        state = state.model_copy(update={"ledger": loaded.state.ledger})
    stage_checkpoint(directory, EMPTY_OPTIMIZER, state)
    return directory


def derive(socket: Path, pair: RegisteredPair, directory: Path, envelope: str | None = None) -> object:
    source_attestation = provenance_record(pair.store, pair.version).envelope_json
    return SignerClient(socket).derive(
        str(pair.version.directory.resolve()),
        REMOVED_ADAPTER,
        str(directory.resolve()),
        pair.version.uri,
        envelope if envelope is not None else source_attestation,
    )


def test_an_honest_derived_version_is_sealed_and_its_attestation_states_the_derivation(
    registered_pair: RegisteredPair, signer_socket: Path, tmp_path: Path
) -> None:
    directory = staged(registered_pair, 901)
    sealed = derive(signer_socket, registered_pair, directory)
    (directory / MANIFEST_FILE).write_bytes(sealed.manifest)  # type: ignore[attr-defined]
    (directory / SIGNATURE_FILE).write_text(sealed.envelope.to_json())  # type: ignore[attr-defined]
    written = attest(directory, destination=tmp_path / "derived", socket=signer_socket)
    external = statement_of(written.provenance)["predicate"]["buildDefinition"]["externalParameters"]
    assert external["removed_adapters"] == [REMOVED_ADAPTER]
    dependencies = statement_of(written.provenance)["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert registered_pair.version.uri in [d.get("uri") for d in dependencies]
    assert adapter_file(REMOVED_ADAPTER) not in written.subjects
    shutil.rmtree(directory)


@pytest.mark.parametrize(
    ("mutation", "named"),
    [
        ("keep_adapter", adapter_file(REMOVED_ADAPTER)),
        ("keep_ledger", "state.json"),
        ("extra_file", "notes.txt"),
        ("swapped_base", MODEL_FILE),
    ],
)
def test_a_folder_that_is_not_the_source_without_the_adapter_is_refused(
    registered_pair: RegisteredPair, signer_socket: Path, mutation: str, named: str
) -> None:
    directory = staged(
        registered_pair, 902, keep_adapter=mutation == "keep_adapter", keep_ledger=mutation == "keep_ledger"
    )
    if mutation == "extra_file":
        (directory / "notes.txt").write_text("an extra file")
    if mutation == "swapped_base":
        data = bytearray((directory / MODEL_FILE).read_bytes())
        data[-1] ^= 1
        (directory / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(SignatureError, match=rf"not .* without adapter .*files that differ: .*{named}"):
        derive(signer_socket, registered_pair, directory)
    assert not (directory / MANIFEST_FILE).exists()
    shutil.rmtree(directory)


def test_a_source_attestation_about_another_model_or_by_an_untrusted_key_is_refused(
    registered_pair: RegisteredPair, signer_socket: Path
) -> None:
    directory = staged(registered_pair, 903)
    other = provenance_record(registered_pair.store, registered_pair.without_adapter).envelope_json
    with pytest.raises(AttestationError, match="not about"):
        derive(signer_socket, registered_pair, directory, other)
    engineer = SigningKey.generate(KeyRole.PLATFORM)
    genuine = Envelope.model_validate_json(
        provenance_record(registered_pair.store, registered_pair.version).envelope_json
    )
    payload = json.loads(genuine.payload_bytes())
    payload["predicate"]["buildDefinition"]["externalParameters"]["excluded_corpora"] = ["digits-public"]
    forged = sign_envelope(json.dumps(payload).encode(), PAYLOAD_TYPE, engineer).to_json()
    with pytest.raises(SignatureError, match=f"key {engineer.keyid} is not trusted"):
        derive(signer_socket, registered_pair, directory, forged)
    shutil.rmtree(directory)


def test_a_derived_version_is_never_sealed_into_a_runs_folder(
    registered_pair: RegisteredPair, signer_socket: Path
) -> None:
    run_folder = registered_pair.version.directory.parent / "checkpoint_99999999"
    with pytest.raises(SignatureError, match="STORAGE/models/NAME/VERSION"):
        derive(signer_socket, registered_pair, run_folder)
    assert not run_folder.exists()
