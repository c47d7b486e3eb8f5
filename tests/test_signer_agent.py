"""Signers across nodes (issue 49): a node's signer agent holds no key; it reads its node's
checkpoint folders as a seal reads them (every file hashed, the run spec the run was launched
with, the ledger recomputed) and has the key-holding signer sign what it read, over mutual TLS.
The key-holding signer keeps the capability, the run spec binding and the forward-only record;
only a certificate its CA issued to agents reaches it over TCP, only the agents' ops are answered
there, and its Unix socket refuses them (a worker never hands it digests)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from threading import Thread
from typing import Any

import pytest

from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig
from govray.signer.agent import AgentSigner
from govray.signer.server import SignerServer
from govray.signer.service import Signer
from govray.signer.tls import HeadLink, TlsListener, make_certificates
from govray.train.checkpoints.files import verify_checkpoint
from govray.train.checkpoints.manifest import STATE_FILE
from govray.train.checkpoints.sealing import HashedFolder, SealRefused
from govray.train.checkpoints.signer import ChannelSigner, SignerChannel, SignerClient
from tests.helpers.golden import GoldenRun
from tests.helpers.signing import run_spec_at, sealed_into, training_state


@dataclass
class Deployment:
    key: SigningKey
    head: Signer
    head_socket: Path  # the key-holding signer's own node
    agent_socket: Path  # another node's
    tls: Path
    port: int


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    short = Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))
    tls = tmp_path / "tls"
    make_certificates(tls, hosts=["127.0.0.1"])
    key = SigningKey.generate(KeyRole.PLATFORM)
    head = Signer(key, tmp_path / "head-state")
    servers: list[Any] = [SignerServer(head, short / "head.sock")]
    servers.append(TlsListener(servers[0], ("127.0.0.1", 0), tls))
    servers.append(
        SignerServer(AgentSigner(HeadLink(f"127.0.0.1:{servers[1].port}", tls)), short / "agent.sock")
    )
    for server in servers:
        Thread(target=server.serve_forever, daemon=True).start()
    yield Deployment(key, head, short / "head.sock", short / "agent.sock", tls, servers[1].port)
    for server in servers:
        server.shutdown()
        server.server_close()
    shutil.rmtree(short, ignore_errors=True)


def test_an_agent_seals_its_nodes_checkpoints_through_the_key_holding_signer(
    deployment: Deployment, golden_run: GoldenRun, tmp_path: Path
) -> None:
    source, run_dir = golden_run.outcome.run_dir, tmp_path / "node-b" / "run-x"
    run_dir.mkdir(parents=True)
    spec = run_spec_at(source, 10).sha256()
    capability, after = SignerClient(deployment.agent_socket).open_run(str(run_dir), spec)  # (forwarded)
    assert after == -1
    worker = ChannelSigner(
        SignerChannel(socket=str(deployment.agent_socket), capability=capability, run_dir=str(run_dir))
    )
    trust = TrustConfig(keys=[deployment.key.public_key])
    for step in (10, 20):
        folder = sealed_into(worker, training_state(run_dir / f"checkpoint_{step:08d}", source, step), step)
        assert verify_checkpoint(folder, trust)[1] == deployment.key.keyid
    assert deployment.head.sealed_after(capability, 0)[2].keys() == {10, 20}  # the head's record
    with pytest.raises(SignatureError, match="step 10 is not after step 20, which this run sealed"):
        worker.seal(run_dir / "checkpoint_00000010", 10, {})
    # The agent reports a later checkpoint that no longer stands: its step is sealed again.
    (run_dir / "checkpoint_00000020" / "report.json").write_text("{}")
    sealed_into(worker, run_dir / "checkpoint_00000020", 20)
    # The agent recomputes the ledger, and the head checks the run spec by its digest.
    last = training_state(run_dir / "checkpoint_00000030", source, 30)
    state = json.loads((last / STATE_FILE).read_text())
    state["ledger"]["entries"][0]["examples"] -= 1
    (last / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(SignatureError, match="its ledger is not the one recomputed"):
        worker.seal(last, 30, {})
    training_state(last, source, 30)
    (last / "run.json").write_text((last / "run.json").read_text().replace('"seed"', '"seed" ', 1))
    with pytest.raises(SignatureError, match="run.json is not the run spec this run was launched with"):
        worker.seal(last, 30, {})
    training_state(last, source, 30)
    assert verify_checkpoint(sealed_into(worker, last, 30), trust)[0].step == 30
    # An agent's report on a checkpoint sealed again since it looked (another manifest) is stale.
    with pytest.raises(SealRefused, match="step 30 of this run was sealed meanwhile"):
        deployment.head.seal_hashed(capability, 30, HashedFolder({}, {}, {}), {30: ("0" * 64, False)})


def test_the_key_holding_signers_socket_refuses_the_agents_ops_and_its_listener_everything_else(
    deployment: Deployment, tmp_path: Path
) -> None:
    local = SignerClient(deployment.head_socket)
    capability, _ = local.open_run(str(tmp_path / "run-y"))
    forged = {"op": "seal_hashed", "capability": capability, "step": 1, "files": {"state.json": "0" * 64}}
    for request in (forged, {"op": "sealed_after", "capability": capability, "step": 0}):
        with pytest.raises(
            SignatureError, match="is a node's signer agent's, over the signer's TLS listener"
        ):
            local.ask(request)
    link = HeadLink(f"127.0.0.1:{deployment.port}", deployment.tls)
    assert "seal_hashed" in link.ask({"op": "offers"})["ops"]
    for request in (
        {
            "op": "seal",
            "capability": capability,
            "folder": str(tmp_path / "run-y" / "checkpoint_00000001"),
            "step": 1,
        },
        {"op": "attest", "checkpoint": str(tmp_path)},
    ):
        with pytest.raises(
            SignatureError, match="a signer agent may open and close runs and seal what it hashed"
        ):
            link.ask(request)
    with pytest.raises(SignatureError, match="this node's signer is an agent without the platform's keys"):
        SignerClient(deployment.agent_socket).attest(str(tmp_path), None, False)


def _frame(document: dict[str, Any]) -> bytes:
    data = json.dumps(document).encode()
    return struct.pack(">I", len(data)) + data


def test_only_a_certificate_the_deployments_ca_issued_to_agents_reaches_the_listener(
    deployment: Deployment, tmp_path: Path
) -> None:
    offers = _frame({"op": "offers"})
    # Plain TCP: the handshake never happens, nothing is answered.
    with socket.create_connection(("127.0.0.1", deployment.port), timeout=10) as plain:
        plain.sendall(offers)
        assert b'"ok"' not in _received(plain)  # (closed, or a TLS alert: no answer)
    # TLS without a client certificate, with one another CA issued, or with the signer's own
    # (issued by this CA, but for a server): refused at the handshake.
    other = tmp_path / "other-ca"
    make_certificates(other, hosts=["127.0.0.1"])
    for context in (
        _client(deployment.tls, None),
        _client(deployment.tls, other),
        _client(deployment.tls, deployment.tls, name="signer"),
    ):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            assert b'"ok"' not in _ask(context, deployment.port, offers)
            raise ConnectionError("closed unanswered")
    with pytest.raises(SignatureError, match="did not answer"):
        HeadLink(f"127.0.0.1:{deployment.port}", other).ask({"op": "offers"})
    with pytest.raises(SignatureError, match="cannot load ca.pem, agent.pem and agent.key"):
        HeadLink(f"127.0.0.1:{deployment.port}", tmp_path / "no-such-directory")
    with pytest.raises(SignatureError, match="holds a certificate authority already"):
        make_certificates(deployment.tls, hosts=["127.0.0.1"])
    assert all(oct(path.stat().st_mode & 0o777) == "0o600" for path in deployment.tls.glob("*.key"))


def _client(trusted: Path, holder: Path | None, name: str = "agent") -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(trusted / "ca.pem"))
    if holder is not None:
        context.load_cert_chain(holder / f"{name}.pem", holder / f"{name}.key")
    return context


def _ask(context: ssl.SSLContext, port: int, frame: bytes) -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as connection,
    ):
        connection.sendall(frame)
        return _received(connection)


def _received(connection: socket.socket) -> bytes:
    try:
        return connection.recv(4096)
    except ConnectionResetError:
        return b""  # (closed unanswered)
