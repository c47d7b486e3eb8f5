"""Where a run's launch finds the platform's signer (``govray.signer.local``): the settings'
``signer.socket`` when named, else this machine's development signer — started once per
``GOVRAY_HOME`` as a process of its own (``govray signer serve --dev``), shared by every launch,
gone when idle — and never a socket in a directory another OS user could enter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from govray.core.errors import SignatureError
from govray.core.key_creation import init_platform_keys
from govray.core.keys import KeyRole, SigningKey, platform_key, platform_trust
from govray.core.signer_wire import OPS, WIRE_REVISION
from govray.signer.local import dev_socket, open_channel, stop_dev_signer
from govray.signer.server import SignerServer
from govray.signer.service import Signer
from govray.train.checkpoints.files import verify_checkpoint
from govray.train.checkpoints.signer import ChannelSigner, SignerClient
from tests.helpers.golden import GoldenRun
from tests.helpers.signing import run_spec_at, sealed_into, training_state


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A ``GOVRAY_HOME`` of the test's own, its platform keys created (its development signer
    stopped at the end)."""
    monkeypatch.setenv("GOVRAY_HOME", str(tmp_path / "home"))
    init_platform_keys(tmp_path / "home")
    yield tmp_path / "home"
    stop_dev_signer()


def sealed_checkpoint(
    channel_signer: ChannelSigner, run_dir: Path, step: int, golden: GoldenRun | None = None
) -> Path:
    """A checkpoint folder of ``step`` sealed through ``channel_signer``: the golden run's training
    state of that step (its ledger recomputed by a signer that checks it), or a bare step."""
    folder = run_dir / f"checkpoint_{step:08d}"
    if golden is not None:
        training_state(folder, golden.outcome.run_dir, step)
    else:
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(json.dumps({"step": step}))
    return sealed_into(channel_signer, folder, step)


def test_launches_start_one_development_signer_a_process_of_its_own_and_share_it(
    home: Path, tmp_path: Path, golden_run: GoldenRun
) -> None:
    first = open_channel(tmp_path / "runs" / "a", run_spec_at(golden_run.outcome.run_dir, 10))
    second = open_channel(tmp_path / "runs" / "b", None)
    assert first.socket == second.socket == str(dev_socket(home.resolve()))
    assert first.capability != second.capability and first.run_dir == str((tmp_path / "runs" / "a").resolve())
    pid = int(Path(first.socket).with_suffix(".pid").read_text())
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert pid != os.getpid() and b"--dev" in command and b"serve" in command
    folder = sealed_checkpoint(ChannelSigner(first), tmp_path / "runs" / "a", 10, golden_run)
    assert verify_checkpoint(folder, platform_trust(platform_key()))[1] == platform_key().keyid
    assert stop_dev_signer() and not Path(first.socket).exists()
    # Nothing of it is left in the shared socket directory (its start lock lies in the home).
    assert not Path(first.socket).with_suffix(".pid").exists()
    assert not Path(first.socket).with_suffix(".lock").exists()
    third = open_channel(tmp_path / "runs" / "c", None)  # a later launch starts it again
    assert int(Path(third.socket).with_suffix(".pid").read_text()) != pid


def test_the_signer_the_settings_name_is_used_and_no_development_signer_starts(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    key = SigningKey.generate(KeyRole.PLATFORM)
    server = SignerServer(Signer(key, tmp_path / "state", check_ledgers=False), short / "s.sock")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("GOVRAY_SIGNER_SOCKET", str(server.path))
    try:
        channel = open_channel(tmp_path / "runs" / "a", None)  # (a bare step: that signer checks no ledger)
        assert channel.socket == str(server.path) and not dev_socket(home.resolve()).exists()
        folder = sealed_checkpoint(ChannelSigner(channel), tmp_path / "runs" / "a", 1)
        assert verify_checkpoint(folder, platform_trust(key))[1] == key.keyid
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(short, ignore_errors=True)


def test_a_signer_with_an_idle_exit_stops_once_nobody_has_connected_that_long(tmp_path: Path) -> None:
    short = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    server = SignerServer(
        Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "state"), short / "s.sock", idle_exit=1.0
    )
    began = time.monotonic()
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    serving.join(timeout=15)
    assert not serving.is_alive() and time.monotonic() - began >= 1.0
    server.server_close()
    shutil.rmtree(short, ignore_errors=True)


def test_a_development_signer_ends_with_its_home(tmp_path: Path) -> None:
    """A test session's (or any) ``GOVRAY_HOME`` removed: its development signer stops by itself
    within seconds, however long its idle exit."""
    short = Path(tempfile.mkdtemp(prefix="gd-", dir="/tmp"))
    home = tmp_path / "home"
    home.mkdir()
    server = SignerServer(
        Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "state"),
        short / "s.sock",
        idle_exit=3600.0,
        while_exists=home,
    )
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    serving.join(timeout=1.0)
    assert serving.is_alive()  # (the home is there)
    home.rmdir()
    serving.join(timeout=15)
    assert not serving.is_alive()
    server.server_close()
    shutil.rmtree(short, ignore_errors=True)


def test_a_socket_directory_another_os_user_could_enter_is_refused(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "runtime"
    (runtime / "govray").mkdir(parents=True)
    (runtime / "govray").chmod(0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with pytest.raises(SignatureError, match="not a directory of this OS user's alone"):
        open_channel(tmp_path / "runs" / "a", None)


# A signer from an older govray (its command line names the socket and --dev, as a development
# signer's does): "before-offers" offers none of today's ops (as one from before ``offers``
# answers: every request refused as an op it does not offer); "wire-1" offers every op but binds
# no run spec (it refuses the field, as the last govray's did).
OLDER_SIGNER = """
import json, os, socket, struct, sys
path, pid_file, mode = sys.argv[1], sys.argv[2], sys.argv[3]
OPS = json.loads(sys.argv[4])
open(pid_file, "w").write(str(os.getpid()))
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
while True:
    connection, _ = server.accept()
    with connection:
        head = connection.recv(4)
        if len(head) < 4:  # (a connection only looking whether it answers)
            continue
        (length,) = struct.unpack(">I", head)
        op = json.loads(connection.recv(length))["op"]
        if mode == "wire-1" and op == "offers":
            answer = {"ok": True, "ops": OPS}
        elif mode == "wire-1":
            answer = {"ok": False, "error": "run_spec: extra inputs are not permitted"}
        else:
            answer = {"ok": False, "error": f"op {op!r} is not offered: the signer opens runs"}
        connection.sendall(struct.pack(">I", len(json.dumps(answer))) + json.dumps(answer).encode())
"""


@pytest.mark.parametrize("older_mode", ["before-offers", "wire-1"])
def test_a_development_signer_from_an_older_govray_is_replaced_and_a_deployed_one_is_named(
    home: Path, tmp_path: Path, golden_run: GoldenRun, older_mode: str
) -> None:
    path = dev_socket(home.resolve())
    older = subprocess.Popen(
        [
            sys.executable,
            "-c",
            OLDER_SIGNER,
            str(path),
            str(path.with_suffix(".pid")),
            older_mode,
            json.dumps(OPS),
            "--dev",
        ]
    )
    try:
        for _ in range(100):
            if path.exists():
                break
            time.sleep(0.05)
        if older_mode == "before-offers":
            # Asked what it lacks, the client says what is wrong, not only that the op is refused.
            with pytest.raises(SignatureError, match="does not offer 'seal_state': it runs an older govray"):
                SignerClient(path).seal_state("capability", str(tmp_path / "tune-state-00000000"), 0)
        channel = open_channel(tmp_path / "runs" / "a", run_spec_at(golden_run.outcome.run_dir, 10))
        # (the launch replaced it)
        assert older.wait(timeout=10) is not None
        assert int(path.with_suffix(".pid").read_text()) != older.pid
        ops, wire = SignerClient(Path(channel.socket)).offers()
        assert set(OPS) <= set(ops) and wire == WIRE_REVISION
        assert sealed_checkpoint(ChannelSigner(channel), tmp_path / "runs" / "a", 10, golden_run).is_dir()
    finally:
        if older.poll() is None:
            older.kill()
