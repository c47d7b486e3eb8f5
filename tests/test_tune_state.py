"""Ray Tune's restore state is unpickled only as the platform's signer sealed it (issue 49, item 7).

A search's driver seals each new Tune state (``tuner.pkl``, the searcher's pickles, the JSON
state) into ``SEARCH/tune-state-SEQUENCE`` over the search's own channel; a resume puts back
exactly the newest sealed copy that verifies. What a bad-faith engineer with write access to the
storage tries: a pickle of their own in place of ``tuner.pkl`` or beside it (replaced and removed
before Tune reads anything), the sealed copy changed (refused: nothing is put back, the resume
stops), a copy sealed by a key of their own or for another search (refused), a run's channel or an
old sequence asked to seal the search's state (the signer refuses). The whole path — a real search
killed and resumed with a planted ``tuner.pkl`` — is the slow tier's
``tests/test_search.py::test_an_interrupted_search_resumes_without_rerunning_finished_trials``.

A signer in a thread of this process, with a key of the test's; no Ray."""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from threading import Thread

import boto3
import pytest
from moto.server import ThreadedMotoServer

from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey, platform_trust
from govray.core.storage import open_storage
from govray.platform.search.tune_state import StateSealer, restore_sealed_state, tune_files
from govray.signer.server import SignerServer
from govray.signer.service import Signer
from govray.train.checkpoints.manifest import CheckpointError
from govray.train.checkpoints.signer import SignerChannel, SignerClient
from govray.train.checkpoints.state_seals import STATE_SIGNATURE, seal_state_folder, state_folder
from tests.helpers.planted import planted_pickle
from tests.helpers.ports import free_port

KEY = SigningKey.generate(KeyRole.PLATFORM)
TRUST = platform_trust(KEY)


@pytest.fixture
def signer_socket() -> Iterator[Path]:
    """A signer serving in a thread of this process (a short path: a socket's is at most 107 bytes)."""
    home = Path(tempfile.mkdtemp(prefix="gt-", dir="/tmp"))
    server = SignerServer(Signer(KEY, home / "state"), home / "s.sock")
    Thread(target=server.serve_forever, daemon=True).start()
    yield server.path
    server.shutdown()
    server.server_close()
    shutil.rmtree(home, ignore_errors=True)


def channel_for(socket: Path, directory: Path) -> SignerChannel:
    capability, _ = SignerClient(socket).open_run(str(directory.resolve()))
    return SignerChannel(socket=str(socket), capability=capability, run_dir=str(directory.resolve()))


def tune_state(search: Path, trials: int) -> dict[str, bytes]:
    """A search directory's Tune state as Tune writes it (its content is Tune's business)."""
    search.mkdir(parents=True, exist_ok=True)
    files = {
        "tuner.pkl": pickle.dumps({"trainable": "tune_trial", "trials": trials}),
        "searcher-state-2026-11-29.pkl": pickle.dumps(list(range(trials))),
        "experiment_state-2026-11-29.json": json.dumps({"trials": trials}).encode(),
        "basic-variant-state-2026-11-29.json": pickle.dumps({"variants": trials}),  # (Tune's: a pickle)
    }
    for name, data in files.items():
        (search / name).write_bytes(data)
    return files


@pytest.fixture
def sealed_search(signer_socket: Path, tmp_path: Path) -> tuple[Path, StateSealer, dict[str, bytes]]:
    """A search whose driver sealed two states (the second after two trials finished, once the
    file Tune was writing was whole)."""
    search = tmp_path / "storage" / "searches" / "grid-1"
    tune_state(search, trials=1)
    sealer = StateSealer(open_storage(tmp_path / "storage"), search, channel_for(signer_socket, search))
    assert sealer.seal() and not sealer.seal()  # nothing new: nothing sealed
    files = tune_state(search, trials=2)
    whole = files["tuner.pkl"]
    (search / "tuner.pkl").write_bytes(whole[:-1])  # Tune's sync half way through writing it
    assert not sealer.seal()
    (search / "tuner.pkl").write_bytes(whole)
    assert sealer.seal() and sealer.sequence == 1
    assert sorted(p.name for p in search.glob("tune-state-*")) == ["tune-state-00000001"]  # older ones go
    return search, sealer, files


def test_a_resume_puts_back_the_sealed_state_over_a_planted_pickle_and_removes_the_one_beside_it(
    sealed_search: tuple[Path, StateSealer, dict[str, bytes]], tmp_path: Path
) -> None:
    search, _, files = sealed_search
    marker = tmp_path / "marker"
    (search / "tuner.pkl").write_bytes(planted_pickle(marker))
    (search / "searcher-state-planted.pkl").write_bytes(planted_pickle(marker))
    assert restore_sealed_state(open_storage(tmp_path / "storage"), search, TRUST) == 1
    held = {p.name: p.read_bytes() for p in search.iterdir() if p.is_file()}
    assert held == files  # byte for byte what was sealed, and nothing else Tune would read
    assert not marker.exists()


def test_a_sealed_copy_changed_in_storage_is_refused_and_nothing_is_put_back(
    sealed_search: tuple[Path, StateSealer, dict[str, bytes]], tmp_path: Path
) -> None:
    search, _, _ = sealed_search
    planted = planted_pickle(tmp_path / "marker")
    (state_folder(search, 1) / "tuner.pkl").write_bytes(planted)
    (search / "tuner.pkl").write_bytes(planted)
    with pytest.raises(CheckpointError, match=r"changed since the signer sealed it: tuner\.pkl.*start a new"):
        restore_sealed_state(open_storage(tmp_path / "storage"), search, TRUST)
    assert (search / "tuner.pkl").read_bytes() == planted  # left as found: the resume stops


def test_a_copy_sealed_by_an_engineers_key_or_for_another_search_is_refused(
    sealed_search: tuple[Path, StateSealer, dict[str, bytes]], tmp_path: Path, signer_socket: Path
) -> None:
    search, _, _ = sealed_search
    storage = open_storage(tmp_path / "storage")
    folder = state_folder(search, 1)
    forged = seal_state_folder(SigningKey.generate(KeyRole.PLATFORM), search.resolve(), folder.resolve(), 1)
    (folder / STATE_SIGNATURE).write_text(forged.to_json())
    with pytest.raises(CheckpointError, match="is not trusted for role 'platform'"):
        restore_sealed_state(storage, search, TRUST)
    # A genuine seal of another search, copied in with its files, is that search's.
    other = tmp_path / "storage" / "searches" / "grid-2"
    tune_state(other, trials=3)
    StateSealer(storage, other, channel_for(signer_socket, other)).seal()
    shutil.rmtree(folder)
    shutil.copytree(state_folder(other, 0), state_folder(search, 0))
    with pytest.raises(CheckpointError, match="was sealed for another search"):
        restore_sealed_state(storage, search, TRUST)


def test_a_search_with_no_sealed_state_is_not_resumed(tmp_path: Path) -> None:
    search = tmp_path / "storage" / "searches" / "grid-1"
    tune_state(search, trials=2)
    with pytest.raises(CheckpointError, match=r"no Ray Tune state sealed .* \(none was sealed\)"):
        restore_sealed_state(open_storage(tmp_path / "storage"), search, TRUST)


def test_the_signer_seals_a_searchs_state_only_for_its_channel_and_only_forward(
    sealed_search: tuple[Path, StateSealer, dict[str, bytes]], tmp_path: Path, signer_socket: Path
) -> None:
    search, sealer, _ = sealed_search
    client = SignerClient(signer_socket)
    older = state_folder(search, 0)
    older.mkdir()
    (older / "tuner.pkl").write_bytes(b"an older state")
    with pytest.raises(SignatureError, match="sequence 0 is not after 1"):
        client.seal_state(sealer.channel.capability, str(older.resolve()), 0)
    # A trial's run channel (another directory) cannot seal the search's state folder.
    run = channel_for(signer_socket, tmp_path / "storage" / "ray" / "trial-run")
    later = state_folder(search, 2)
    later.mkdir()
    with pytest.raises(SignatureError, match="not this search's state folder"):
        client.seal_state(run.capability, str(later.resolve()), 2)


def test_on_object_storage_the_sealed_state_is_kept_in_the_bucket_and_put_back_there(
    signer_socket: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search on ``s3://`` (moto's server): its sealed state is uploaded; the engineer replaces
    ``tuner.pkl`` in the bucket and plants a pickle beside it; a resume on a node with an empty
    cache verifies the sealed copy it downloads and leaves the bucket holding exactly it."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for name, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
            "GOVRAY_CACHE": str(tmp_path / "driver-cache"),
        }.items():
            monkeypatch.setenv(name, value)
        boto3.client("s3").create_bucket(Bucket="govray-test")
        storage = open_storage("s3://govray-test/team")
        search = storage.root / "tune" / "grid-1"
        files = tune_state(search, trials=2)  # as Tune writes them: into the bucket
        storage.upload(*(search / name for name in files))
        assert StateSealer(storage, search, channel_for(signer_socket, search)).seal()
        marker = tmp_path / "marker"
        (search / "tuner.pkl").write_bytes(planted_pickle(marker))
        (search / "searcher-state-planted.pkl").write_bytes(planted_pickle(marker))
        storage.upload(search / "tuner.pkl", search / "searcher-state-planted.pkl")
        monkeypatch.setenv("GOVRAY_CACHE", str(tmp_path / "another-node"))
        resumed = open_storage("s3://govray-test/team")
        assert resumed.root != storage.root
        again = resumed.root / "tune" / "grid-1"
        assert restore_sealed_state(resumed, again, TRUST) == 0
        assert tune_files(resumed, again) == files  # (each downloaded from the bucket again)
        assert not marker.exists()
    finally:
        server.stop()


def test_a_resumed_driver_seals_past_a_folder_an_earlier_one_died_before_signing(
    sealed_search: tuple[Path, StateSealer, dict[str, bytes]], tmp_path: Path, signer_socket: Path
) -> None:
    """The earlier driver had sequence 2 sealed and died before writing its signature: the resume
    restores sequence 1, and its own sealer goes past 2 (the signer refuses a sequence it has seen)."""
    search, sealer, _ = sealed_search
    tune_state(search, trials=3)
    unsigned = state_folder(search, 2)
    unsigned.mkdir()
    (unsigned / "tuner.pkl").write_bytes((search / "tuner.pkl").read_bytes())
    SignerClient(signer_socket).seal_state(sealer.channel.capability, str(unsigned.resolve()), 2)
    assert restore_sealed_state(open_storage(tmp_path / "storage"), search, TRUST) == 1
    channel = channel_for(signer_socket, search)  # (the resumed driver opens the search again)
    resumed = StateSealer(open_storage(tmp_path / "storage"), search, channel, after=1)
    tune_state(search, trials=4)
    assert resumed.seal() and resumed.sequence == 3
    assert restore_sealed_state(open_storage(tmp_path / "storage"), search, TRUST) == 3
