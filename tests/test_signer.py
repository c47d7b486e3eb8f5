"""The platform's signer (``govray signer``): the one process that holds the platform key, reached
over a Unix socket in JSON. What a bad-faith engineer with the socket, their own run and write
access to storage tries, and what the signer answers:

- a pickled payload, bytes that are not JSON, an op it does not offer (an attestation, a tree
  head, bytes of their choosing): refused, saying why, and the connection stays usable;
- another run's checkpoint, an earlier or the same step again while the run's last sealed
  checkpoint stands, a file linked in from outside the run, a folder linked out of it, a base that
  does not hash to its reference, digests of their own: refused (the signer hashes every file
  itself; a request has no field for digests); going back once the last checkpoint is gone or
  changed (a resume retraining its steps) is sealed and kept in the signer's own record;
- a capability after the run was opened again (a resume) is revoked; a restarted signer keeps the
  live one (kept as its digest only) and still refuses the steps it sealed;
- a file that is a FIFO or a device, or that changes while the signer reads it: refused (without
  hanging); block digests a worker writes beside a file are a file like any other, never what a
  ranged reader trusts (the manifest's, which the signer computes in the same pass, are); a second
  seal of a run while one is under way is refused, other runs' go on;
- only the operator's OS users open a run (the kernel names the peer); a request nested too deep
  and one connection too many are answered, not crashed on;
- what it does seal verifies as a govray checkpoint under the platform's trust, and names its run:
  another run's checkpoint put in a run's directory is not resumed from;
- ``govray signer serve`` is its own process, with its key encrypted at rest, and loads neither
  torch nor Ray (measured in its memory map).

The folders here hold a step's ``state.json`` and no training state, so these signers skip the
ledger recomputation (``check_ledgers=False``); ``tests/test_signer_ledger.py`` tests it on a real
checkpoint, and every run of the suite seals through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from threading import Thread
from typing import Any

import pytest

from govray.core import signer_wire as wire_module
from govray.core.canonical import file_sha256
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig, platform_trust
from govray.core.signer_wire import receive, send
from govray.core.storage import IN_PLACE
from govray.signer import server as server_module
from govray.signer.server import SignerServer
from govray.signer.service import Signer
from govray.train.checkpoints import sealing
from govray.train.checkpoints.blocks import BLOCK_SIZE, blocks_name, file_digests, write_blocks
from govray.train.checkpoints.files import verify_checkpoint
from govray.train.checkpoints.folders import checkpoint_candidates, newest_verified_checkpoint
from govray.train.checkpoints.manifest import (
    MANIFEST_FILE,
    MODEL_FILE,
    SIGNATURE_FILE,
    CheckpointError,
    Manifest,
    signed_manifest,
)
from govray.train.checkpoints.ranged import verified_file
from govray.train.checkpoints.sealing import Sealed
from govray.train.checkpoints.signer import SignerClient
from govray.train.parallel.layouts import Parts, ShardedLayout, WholeLayout, own_run
from govray.train.parallel.worker import Worker
from tests.helpers.golden import GoldenRun
from tests.helpers.signing import run_spec_at, training_state

KEY = SigningKey.generate(KeyRole.PLATFORM)
TRUST = platform_trust(KEY)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path is at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def signer_at(short_dir: Path) -> Iterator[Path]:
    """A signer serving on a socket in a thread of this process; yields the socket's path."""
    server = SignerServer(Signer(KEY, short_dir / "state", check_ledgers=False), short_dir / "s.sock")
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.path
    server.shutdown()
    server.server_close()


def checkpoint(run_dir: Path, step: int, weights: bytes = b"weights", golden: Path | None = None) -> Path:
    """A checkpoint folder of ``step``: a bare step's state, or (``golden``: a golden run's directory)
    that run's training state of the step, whose ledger a signer that checks it recomputes."""
    folder = run_dir / f"checkpoint_{step:08d}"
    if golden is not None:
        training_state(folder, golden, step)
    else:
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(f'{{"step": {step}}}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def seal_into(client: SignerClient, capability: str, folder: Path, step: int, **referenced: str) -> Manifest:
    """Seal and write the manifest and its signature into the folder, as a worker will."""
    sealed = client.seal(capability, str(folder), step, dict(referenced) or None)
    (folder / MANIFEST_FILE).write_bytes(sealed.manifest)
    (folder / SIGNATURE_FILE).write_text(sealed.envelope.to_json())
    return Manifest.model_validate_json(sealed.manifest)


def written(sealed: Sealed, folder: Path) -> Sealed:
    """The sealed manifest and signature written into the folder (what ``seal_checkpoint`` does)."""
    (folder / MANIFEST_FILE).write_bytes(sealed.manifest)
    (folder / SIGNATURE_FILE).write_text(sealed.envelope.to_json())
    return sealed


def raw_answer(path: Path, frame: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(str(path))
        connection.sendall(len(frame).to_bytes(4, "big") + frame)
        answer = receive(connection)
        send(connection, {"op": "open_run", "run_dir": "/runs/after-a-refusal"})
        assert receive(connection)["ok"] is True  # the connection stays usable
    return answer


def test_a_sealed_checkpoint_lists_what_the_signer_hashed_and_verifies_as_the_platforms(
    signer_at: Path, tmp_path: Path
) -> None:
    client = SignerClient(signer_at)
    run_dir = tmp_path / "ray" / "run-a"
    capability, after = client.open_run(str(run_dir))
    assert after == -1
    folder = checkpoint(run_dir, 10)
    manifest = seal_into(client, capability, folder, 10)
    assert manifest.step == 10
    assert manifest.files == {
        name: file_sha256(folder / name) for name in ("model.safetensors", "state.json")
    }
    verified, signer = signed_manifest(folder, TRUST)
    assert verified == manifest and signer == KEY.keyid


@pytest.mark.parametrize(
    ("frame", "refused"),
    [
        (pickle.dumps({"op": "seal", "capability": "x"}), "a pickled payload is refused"),
        (b"\x00\x01 not json", "not JSON"),
        (b"[1, 2]", "a JSON object"),
        (b'{"op": "sign_attestation", "payload": "e30="}', "is not offered"),
        (b'{"op": "sign_tree_head", "root": "00"}', "is not offered"),
        (
            b'{"op": "sign", "payload": "e30=", "payloadType": "application/vnd.in-toto+json"}',
            "is not offered",
        ),
        (
            b'{"op": "seal", "capability": "c", "folder": "/r/checkpoint_00000001", "step": 1,'
            b' "files": {"model.safetensors": "00"}}',
            "malformed seal request",
        ),
        (b'{"op": "open_run", "run_dir": "/runs/a\\u0000b"}', "cannot name a run or a folder"),
    ],
)
def test_what_is_not_a_request_it_offers_is_refused_and_the_connection_stays_usable(
    signer_at: Path, frame: bytes, refused: str
) -> None:
    answer = raw_answer(signer_at, frame)
    assert answer["ok"] is False and refused in str(answer["error"])


def test_a_capability_seals_its_own_runs_later_steps_only(signer_at: Path, tmp_path: Path) -> None:
    client = SignerClient(signer_at)
    mine, theirs = tmp_path / "ray" / "mine", tmp_path / "ray" / "theirs"
    capability, _ = client.open_run(str(mine))
    client.open_run(str(theirs))
    with pytest.raises(SignatureError, match="not this run's checkpoint folder"):
        client.seal(capability, str(checkpoint(theirs, 5)), 5)
    seal_into(client, capability, checkpoint(mine, 10), 10)
    for step in (10, 5):  # the same step again, an earlier one: while step 10's checkpoint stands
        folder = mine / f"checkpoint_{step:08d}"
        if not folder.exists():
            checkpoint(mine, step, b"forged")
        with pytest.raises(SignatureError, match="is not after step 10, .* whose checkpoint stands"):
            client.seal(capability, str(folder), step)
    with pytest.raises(SignatureError, match="not this run's checkpoint folder of step 20"):
        client.seal(capability, str(checkpoint(mine, 21)), 20)  # a folder of another step


def test_going_back_is_sealed_only_once_no_later_checkpoint_stands_and_is_recorded(
    short_dir: Path, tmp_path: Path
) -> None:
    """A worker killed between the seal and writing it, or a resume past a tampered checkpoint,
    retrains steps the signer sealed: sealed again once no checkpoint it sealed at or after that
    step still stands — breaking the last one does not reopen an earlier one that stands — and the
    signer's own record says which steps each going-back seal superseded."""
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = signer.open_run(str(run_dir))

    def sealed_at(step: int, write: bool = True) -> Sealed:
        folder = run_dir / f"checkpoint_{step:08d}"
        if not folder.exists():
            checkpoint(run_dir, step)
        sealed = signer.seal(capability, str(folder), step, {})
        return written(sealed, folder) if write else sealed

    sealed_at(0)  # a run's starting state
    sealed_at(10)
    sealed_at(20, write=False)  # killed before it wrote the seal
    sealed_at(20)  # the restart's: sealed again
    sealed_at(30)
    with pytest.raises(SignatureError, match="not after step 30, .* whose checkpoint stands"):
        sealed_at(20)
    (run_dir / "checkpoint_00000030" / "report.json").write_text("{}")  # the last one broken ...
    with pytest.raises(SignatureError, match="not after step 20, .* whose checkpoint stands"):
        sealed_at(10)  # ... reopens nothing that stands before it
    (run_dir / "checkpoint_00000030" / MANIFEST_FILE).unlink()
    (run_dir / "checkpoint_00000030" / MANIFEST_FILE).symlink_to("/dev/zero")  # read as no manifest
    (run_dir / "checkpoint_00000020" / MODEL_FILE).write_bytes(b"tampered")  # refused at resume ...
    last = sealed_at(20)  # ... which retrains from step 10
    record = [json.loads(line) for line in (short_dir / "state" / "seals.jsonl").read_text().splitlines()]
    assert [(entry["step"], entry.get("superseded_steps")) for entry in record] == [
        (0, None),
        (10, None),
        (20, None),
        (20, [20]),
        (30, None),
        (20, [20, 30]),
    ]
    assert record[-1]["manifest_sha256"] == hashlib.sha256(last.manifest).hexdigest()


def test_a_manifest_never_says_another_step_than_the_state_it_seals(short_dir: Path, tmp_path: Path) -> None:
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = signer.open_run(str(run_dir))
    folder = checkpoint(run_dir, 10)
    (folder / "state.json").write_text('{"step": 5}')  # a state of step 5 in step 10's folder
    with pytest.raises(SignatureError, match="the state of step 5, not of step 10"):
        signer.seal(capability, str(folder), 10, {})
    (folder / "state.json").unlink()
    with pytest.raises(SignatureError, match="holds no state.json"):
        signer.seal(capability, str(folder), 10, {})


def test_a_closed_run_seals_nothing_more(short_dir: Path, tmp_path: Path) -> None:
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = signer.open_run(str(run_dir))
    signer.close_run(str(run_dir))  # the fit ended
    with pytest.raises(SignatureError, match="unknown or revoked capability"):
        signer.seal(capability, str(checkpoint(run_dir, 1)), 1, {})


def test_files_from_outside_the_run_are_refused(signer_at: Path, tmp_path: Path) -> None:
    client = SignerClient(signer_at)
    run_dir, elsewhere = tmp_path / "ray" / "run-a", tmp_path / "elsewhere"
    capability, _ = client.open_run(str(run_dir))
    outside = checkpoint(elsewhere, 10, b"someone else's weights")
    folder = checkpoint(run_dir, 10)
    (folder / "adapter-pii.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(SignatureError, match="not a regular file"):
        client.seal(capability, str(folder), 10)
    (run_dir / "checkpoint_00000020").symlink_to(outside, target_is_directory=True)
    with pytest.raises(SignatureError, match="not a folder inside the run directory"):
        client.seal(capability, str(run_dir / "checkpoint_00000020"), 20)
    (folder / "adapter-pii.safetensors").unlink()
    (folder / "nested").mkdir()
    with pytest.raises(SignatureError, match="not a regular file"):
        client.seal(capability, str(folder), 10)


def test_a_referenced_base_is_hashed_in_the_runs_base_store(signer_at: Path, tmp_path: Path) -> None:
    client = SignerClient(signer_at)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = client.open_run(str(run_dir))
    (run_dir / "base").mkdir(parents=True)
    base = run_dir / "base" / "frozen.safetensors"
    base.write_bytes(b"frozen base")
    digest = file_sha256(base)
    base.rename(run_dir / "base" / f"{digest}.safetensors")
    folder = checkpoint(run_dir, 10)
    (folder / "model.safetensors").unlink()
    with pytest.raises(SignatureError, match="only model.safetensors may be referenced"):
        client.seal(capability, str(folder), 10, {"state.json": digest})
    with pytest.raises(SignatureError, match="not a file of the run's base store"):
        client.seal(capability, str(folder), 10, {MODEL_FILE: "0" * 64})
    (run_dir / "base" / f"{'1' * 64}.safetensors").write_bytes(b"not what its name says")
    with pytest.raises(SignatureError, match="its sha256 is not"):
        client.seal(capability, str(folder), 10, {MODEL_FILE: "1" * 64})
    manifest = seal_into(client, capability, folder, 10, **{MODEL_FILE: digest})
    assert manifest.referenced == [MODEL_FILE] and manifest.files[MODEL_FILE] == digest


def test_opening_a_run_again_revokes_its_capability_and_a_restart_keeps_its_steps(
    short_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "ray" / "run-a"
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    first, _ = signer.open_run(str(run_dir))
    written(signer.seal(first, str(checkpoint(run_dir, 10)), 10, {}), run_dir / "checkpoint_00000010")
    second, after = signer.open_run(str(run_dir))  # a resume
    assert after == 10
    with pytest.raises(SignatureError, match="unknown or revoked capability"):
        signer.seal(first, str(checkpoint(run_dir, 20)), 20, {})
    # The run's workers keep their capability:
    restarted = Signer(KEY, short_dir / "state", check_ledgers=False)
    with pytest.raises(SignatureError, match="unknown or revoked capability"):
        restarted.seal(first, str(run_dir / "checkpoint_00000020"), 20, {})
    with pytest.raises(SignatureError, match="is not after step 10"):
        restarted.seal(second, str(run_dir / "checkpoint_00000010"), 10, {})
    restarted.seal(second, str(run_dir / "checkpoint_00000020"), 20, {})
    assert second not in (short_dir / "state" / "runs.json").read_text()  # kept as its digest only


def test_a_run_directory_is_an_absolute_path(short_dir: Path) -> None:
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    for run_dir in ("ray/run-a", "/storage/ray/../../etc"):
        with pytest.raises(SignatureError, match="absolute path without"):
            signer.open_run(run_dir)


def test_the_signer_takes_the_platform_key_only(short_dir: Path) -> None:
    with pytest.raises(SignatureError, match="policy-authority key"):
        Signer(SigningKey.generate(KeyRole.POLICY_AUTHORITY), short_dir / "state")


def test_govray_signer_serve_is_a_process_of_its_own_with_its_key_encrypted_and_no_torch_or_ray(
    short_dir: Path, tmp_path: Path, golden_run: GoldenRun
) -> None:
    secret = short_dir / "passphrase"
    secret.write_text("correct horse\n")
    home = {**os.environ, "GOVRAY_HOME": str(short_dir / "home")}
    govray = [sys.executable, "-m", "govray"]
    init = subprocess.run(
        [*govray, "signer", "init", "--passphrase-file", str(secret)],
        env=home,
        capture_output=True,
        text=True,
    )
    assert init.returncode == 0, init.stderr
    key_file = short_dir / "home" / "signer" / "platform.key"
    assert (
        b"ENCRYPTED PRIVATE KEY" in key_file.read_bytes() and oct(key_file.stat().st_mode & 0o777) == "0o600"
    )
    again = subprocess.run(
        [*govray, "signer", "init", "--passphrase-file", str(secret)],
        env=home,
        capture_output=True,
        text=True,
    )
    assert again.returncode != 0 and "made already" in again.stdout + again.stderr
    (short_dir / "wrong").write_text("wrong horse\n")
    wrong = subprocess.run(
        [*govray, "signer", "serve", "--passphrase-file", str(short_dir / "wrong")],
        env=home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert wrong.returncode != 0 and "passphrase is wrong" in wrong.stdout + wrong.stderr

    socket_path = short_dir / "home" / "signer" / "signer.sock"
    process = subprocess.Popen(
        [*govray, "signer", "serve", "--passphrase-file", str(secret)],
        env=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not socket_path.is_socket():
            assert process.poll() is None and time.monotonic() < deadline, (
                process.stdout and process.stdout.read()
            )
            time.sleep(0.1)
        assert oct(socket_path.stat().st_mode & 0o777) == "0o660"
        client = SignerClient(socket_path)
        run_dir = tmp_path / "ray" / "run-a"
        folder = checkpoint(run_dir, 10, golden=golden_run.outcome.run_dir)  # (its ledger recomputed)
        capability, _ = client.open_run(str(run_dir), run_spec_at(golden_run.outcome.run_dir, 10).sha256())
        seal_into(client, capability, folder, 10)
        public = SigningKey.load(key_file, b"correct horse").public_key
        assert signed_manifest(folder, TrustConfig(keys=[public]))[1] == public.keyid
        mapped = Path(f"/proc/{process.pid}/maps").read_text()
        assert "libtorch" not in mapped and "_raylet" not in mapped
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    assert not socket_path.exists()  # removed on the way out


def test_another_spelling_or_a_link_of_a_run_directory_is_the_same_run(
    signer_at: Path, tmp_path: Path
) -> None:
    """A link to the run (or ``//`` in its path) opens the same record: its sealed steps stay sealed."""
    client = SignerClient(signer_at)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = client.open_run(str(run_dir))
    seal_into(client, capability, checkpoint(run_dir, 10), 10)
    alias = tmp_path / "alias"
    alias.symlink_to(run_dir, target_is_directory=True)
    for spelling in (str(alias), "/" + str(run_dir)):
        again, after = client.open_run(spelling)
        assert after == 10
        with pytest.raises(SignatureError, match="is not after step 10"):
            client.seal(again, f"{spelling}/checkpoint_00000010", 10)
    folder = checkpoint(run_dir, 20)
    (run_dir / "base").mkdir()
    (run_dir / "base" / f"{file_sha256(folder / MODEL_FILE)}.safetensors").write_bytes(b"weights")
    with pytest.raises(
        SignatureError, match="holds model.safetensors itself, and refers to it by digest too"
    ):
        client.seal(again, str(folder), 20, {MODEL_FILE: file_sha256(folder / MODEL_FILE)})


def test_a_checkpoint_names_its_run_and_another_runs_put_in_its_directory_is_not_resumed_from(
    signer_at: Path, tmp_path: Path
) -> None:
    client = SignerClient(signer_at)
    mine, theirs = tmp_path / "ray" / "mine", tmp_path / "ray" / "theirs"
    capability, _ = client.open_run(str(theirs))
    sealed = seal_into(client, capability, checkpoint(theirs, 40, b"their weights"), 40)
    assert sealed.run == "theirs"
    capability, _ = client.open_run(str(mine))
    seal_into(client, capability, checkpoint(mine, 10), 10)
    shutil.copytree(theirs / "checkpoint_00000040", mine / "checkpoint_00000040")
    verify_checkpoint(mine / "checkpoint_00000040", TRUST)  # signed, every digest right ...
    (newest, refusal), *_ = checkpoint_candidates(mine, TRUST)
    assert newest.name == "checkpoint_00000040" and refusal is not None
    assert "a checkpoint of run 'theirs'" in refusal and "not of run 'mine'" in refusal
    assert newest_verified_checkpoint(mine, TRUST) == mine / "checkpoint_00000010"  # ... yet not its


@pytest.mark.parametrize("layout", [WholeLayout(), ShardedLayout()], ids=["whole", "sharded"])
def test_a_folder_chosen_to_resume_from_that_holds_another_runs_checkpoint_by_then_is_refused(
    signer_at: Path, tmp_path: Path, layout: WholeLayout
) -> None:
    """The race after the choice: the folder the resume rule chose is replaced by another run's
    signed checkpoint before the workers read it. Every layout's load (and a sharded run's roll
    back) checks the run its signed manifest names, before reading any state."""
    client = SignerClient(signer_at)
    mine, theirs = tmp_path / "ray" / "mine", tmp_path / "ray" / "theirs"
    capability, _ = client.open_run(str(theirs))
    seal_into(client, capability, checkpoint(theirs, 40, b"their weights"), 40)
    capability, _ = client.open_run(str(mine))
    chosen = checkpoint(mine, 40)
    seal_into(client, capability, chosen, 40)
    shutil.rmtree(chosen)
    shutil.copytree(theirs / "checkpoint_00000040", chosen)
    # Only the storage and the trust are read before the refusal (no model, no optimizer).
    sharding = {"world_size": 2} if isinstance(layout, ShardedLayout) else {}
    parts = Parts(None, None, [], sharding, Worker(0, 1), IN_PLACE, TRUST)  # type: ignore[arg-type]
    assert own_run(chosen, mine) == "mine"
    with pytest.raises(CheckpointError, match="a checkpoint of run 'theirs'.*not of run 'mine'"):
        layout.load(parts, chosen, own_run(chosen, mine))
    # A folder handed over from elsewhere (a PBT donor's, a copy Tune persisted under a folder of
    # its own naming) is another run's by design: no run is required of it.
    handed_over = shutil.copytree(
        theirs / "checkpoint_00000040", tmp_path / "tune_trial_0" / "checkpoint_00000040"
    )
    assert own_run(handed_over, mine) is None and own_run(chosen, mine.parent / "mine") == "mine"


def test_the_block_digests_a_ranged_reader_trusts_are_the_ones_the_signer_computed(
    signer_at: Path, tmp_path: Path
) -> None:
    """What a ranged reader trusts for a byte range is the signed manifest's block digests, which
    the signer computes in the pass that hashes the file: a worker that writes block digests of
    other bytes beside the file (to swap the file after sealing) gets a file like any other."""
    client = SignerClient(signer_at)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = client.open_run(str(run_dir))
    folder = checkpoint(run_dir, 10, bytes(range(256)) * 40_000)  # 10 MB: several blocks
    model = folder / MODEL_FILE
    original = model.read_bytes()
    model.write_bytes(b"other bytes" + original[11:])
    write_blocks(model, 1024)  # block digests of the other bytes ...
    model.write_bytes(original)  # ... beside the honest file
    manifest = seal_into(client, capability, folder, 10)
    assert manifest.blocks is not None and set(manifest.blocks) == {MODEL_FILE}
    assert manifest.blocks[MODEL_FILE] == file_digests(model, BLOCK_SIZE)[1]
    assert len(manifest.blocks[MODEL_FILE].blocks) == 10
    reader = verified_file(folder, MODEL_FILE, manifest.files, manifest.blocks)
    assert reader.read(5_000_000, 5_000_100) == original[5_000_000:5_000_100]
    model.write_bytes(original[:5_000_000] + b"swapped" + original[5_000_007:])
    with pytest.raises(CheckpointError, match="tampered"):
        verified_file(folder, MODEL_FILE, manifest.files, manifest.blocks).read(5_000_000, 5_000_100)
    assert blocks_name(MODEL_FILE) in manifest.files  # the worker's side file: listed, trusted by none


def test_a_fifo_a_device_or_a_file_that_changes_while_read_is_refused_without_hanging(
    short_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    run_dir = tmp_path / "ray" / "run-a"
    capability, _ = signer.open_run(str(run_dir))
    folder = checkpoint(run_dir, 10)
    os.mkfifo(folder / "adapter-pii.safetensors")  # a reader would block on it forever
    with pytest.raises(SignatureError, match="adapter-pii.safetensors: not a regular file"):
        signer.seal(capability, str(folder), 10, {})
    (folder / "adapter-pii.safetensors").unlink()
    (folder / "null").symlink_to("/dev/zero")
    with pytest.raises(SignatureError, match="null: not a regular file the sealer can open"):
        signer.seal(capability, str(folder), 10, {})
    (folder / "null").unlink()

    class Growing:
        """sha256 whose first update appends to the file being read: the file changes mid-read."""

        def __init__(self, target: Path) -> None:
            self.target, self.touched = target, False

        def __call__(self, *data: bytes) -> Any:
            if not self.touched and not data:
                self.touched = True
                with self.target.open("ab") as handle:
                    handle.write(b"appended by the worker")
            return hashlib.sha256(*data)

    model = folder / MODEL_FILE
    fake = type("fake_hashlib", (), {"sha256": staticmethod(Growing(model))})
    monkeypatch.setattr(sealing, "hashlib", fake)
    with pytest.raises(SignatureError, match="model.safetensors: changed while the sealer read it"):
        signer.seal(capability, str(folder), 10, {})
    monkeypatch.undo()
    assert signer.seal(capability, str(folder), 10, {}).manifest  # unchanged now: sealed


def test_one_seal_per_run_at_a_time_while_other_runs_seal(
    short_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    mine, other = tmp_path / "ray" / "mine", tmp_path / "ray" / "other"
    first, _ = signer.open_run(str(mine))
    second, _ = signer.open_run(str(other))
    checkpoint(mine, 20)
    checkpoint(other, 5)
    seen: list[str] = []

    def meanwhile(*data: bytes) -> Any:
        if not data and not seen:  # inside the first seal's hashing, of run mine
            seen.append("hashing")
            with pytest.raises(SignatureError, match="another checkpoint of this run is being sealed"):
                signer.seal(first, str(mine / "checkpoint_00000020"), 20, {})
            seen.append(
                Manifest.model_validate_json(
                    signer.seal(second, str(other / "checkpoint_00000005"), 5, {}).manifest
                ).run
            )
        return hashlib.sha256(*data)

    monkeypatch.setattr(sealing, "hashlib", type("fake_hashlib", (), {"sha256": staticmethod(meanwhile)}))
    checkpoint(mine, 10)
    signer.seal(first, str(mine / "checkpoint_00000010"), 10, {})
    assert seen == ["hashing", "other"]


def test_only_the_operators_os_users_open_runs(short_dir: Path, tmp_path: Path) -> None:
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    server = SignerServer(signer, short_dir / "s.sock", open_uids=frozenset({os.getuid() + 4242}))
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = SignerClient(server.path)
        with pytest.raises(SignatureError, match=f"OS user {os.getuid()} may seal .* not open run"):
            client.open_run(str(tmp_path / "ray" / "run-a"))
        with pytest.raises(SignatureError, match=f"OS user {os.getuid()} may seal .* not close run"):
            client.close_run(str(tmp_path / "ray" / "run-a"))
        capability, _ = signer.open_run(str(tmp_path / "ray" / "run-a"))  # the launch, as the operator
        seal_into(client, capability, checkpoint(tmp_path / "ray" / "run-a", 10), 10)  # a worker seals
    finally:
        server.shutdown()
        server.server_close()


def test_a_request_nested_too_deep_and_one_connection_too_many_are_answered(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 1)
    server = SignerServer(Signer(KEY, short_dir / "state", check_ledgers=False), short_dir / "s.sock")
    Thread(target=server.serve_forever, daemon=True).start()
    deep = b"[" * 50_000 + b"]" * 50_000
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
            held.connect(str(server.path))
            held.sendall(len(deep).to_bytes(4, "big") + deep)
            assert "nests too deep" in str(receive(held)["error"])
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as another:  # the one slot is taken
                another.connect(str(server.path))
                assert receive(another) == {"ok": False, "error": "busy: 1 connections are open"}
    finally:
        server.shutdown()
        server.server_close()


def test_a_frame_that_trickles_in_is_refused(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    signer = Signer(KEY, short_dir / "state", check_ledgers=False)
    monkeypatch.setattr(wire_module, "FRAME_DEADLINE_S", 0.5)
    server = SignerServer(signer, short_dir / "s.sock")
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
            slow.connect(str(server.path))
            slow.sendall((100).to_bytes(4, "big") + b'{"op": "se')  # and nothing more
            assert "a frame of 100 bytes did not arrive within" in str(receive(slow)["error"])
    finally:
        server.shutdown()
        server.server_close()
