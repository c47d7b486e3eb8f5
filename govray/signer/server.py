"""The signer on a Unix socket (``govray signer serve``), and the client a run uses.

The socket file is created mode 0660 in a directory the signer owns: who may connect is whoever
the deployment puts in the socket's group (the workers' OS user), never a network peer. Each
connection is served in its own thread, one frame at a time; a refused frame is answered with
``{"ok": false, "error": ...}`` and the connection stays usable.

Example::

    with SignerServer(Signer(key, state_dir), socket_path) as server:   # the signer's process
        server.serve_forever()
    client = SignerClient(socket_path)       # a run's launch, then its rank 0 (train.checkpoints.signer)
    capability, after = client.open_run("/storage/ray/run-a")
    sealed = client.seal(capability, "/storage/ray/run-a/checkpoint_00000010", 10)
"""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import socketserver
import struct
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from govray.core.errors import GovrayError, SignatureError
from govray.core.signer_wire import (
    AGENT_OPS,
    OPERATOR_OPS,
    OPS,
    TLS_OPS,
    WIRE_REVISION,
    AttestRequest,
    CloseRunRequest,
    DeriveRequest,
    OffersRequest,
    OpenRunRequest,
    SealedAfterRequest,
    SealHashedRequest,
    SealStateRequest,
    WireError,
    parse_request,
    receive_frame,
    send,
)
from govray.signer.agent import AgentSigner
from govray.signer.service import Signer
from govray.train.checkpoints.blocks import BlockDigests
from govray.train.checkpoints.sealing import HashedFolder, Sealed

IDLE_TIMEOUT_S = 600.0  # a connection silent this long between frames is closed
MAX_CONNECTIONS = 64  # served at once; one more is answered "busy" and closed


class _Connection(socketserver.BaseRequestHandler):
    server: SignerServer

    def handle(self) -> None:
        self.request.settimeout(IDLE_TIMEOUT_S)
        uid = peer_uid(self.request)
        while True:
            try:
                frame = receive_frame(self.request)
            except WireError as error:
                send(self.request, {"ok": False, "error": str(error)})
                return  # a frame it cannot delimit: the stream is lost
            except OSError:
                return  # idle too long, or the peer went away
            if frame is None:
                return
            self.server.heard()
            send(self.request, self.server.answer(frame, uid))


def peer_uid(connection: socket.socket) -> int:
    """The OS user of the process at the other end of a Unix socket (the kernel says, not it)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", credentials)[1])


class SignerServer(socketserver.ThreadingUnixStreamServer):
    """Serves ``signer`` on ``path`` (mode 0660; an old socket file there is replaced). Only the
    OS users in ``open_uids`` (by default the signer's own) may open or close a run or have a
    checkpoint attested; any peer that can reach the socket may seal a checkpoint of a run it
    holds a capability for."""

    daemon_threads = True

    def __init__(
        self,
        signer: Signer | AgentSigner,
        path: Path,
        open_uids: frozenset[int] | None = None,
        idle_exit: float | None = None,
        while_exists: Path | None = None,
    ) -> None:
        self.signer, self.path = signer, Path(path)
        self.open_uids = open_uids if open_uids is not None else frozenset({os.getuid()})
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._served = threading.Condition()  # connections open now, and when the last one closed
        self._open, self._quiet_since = 0, time.monotonic()
        if idle_exit is not None:  # (a development signer: nobody stops it when its launches end)
            watch = threading.Thread(target=self._exit_when_idle, args=(idle_exit, while_exists), daemon=True)
            watch.start()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_socket():
            self.path.unlink()
        super().__init__(str(self.path), _Connection)
        os.chmod(self.path, 0o660)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, at most ``MAX_CONNECTIONS`` at once."""
        if not self._slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                send(request, {"ok": False, "error": f"busy: {MAX_CONNECTIONS} connections are open"})
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._served:
            self._open += 1
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            with self._served:
                self._open -= 1
                self._quiet_since = time.monotonic()

    def heard(self) -> None:
        """A request came (what keeps an idle-exiting signer up)."""
        with self._served:
            self._quiet_since = time.monotonic()

    def _exit_when_idle(self, idle: float, while_exists: Path | None) -> None:
        """Stop serving once no request has come, and no connection has been open, for ``idle``
        seconds, or once ``while_exists`` (a development signer's ``GOVRAY_HOME``) is gone."""
        while True:
            time.sleep(min(idle, 5.0))
            if while_exists is not None and not while_exists.exists():
                break
            with self._served:
                if self._open == 0 and time.monotonic() - self._quiet_since >= idle:
                    break
        self.shutdown()

    def answer(self, frame: bytes, uid: int | None) -> dict[str, Any]:
        """The answer to one request frame from OS user ``uid`` (None: a node's signer agent over
        the TLS listener, ``govray.signer.tls``); a refusal says why, and loses nothing; a file the
        signer cannot read is a refusal too."""
        try:
            request = parse_request(frame)
            if uid is None and request.op not in TLS_OPS:
                raise SignatureError(
                    f"a signer agent may open and close runs and seal what it hashed, not "
                    f"{request.op.replace('_', ' ')}: ask it on the signer's own node"
                )
            if uid is not None and request.op in AGENT_OPS:
                raise SignatureError(
                    f"{request.op.replace('_', ' ')} is a node's signer agent's, over the signer's TLS "
                    "listener: a worker never hands the signer digests"
                )
            if uid is not None and request.op in OPERATOR_OPS and uid not in self.open_uids:
                raise SignatureError(
                    f"OS user {uid} may seal the checkpoints of a run it holds a capability for, not "
                    f"{request.op.replace('_', ' ')}: the platform's launch and commands do that"
                )
            return self._dispatch(request)
        except GovrayError as error:  # (its kind travels: the client raises the same, exit code and all)
            return {"ok": False, "error": str(error), "kind": type(error).__name__}
        except OSError as error:
            return {"ok": False, "error": f"the signer could not seal it (a file or its own record): {error}"}
        except MemoryError:
            return {"ok": False, "error": "the request would take more memory than the signer has"}
        except ValueError as error:  # (a path holding a NUL byte, a number out of range ...)
            return {"ok": False, "error": f"the request cannot name a run or a folder: {error}"}

    def _dispatch(self, request: Any) -> dict[str, Any]:
        if isinstance(request, OpenRunRequest):
            capability, after = self.signer.open_run(request.run_dir, request.run_spec)
            return {"ok": True, "capability": capability, "after_step": after}
        if isinstance(request, CloseRunRequest):
            self.signer.close_run(request.run_dir)
            return {"ok": True}
        if isinstance(request, AttestRequest):
            return self._attested(request)
        if isinstance(request, DeriveRequest):
            sealed = self.signer.derive(
                request.source,
                request.adapter,
                request.directory,
                request.source_uri,
                request.source_attestation,
            )
            return _sealed_answer(sealed)
        if isinstance(request, OffersRequest):
            return {"ok": True, "ops": list(OPS), "wire": WIRE_REVISION}
        if isinstance(request, SealStateRequest):
            envelope = self.signer.seal_state(request.capability, request.folder, request.sequence)
            return {
                "ok": True,
                "envelope": envelope.model_dump(mode="json", by_alias=True, exclude_none=True),
            }
        if isinstance(request, SealedAfterRequest):
            run_dir, run_spec, later = self.signer.sealed_after(request.capability, request.step)
            return {
                "ok": True,
                "run_dir": run_dir,
                "run_spec": run_spec,
                "later": {str(k): v for k, v in later.items()},
            }
        if isinstance(request, SealHashedRequest):
            blocks = {name: BlockDigests.model_validate(found) for name, found in request.blocks.items()}
            hashed = HashedFolder(dict(request.files), blocks, dict(request.refers))
            standing = {step: (request.checked.get(step), stood) for step, stood in request.standing.items()}
            return _sealed_answer(self.signer.seal_hashed(request.capability, request.step, hashed, standing))
        return _sealed_answer(
            self.signer.seal(request.capability, request.folder, request.step, request.referenced)
        )

    def _attested(self, request: AttestRequest) -> dict[str, Any]:
        signed = self.signer.attest(request.checkpoint, request.recorded_manifest, request.model_signature)
        return {
            "ok": True,
            "envelopes": signed.envelopes,
            "subjects": signed.subjects,
            "prefix": str(signed.prefix),
            "model_signature": signed.model_signature,
        }

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        super().__exit__(kind, error, trace)
        self.path.unlink(missing_ok=True)


def _sealed_answer(sealed: Sealed) -> dict[str, Any]:
    return {
        "ok": True,
        "manifest": base64.b64encode(sealed.manifest).decode(),
        "envelope": sealed.envelope.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
