"""Where a run's launch finds the platform's signer, and the development signer of one machine.

``open_channel(run_dir, spec)`` is what a launch (``govray run``'s driver, a search trial's) calls
before its workers start: it opens the run on the platform's signer and returns the channel the
workers receive in their ``Attempt``. The signer is the one the settings name
(``signer.socket``, ``GOVRAY_SIGNER_SOCKET``: a deployment's ``govray signer serve``, under its
own OS user, its key in a file only it reads or in a token); without one, this machine's
**development signer**: ``govray signer serve --dev`` started on first use (the machine's
platform keys from ``GOVRAY_HOME/keys``, which ``govray keys init`` created: it refuses to start
without them), one per ``GOVRAY_HOME``, shared by every launch on the
machine, gone after ``DEV_IDLE_S`` without a request. ``close_channel`` revokes a run's capability
when its fit ends. Either way the trial's processes never
load a key: they hold a capability to have their own run's checkpoints sealed. (The development
signer runs as the same OS user as the trials, so a trial could still read the key file: the
separation that makes the key unreachable is the deployment's OS users, as ARCHITECTURE.md's
threat model says.)

The development signer's socket lies in a directory only this OS user may enter
(``$XDG_RUNTIME_DIR/govray`` or ``/tmp/govray-UID``, mode 0700, refused when another user owns it),
named by a digest of ``GOVRAY_HOME`` (a Unix socket's path is at most 107 bytes).

Example::

    channel = open_channel(Path(spec.run_dir), spec)
    attempt = Attempt.of(spec, signer=channel)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from govray.core.errors import SignatureError
from govray.core.keys import govray_home, platform_key_path
from govray.core.settings import load_settings
from govray.core.signer_wire import OPS, WIRE_REVISION
from govray.train.checkpoints.signer import SignerChannel, SignerClient

if TYPE_CHECKING:
    from govray.train.runspec import RunSpec

DEV_IDLE_S = 2 * 3600.0  # a development signer that heard no request this long exits
START_TIMEOUT_S = 60.0


def open_channel(run_dir: Path, spec: RunSpec | None) -> SignerChannel:
    """A capability for the checkpoints written in ``run_dir``, each holding ``spec`` as its
    ``run.json`` (None: a channel that seals no checkpoint, a search driver's for its Tune state),
    from the settings' signer or this machine's development signer (started if it is not running)."""
    path = signer_socket()
    directory = Path(run_dir).resolve()
    capability, _ = SignerClient(path).open_run(str(directory), spec.sha256() if spec is not None else None)
    return SignerChannel(socket=str(path), capability=capability, run_dir=str(directory))


def signer_socket() -> Path:
    """The platform's signer: the settings' ``signer.socket``, else this machine's development
    signer (started if it is not running)."""
    configured = load_settings().signer.socket
    return configured if configured is not None else dev_signer()


def close_channel(channel: SignerChannel) -> None:
    """Revoke the run's capability (its fit ended); a signer gone meanwhile revokes nothing, and
    is no reason to fail the run that ended."""
    with contextlib.suppress(SignatureError):
        SignerClient(Path(channel.socket), timeout=30.0).close_run(channel.run_dir)


def dev_signer() -> Path:
    """The socket of ``GOVRAY_HOME``'s development signer, started now if none answers there."""
    home = govray_home().resolve()
    path = dev_socket(home)
    if _answers(path) and _current(path):
        return path
    if not platform_key_path(home).exists():
        raise SignatureError(
            f"no signer: the settings name none (signer.socket) and this machine has no platform key for "
            f"a development signer ({platform_key_path(home)}): create it once with `govray keys init`"
        )
    with _lock(home / "signer-dev" / "start.lock"):  # (in the home: gone with it)
        if _answers(path) and _current(path):  # another launch started it meanwhile
            return path
        if _answers(path) and not stop_dev_signer():  # one from an older govray: replaced
            raise SignatureError(
                f"the development signer at {path} runs an older govray (it lacks ops this one asks for) "
                "and could not be stopped: stop it, and the next launch starts a current one"
            )
        _start(home, path)
    return path


def dev_socket(home: Path) -> Path:
    """Where ``home``'s development signer listens."""
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:16]
    return _private_dir() / f"signer-{digest}.sock"


def stop_dev_signer() -> bool:
    """Stop ``GOVRAY_HOME``'s development signer if it runs; returns whether one did."""
    try:
        path = dev_socket(govray_home().resolve())
        pid = int(path.with_suffix(".pid").read_text())
    except (OSError, ValueError, SignatureError):  # (no private directory: none was started there)
        return False
    path.with_suffix(".pid").unlink(missing_ok=True)
    try:  # (a pid file outliving its process may name another process by now: not stopped)
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if b"--dev" not in command or str(path).encode() not in command:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(200):
            with contextlib.suppress(ChildProcessError):  # (reaped here when this process started it)
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return True
            if _gone(pid):  # (a zombie its parent, a Ray worker that started it, has not reaped: gone)
                return True
            time.sleep(0.05)
    except ProcessLookupError:
        return True
    return False  # still there after 10 s


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (it is not there, or only its zombie is)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _private_dir() -> Path:
    """A directory only this OS user may enter (created 0700; another user's is refused)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    directory = Path(runtime) / "govray" if runtime else Path(tempfile.gettempdir()) / f"govray-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    found = os.lstat(directory)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise SignatureError(
            f"{directory}: not a directory of this OS user's alone (owner {found.st_uid}, mode "
            f"{oct(found.st_mode & 0o777)}): the development signer's socket would be reachable by others"
        )
    return directory


def _current(path: Path) -> bool:
    """Whether the signer at ``path`` offers every op this govray asks for, at its wire revision
    (one from an older govray answers the question itself as an op it does not offer)."""
    try:
        ops, wire = SignerClient(path, timeout=10.0).offers()
        return set(OPS) <= set(ops) and wire >= WIRE_REVISION
    except SignatureError as error:  # (another failure is no reason to stop a signer runs may be using)
        return "does not offer" not in str(error)


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5.0)
        try:
            connection.connect(str(path))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _start(home: Path, path: Path) -> None:
    """Start the development signer of ``home`` on ``path`` and wait until it answers."""
    log = home / "logs" / "signer-dev.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # -P: the launch's working directory (the trial's code) is not on the signer's import path
    command = [sys.executable, "-P", "-m", "govray", "signer", "serve", "--dev", "--socket", str(path)]
    command += ["--idle-exit", str(DEV_IDLE_S)]
    with open(log, "ab") as output:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not in the launch's process group: a Ctrl-C there is not its
            close_fds=True,
            cwd=home,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(path):
        if process.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            tail = log.read_text(errors="replace")[-2000:]
            raise SignatureError(f"the development signer did not start (its log, {log}):\n{tail}")
        time.sleep(0.05)
