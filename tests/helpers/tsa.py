"""A local RFC 3161 time-stamping authority for tests: ``openssl ts -reply`` behind a small HTTP
server (the protocol's HTTP transport: POST ``application/timestamp-query``, answer
``application/timestamp-reply``), with its own root and TSA certificates made by ``openssl``.

Example::

    with LocalTsa(tmp_path / "tsa") as tsa:
        tsa.url        # http://127.0.0.1:PORT/
        tsa.root_pem   # the root certificate a verifier trusts
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType

CONFIG = """\
[ req ]
distinguished_name = subject
prompt = no
[ subject ]
CN = govray test time-stamping authority
[ root_extensions ]
basicConstraints = critical, CA:true
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[ tsa_extensions ]
basicConstraints = critical, CA:false
keyUsage = critical, digitalSignature, nonRepudiation
extendedKeyUsage = critical, timeStamping
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[ tsa ]
default_tsa = local
[ local ]
dir = {dir}
serial = $dir/serial
crypto_device = builtin
signer_cert = $dir/tsa.crt
certs = $dir/tsa.crt
signer_key = $dir/tsa.key
signer_digest = sha256
default_policy = 1.3.6.1.4.1.99999.1
digests = sha256, sha384, sha512
accuracy = secs:1
ordering = no
tsa_name = yes
ess_cert_id_chain = no
ess_cert_id_alg = sha256
"""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_authority(directory: Path, name: str = "govray test time-stamping authority") -> Path:
    """A root certificate and a TSA certificate it issued (extended key usage timeStamping,
    critical), with the ``openssl ts`` configuration that signs with it; returns the config."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "openssl.cnf"
    config.write_text(CONFIG.format(dir=directory).replace("govray test time-stamping authority", name))
    (directory / "serial").write_text("01\n")
    new_key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-config", str(config))
    _openssl(
        "req",
        "-x509",
        *new_key,
        "-keyout",
        "root.key",
        "-out",
        "root.crt",
        "-days",
        "2",
        "-extensions",
        "root_extensions",
        "-subj",
        f"/CN={name} root",
        cwd=directory,
    )
    _openssl(
        "req",
        "-new",
        *new_key,
        "-keyout",
        "tsa.key",
        "-out",
        "tsa.csr",
        "-subj",
        f"/CN={name}",
        cwd=directory,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "tsa.csr",
        "-CA",
        "root.crt",
        "-CAkey",
        "root.key",
        "-CAcreateserial",
        "-out",
        "tsa.crt",
        "-days",
        "2",
        "-extfile",
        str(config),
        "-extensions",
        "tsa_extensions",
        cwd=directory,
    )
    return config


class LocalTsa:
    """``openssl ts -reply`` answering RFC 3161 requests over HTTP on 127.0.0.1."""

    def __init__(self, directory: Path, name: str = "govray test time-stamping authority") -> None:
        self.directory = directory
        self.config = make_authority(directory, name)
        self.requests = 0
        self._lock = threading.Lock()
        authority = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                query = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                reply = authority.reply(query)
                self.send_response(200)
                self.send_header("Content-Type", "application/timestamp-reply")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.root_pem = (directory / "root.crt").read_text()

    def reply(self, query: bytes) -> bytes:
        with self._lock, tempfile.TemporaryDirectory(dir=self.directory) as scratch:
            self.requests += 1
            (Path(scratch) / "query.tsq").write_bytes(query)
            _openssl(
                "ts",
                "-reply",
                "-config",
                str(self.config),
                "-queryfile",
                "query.tsq",
                "-out",
                "reply.tsr",
                cwd=Path(scratch),
            )
            return (Path(scratch) / "reply.tsr").read_bytes()

    def __enter__(self) -> LocalTsa:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.server.shutdown()
        self.server.server_close()
