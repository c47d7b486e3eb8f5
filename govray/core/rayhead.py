"""One Ray per machine: the instance a command joins, and the head ``govray up`` keeps running.

A command that needs Ray joins, in this order: ``RAY_ADDRESS``; the head ``govray up`` started
(its record, ``$GOVRAY_HOME/ray/head.json``); a head started with plain ``ray start --head`` (Ray's
bootstrap file, ``/tmp/ray/ray_current_cluster``). Only an address that answers counts: a head
that died leaves a record behind. With none, the command starts a local Ray of its own
(``govray.core.runtime``), which ends with it.

``govray up`` runs ``ray start --head --block`` detached, in its own session and temp dir, so
``govray down`` stops exactly that head (SIGTERM: it drains and stops its own processes) and
nothing else: ``ray stop`` would stop every Ray on the machine.

    head = start_head(port=6379)      # HeadRecord(address='10.0.0.1:6379', pid=..., ...)
    running_ray()                     # RunningRay('10.0.0.1:6379', 'started by govray up')
    stop_head()                       # the record it stopped; None when none was running
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from govray.core.errors import GovrayError
from govray.core.keys import govray_home

AUTH_MODE = "RAY_AUTH_MODE"
DRAIN_TIMEOUT = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"  # read by `ray start` (ray_constants)


class RayHeadError(GovrayError):
    """``govray up`` could not start the head, or ``govray down`` could not stop it."""

    exit_code = 24


@dataclass(frozen=True)
class RunningRay:
    """A Ray instance to join, and how it was found (said in the one line a command prints)."""

    address: str
    origin: str  # "RAY_ADDRESS", "started by govray up", "started by ray start --head"


class HeadRecord(BaseModel):
    """What ``govray up`` started: written when the head answers, removed by ``govray down``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str  # host:port of the GCS
    pid: int  # the ``ray start --block`` process
    temp_dir: str  # Ray's temp dir for this head (sessions, logs, sockets)
    num_cpus: int


def record_path() -> Path:
    return govray_home() / "ray" / "head.json"


def answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something listens at ``host:port`` (a dead head's record stays behind)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def govray_head() -> HeadRecord | None:
    """The head ``govray up`` started, if its process lives and its GCS answers."""
    try:
        record = HeadRecord.model_validate_json(record_path().read_text())
    except (OSError, ValueError):
        return None
    return record if _runs_head(record) and answers(record.address) else None


def running_ray() -> RunningRay | None:
    """The Ray instance a command should join (see the module doc); None: start one."""
    if address := os.environ.get("RAY_ADDRESS"):
        return RunningRay(address, "RAY_ADDRESS")
    if (head := govray_head()) is not None:
        return RunningRay(head.address, "started by govray up")
    from ray._common.utils import get_ray_address_file

    try:
        bootstrap = Path(get_ray_address_file(None)).read_text().strip()
    except OSError:
        return None
    return RunningRay(bootstrap, "started by ray start --head") if answers(bootstrap) else None


def settle_token_auth(*, starting: bool) -> str | None:
    """Set ``RAY_AUTH_MODE`` as Ray would decide it (token for a new local instance, or when a
    token exists), so that Ray does not print its notice at every command; the notice to print
    instead, once per machine (None after, or when the user set the mode)."""
    if os.environ.get(AUTH_MODE):
        return None
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")).expanduser()
    mode = "token" if starting or os.environ.get("RAY_AUTH_TOKEN") or token.exists() else "disabled"
    os.environ[AUTH_MODE] = mode  # inherited by the Ray processes a command starts, as Ray does
    raylet = sys.modules.get("ray._raylet")
    # Ray caches its config: refresh it, as Ray itself does; never under a connected process, whose
    # mode is the one it connected with (changing it cuts the process off its own cluster).
    if raylet is not None and not sys.modules["ray"].is_initialized():
        raylet.Config.initialize("")
    shown = govray_home() / "ray" / "token-notice-shown"
    if mode != "token" or shown.exists():
        return None
    shown.parent.mkdir(parents=True, exist_ok=True)
    shown.touch()
    return (
        f"Ray's token authentication is on (the token is {token}); RAY_AUTH_MODE=disabled turns it off "
        "(https://docs.ray.io/en/latest/ray-security/token-auth.html). This notice is shown once."
    )


def start_head(
    *, port: int, num_cpus: int | None = None, temp_dir: Path | None = None, timeout: float = 120.0
) -> HeadRecord:
    """Start the head (see the module doc) and wait until it answers; its record."""
    from ray.util import get_node_ip_address

    temp = temp_dir or Path(tempfile.mkdtemp(prefix="govray-ray-", dir="/tmp"))  # short: socket paths
    temp.mkdir(parents=True, exist_ok=True)
    cpus = num_cpus or os.cpu_count() or 1
    address = f"{get_node_ip_address()}:{port}"
    command = [
        "ray",
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--num-cpus={cpus}",
        f"--temp-dir={temp}",
        "--include-dashboard=false",  # small machines: no dashboard (as a command's own Ray)
        "--disable-usage-stats",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        "--min-worker-port=0",  # OS-chosen worker ports: never another Ray's
        "--max-worker-port=0",
    ]
    # On SIGTERM Ray marks the node draining and waits up to this long for its workers to hand
    # back their leases (for Serve proxies behind a load balancer; 30 s by default, what made
    # `govray down` take 30 s): `down` stops every process of the machine's head anyway.
    env = {**os.environ, DRAIN_TIMEOUT: "0"}
    with open(temp / "govray-up.log", "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    deadline = time.monotonic() + timeout
    while not answers(address) or not (temp / "ray_current_cluster").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process.pid)
            tail = (temp / "govray-up.log").read_text(errors="replace")[-2000:]
            raise RayHeadError(f"ray start --head did not come up at {address}; its output:\n{tail}")
        time.sleep(0.5)
    record = HeadRecord(address=address, pid=process.pid, temp_dir=str(temp), num_cpus=cpus)
    record_path().parent.mkdir(parents=True, exist_ok=True)
    record_path().write_text(record.model_dump_json(indent=2))
    return record


def stop_head(timeout: float = 60.0) -> HeadRecord | None:
    """Stop the head ``govray up`` started and forget it; None when none was running."""
    try:
        record = HeadRecord.model_validate_json(record_path().read_text())
    except (OSError, ValueError):
        return None
    if _runs_head(record):
        _stop(record.pid, timeout)
    for pid in leftover_processes(Path(record.temp_dir)):
        _kill(pid, signal.SIGKILL)
    record_path().unlink(missing_ok=True)
    return record


def leftover_processes(temp_dir: Path) -> list[int]:
    """Live processes (not this one) that name ``temp_dir`` on their command line: what a head
    left behind (Ray's agents and workers retitle themselves, but keep their arguments' paths)."""
    return [pid for pid, _ in processes_naming((str(temp_dir),))]


def processes_naming(marks: tuple[str, ...], open_files: bool = False) -> list[tuple[int, str]]:
    """Live processes (not this one, no zombie) with one of ``marks`` on their command line or,
    with ``open_files``, holding a file below one open: (pid, command line) of each."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ours = any(mark in command for mark in marks) or (
                open_files and any(os.readlink(fd).startswith(marks) for fd in (entry / "fd").iterdir())
            )
        except OSError:
            continue
        if ours and _alive(int(entry.name)):
            found.append((int(entry.name), command.strip()))
    return found


def _runs_head(record: HeadRecord) -> bool:
    """Whether ``record.pid`` is still its ``ray start`` (not a process that reused the pid)."""
    try:
        return (
            _alive(record.pid)
            and record.temp_dir.encode() in Path(f"/proc/{record.pid}/cmdline").read_bytes()
        )
    except OSError:
        return False


def _stop(pid: int, timeout: float = 60.0) -> None:
    """SIGTERM the ``ray start --block`` process (it stops its Ray), then SIGKILL its group."""
    _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _alive(pid):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (our own child, not yet reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
