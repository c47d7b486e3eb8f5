"""Signers across nodes: the key-holding signer's TLS listener, and the link its nodes' signer
agents (``govray.signer.agent``) reach it by.

Ray Train places a run's rank 0 on any node; the signer that holds the platform's keys runs on
one (the head, beside the launches). Every other node runs a **signer agent**: no key, its node's
Unix socket (the settings' ``signer.socket``, the same path everywhere), the checkpoint folders of
that node read and checked there, and what it read sent here to be signed. Agent and signer
authenticate each other with TLS certificates from one certificate authority of the deployment's
own (``make_certificates``: ``govray signer tls-init DIR --host HEAD``): the signer presents
``signer.pem`` (valid for the hosts named), an agent ``agent.pem``; each trusts ``ca.pem`` only
and refuses a peer without a certificate it issued. The CA's key signs nothing else and belongs
off the nodes. Over TLS the signer answers an agent's ops only (``TLS_OPS``: opening and closing
runs for its node's launches, whose OS users the agent checked, and sealing what it hashed); a
worker never reaches the listener (it holds no certificate), and the Unix socket refuses the
agents' ops.

Example::

    make_certificates(Path("/etc/govray/tls"), hosts=["10.0.0.5"])
    listener = TlsListener(unix_server, ("0.0.0.0", 7071), Path("/etc/govray/tls"))   # the head
    HeadLink("10.0.0.5:7071", Path("/etc/govray/tls")).ask({"op": "offers"})          # an agent
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
import socketserver
import ssl
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from govray.core.errors import SignatureError
from govray.core.signer_wire import MAX_ANSWER, WireError, receive, receive_frame, send
from govray.train.checkpoints.signer import REFUSALS


class Answering(Protocol):
    """What the listener hands an agent's frames to: the key-holding signer's server."""

    def answer(self, frame: bytes, uid: int | None) -> dict[str, Any]: ...

    def heard(self) -> None: ...


CA, SIGNER, AGENT = "ca", "signer", "agent"  # DIR/NAME.pem (and NAME.key: the private key, 0600)
AGENT_NAME = "govray signer agent"
HANDSHAKE_TIMEOUT_S = 10.0
MAX_AGENT_CONNECTIONS = 64  # at once; one more is closed before its handshake (no thread, no wait)
AGENT_IDLE_S = 600.0  # an agent's connection silent this long between frames is closed
VALID_DAYS = 3650


def make_certificates(directory: Path, hosts: Sequence[str]) -> list[Path]:
    """A certificate authority and the two certificates it issues in ``directory``: the signer's
    (valid for ``hosts``: names or addresses the agents reach it by) and the agents'. Refuses a
    directory that holds them already."""
    if not hosts:
        raise SignatureError("name at least one host the signer agents reach the signer by (--host)")
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / f"{CA}.pem").exists():
        raise SignatureError(f"{directory}: holds a certificate authority already (one per deployment)")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "govray signer CA")])
    ca = _certificate(ca_name, ca_name, ca_key, ca_key.public_key(), authority=True)
    written = [_write(directory, CA, ca, ca_key)]
    for name, common, usage, names in (
        (SIGNER, "govray signer", ExtendedKeyUsageOID.SERVER_AUTH, [_alternative(host) for host in hosts]),
        (AGENT, AGENT_NAME, ExtendedKeyUsageOID.CLIENT_AUTH, []),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
        issued = _certificate(subject, ca_name, ca_key, key.public_key(), usage=usage, names=names)
        written.append(_write(directory, name, issued, key))
    return written


def _alternative(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _certificate(
    subject: x509.Name,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    public: ec.EllipticCurvePublicKey,
    *,
    authority: bool = False,
    usage: x509.ObjectIdentifier | None = None,
    names: Sequence[x509.GeneralName] = (),
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
        .add_extension(
            x509.BasicConstraints(ca=authority, path_length=0 if authority else None), critical=True
        )
    )
    builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    builder = builder.add_extension(
        x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
    )
    builder = builder.add_extension(
        x509.KeyUsage(
            digital_signature=not authority,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=authority,
            crl_sign=authority,
            encipher_only=False,
            decipher_only=False,
        ),
        critical=True,
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=True)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(
    directory: Path, name: str, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> Path:
    private = directory / f"{name}.key"
    descriptor = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    public = directory / f"{name}.pem"
    public.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return public


def server_context(directory: Path) -> ssl.SSLContext:
    """The key-holding signer's: its certificate, and a client certificate the CA issued required."""
    context = _context(ssl.Purpose.CLIENT_AUTH, directory, SIGNER)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(directory: Path) -> ssl.SSLContext:
    """An agent's: its certificate, and the signer's checked against the CA and the host name."""
    return _context(ssl.Purpose.SERVER_AUTH, directory, AGENT)


def _context(purpose: ssl.Purpose, directory: Path, holder: str) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(purpose, cafile=str(directory / f"{CA}.pem"))
        context.load_cert_chain(directory / f"{holder}.pem", directory / f"{holder}.key")
    except (OSError, ssl.SSLError) as error:  # (a missing file, or not a certificate or key)
        raise SignatureError(
            f"{directory}: cannot load {CA}.pem, {holder}.pem and {holder}.key ({error}); "
            "`govray signer tls-init` writes them"
        ) from None
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for an IPv6 address)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SignatureError(f"{address!r}: not HOST:PORT")
    return host.strip("[]"), int(port)


class HeadLink:
    """An agent's link to the key-holding signer at ``address`` (``HOST:PORT``): one request a
    connection, over mutual TLS."""

    def __init__(self, address: str, directory: Path, timeout: float = 4 * 3600.0) -> None:
        self.address, self.timeout = address, timeout
        self.host, self.port = parse_address(address)
        self.context = client_context(directory)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """The signer's answer; ``SignatureError`` when it cannot be reached or refuses (its kind
        travels as the Unix socket's clients raise it)."""
        try:
            with (
                socket.create_connection((self.host, self.port), timeout=self.timeout) as raw,
                self.context.wrap_socket(raw, server_hostname=self.host) as connection,
            ):
                send(connection, request)
                answer = receive(connection)
        except (
            OSError,
            WireError,
            ValueError,
        ) as error:  # (ssl.SSLError is an OSError; ValueError: not JSON)
            raise SignatureError(f"the platform's signer at {self.address} did not answer: {error}") from None
        if not answer.get("ok"):
            kind = REFUSALS.get(str(answer.get("kind")), SignatureError)
            raise kind(f"the signer refused: {answer.get('error')}")
        return answer


class _Agent(socketserver.BaseRequestHandler):
    server: TlsListener

    def handle(self) -> None:
        raw: socket.socket = self.request
        raw.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            connection = self.server.context.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            return  # no certificate the CA issued, or no TLS at all: nothing is read
        with connection:
            if _common_name(connection.getpeercert()) != AGENT_NAME:
                return  # (the signer's own certificate is no agent's)
            connection.settimeout(self.server.inner_idle)
            while True:
                try:
                    frame = receive_frame(connection, MAX_ANSWER)  # (a seal's block digests: large)
                except WireError as error:
                    send(connection, {"ok": False, "error": str(error)})
                    return
                except OSError:
                    return
                if frame is None:
                    return
                self.server.inner.heard()
                send(connection, self.server.inner.answer(frame, None))


class TlsListener(socketserver.ThreadingTCPServer):
    """The key-holding signer (``inner``, its Unix-socket server: ``govray.signer.server``) on
    ``address`` for its nodes' signer agents, with the certificates in ``directory``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, inner: Answering, address: tuple[str, int], directory: Path) -> None:
        self.inner, self.inner_idle = inner, AGENT_IDLE_S
        self.context = server_context(directory)
        self._slots = threading.BoundedSemaphore(MAX_AGENT_CONNECTIONS)
        super().__init__(address, _Agent)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, at most ``MAX_AGENT_CONNECTIONS`` at once (anyone who reaches
        the port can connect before the handshake refuses them)."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    @property
    def port(self) -> int:
        return int(self.server_address[1])


def _common_name(certificate: Any) -> str | None:
    """The subject's common name of a peer's certificate as ``ssl`` decodes it."""
    for entry in (certificate or {}).get("subject", ()):
        for key, value in entry:
            if key == "commonName":
                return str(value)
    return None
