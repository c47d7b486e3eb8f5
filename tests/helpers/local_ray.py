"""Ray nodes that a cluster-tier test starts on this machine and alone stops.

Other Ray instances may run here at the same time (the default tier's, other cluster tests'), and
``ray stop`` would kill them all. So each node is a ``ray start --block`` subprocess in its own
session, with its own temp dir and free ports, and stopping it sends that process SIGTERM (it
drains and stops its own Ray processes). What is left afterwards and names one of our temp dirs on
its command line — nodes that the fake autoscaler started join the head's temp dir — is killed by
pid. Token authentication stays on: every process gets ``RAY_AUTH_MODE=token`` and reads
``~/.ray/auth_token``.

    cluster = LocalRayCluster()
    cluster.start_head(num_cpus=2)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes(2)
    cluster.govray("run", "experiment.yaml")   # a driver connected with RAY_ADDRESS
    cluster.stop()                             # [] when nothing had to be killed
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from govray.core.rayhead import processes_naming
from tests.helpers.builders import REPO
from tests.helpers.ports import free_port

AUTH = {"RAY_AUTH_MODE": "token"}
# `ray start --block` on SIGTERM marks its node draining and waits up to 30 s (Ray 2.60's default)
# for it to go idle before stopping its processes: a Serve proxy's grace, nothing a test's
# teardown needs (a head that ran a job waited the whole 30 s). Tests that drain a node on
# purpose use `ray drain-node`, which this does not change.
NO_DRAIN_ON_SIGTERM = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


@dataclass(frozen=True)
class RayNodeView:
    """What the GCS says about one live node."""

    node_id: str
    resources: dict[str, float]
    is_head: bool
    node_type: str  # the autoscaler's node type ("" for a node it did not start)
    started_at: float  # seconds since the epoch


@dataclass(frozen=True)
class OsUser:
    """An OS user a node runs as: its ids, supplementary groups, and a home it owns."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    home: Path


@dataclass
class RayNodeProcess:
    name: str
    temp_dir: Path
    process: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.temp_dir / "ray-start.log"


class LocalRayCluster:
    """A Ray cluster of ``ray start --block`` processes on this machine (see the module doc)."""

    def __init__(self) -> None:
        self.ip = ray.util.get_node_ip_address()
        self.port = free_port()
        # Short temp dirs under /tmp: Ray's Unix sockets live below them (107-byte path limit).
        self.nodes: list[RayNodeProcess] = []

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def environment(self, **extra: str) -> dict[str, str]:
        environment = {**os.environ, **AUTH}
        environment.pop("RAY_ADDRESS", None)  # only a driver of this cluster gets one (``extra``)
        return {**environment, **extra}

    def start_head(
        self,
        num_cpus: int,
        *,
        autoscaling_config: Path | None = None,
        env: dict[str, str] | None = None,
        dashboard_port: int | None = None,
        metrics_export_port: int | None = None,
        user: OsUser | None = None,
    ) -> None:
        """The head; with ``dashboard_port`` its dashboard (the Jobs API) on 127.0.0.1, with
        ``metrics_export_port`` its Prometheus endpoint; with ``user``, its processes (and every
        worker) run as that OS user."""
        args = [
            "--head",
            f"--port={self.port}",
            f"--include-dashboard={'true' if dashboard_port else 'false'}",
            f"--ray-client-server-port={free_port()}",
        ]
        if dashboard_port is not None:
            args += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        if metrics_export_port is not None:
            args.append(f"--metrics-export-port={metrics_export_port}")
        if autoscaling_config is not None:
            args.append(f"--autoscaling-config={autoscaling_config}")
        self._start("head", num_cpus, args, env or {}, user)

    def add_node(self, num_cpus: int, *, env: dict[str, str] | None = None) -> None:
        self._start(f"node{len(self.nodes)}", num_cpus, [f"--address={self.address}"], env or {})

    def _start(
        self, name: str, num_cpus: int, args: list[str], env: dict[str, str], user: OsUser | None = None
    ) -> None:
        temp_dir = Path(tempfile.mkdtemp(prefix=f"govray-{name}-", dir="/tmp"))
        as_user: dict[str, Any] = {}
        if user is not None:
            os.chown(temp_dir, user.uid, user.gid)
            as_user = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups), "umask": 0}
            env = {**env, "HOME": str(user.home)}
        command = [
            "ray" if user is None else str(Path(sys.executable).parent / "ray"),  # (not a pyenv shim)
            "start",
            "--block",
            *args,
            f"--node-ip-address={self.ip}",
            f"--num-cpus={num_cpus}",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--min-worker-port=0",  # OS-chosen worker ports: never another Ray's
            "--max-worker-port=0",
        ]
        with open(temp_dir / "ray-start.log", "wb") as log:
            process = subprocess.Popen(
                command,
                env=self.environment(**{**NO_DRAIN_ON_SIGTERM, **env}),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **as_user,
            )
        self.nodes.append(RayNodeProcess(name, temp_dir, process))

    def alive_nodes(self) -> list[RayNodeView]:
        """The cluster's live nodes, from the GCS ([] while it does not answer)."""
        try:
            infos = _gcs_client(self.address).get_all_node_info(timeout=5)
        except Exception:
            return []
        return [
            RayNodeView(
                node_id=node_id.hex(),
                resources=dict(info.resources_total),
                is_head=info.is_head_node,
                node_type=info.node_type_name,
                started_at=info.start_time_ms / 1000,
            )
            for node_id, info in infos.items()
            if info.state == 0  # ALIVE
        ]

    def wait_for_nodes(self, count: int, timeout: float = 120.0) -> list[RayNodeView]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.process.poll() is not None:
                    raise RuntimeError(f"ray start ({node.name}) exited: {node.log.read_text()[-3000:]}")
            nodes = self.alive_nodes()
            if len(nodes) >= count:
                return nodes
            time.sleep(0.5)
        raise TimeoutError(f"{count} Ray nodes were not up after {timeout:.0f} s: {self.alive_nodes()}")

    def govray(
        self, *args: str, timeout: float = 600, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``python -m govray ARGS`` as a driver of this cluster (``RAY_ADDRESS``), from the repo;
        ``env``: more of the driver's environment (its settings: the signer's socket, the trust)."""
        return subprocess.run(
            [sys.executable, "-m", "govray", *args],
            env=self.environment(RAY_ADDRESS=self.address, RAY_DEDUP_LOGS="0", **(env or {})),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self) -> list[str]:
        """Stop the nodes (workers first, the head last), then kill by pid whatever still names
        one of their temp dirs. Returns what had to be killed (``"PID COMMAND"``)."""
        for node in reversed(self.nodes):
            node.process.terminate()  # `ray start --block` drains and stops its processes
            try:
                node.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(node.process.pid, signal.SIGKILL)
                node.process.wait()
        killed = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            leftovers = self.leftover_processes()
            for pid, command in leftovers:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
                if sig == signal.SIGTERM:
                    killed.append(f"{pid} {command[:160]}")
            deadline = time.monotonic() + 10
            while leftovers and time.monotonic() < deadline:
                time.sleep(0.5)
                leftovers = self.leftover_processes()
        for node in self.nodes:
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        return killed

    def leftover_processes(self) -> list[tuple[int, str]]:
        """Live processes (not this one) that name one of our temp dirs on their command line or
        hold a file below one open (Ray's agents and workers retitle themselves ``ray::...``)."""
        return processes_naming(tuple(str(node.temp_dir) for node in self.nodes), open_files=True)


def _gcs_client(address: str) -> Any:
    """A GCS client that sends the cluster token (this process's Ray config is refreshed with
    ``RAY_AUTH_MODE=token``, as ``ray start`` does for itself)."""
    from ray._raylet import Config, GcsClient  # type: ignore[attr-defined]

    if os.environ.get("RAY_AUTH_MODE") != "token":
        os.environ.update(AUTH)
        Config.initialize("")
    return GcsClient(address=address)
