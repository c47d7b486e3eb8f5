"""What crosses the signer's socket: one JSON object per frame, each way.

A frame is 4 bytes of length (big-endian) and that many bytes of UTF-8 JSON: an object with an
``op`` and its fields. Anything else is refused before it is looked at further — bytes that are
not JSON (a pickle stream begins with ``0x80``), JSON that is not an object, an op the signer does
not offer, a field it does not know — with an answer saying why; the signer never unpickles.

Ops: ``open_run`` (a capability for one run's checkpoints, bound to its run spec), ``close_run``
(its revocation, when the fit ends), ``seal`` (one checkpoint of that run), ``seal_state`` (a
search driver's Tune state, copied into one folder of the search's directory, which a resume
unpickles), ``attest`` (the signed statements of a checkpoint that verifies, and its model
signature: the signer verifies it, builds them from what verified and signs them) and ``derive`` (a
registered version without an adapter, sealed only if its folder holds exactly what the signer
recomputes), and ``offers`` (the ops a signer offers: a client finds an older signer out). All but
``seal``, ``seal_state`` and ``offers`` are the operator's: only the OS users the signer was told
(the launch's, the platform's commands') may ask. The signer signs nothing else, and for a run's
channel nothing but that run's seals: no bytes a caller chose.

Example::

    send(sock, {"op": "open_run", "run_dir": "/storage/ray/run-a", "run_spec": SHA256})
    answer = receive(sock)   # {"ok": true, "capability": "...", "after_step": -1}
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from govray.core.canonical import canonical_json
from govray.core.errors import SignatureError, describe_validation_error

MAX_FRAME = 1 << 20  # bytes: a request names files, it never carries them
MAX_ANSWER = 256 << 20  # bytes: an answer carries a manifest (a 1 MiB block's digest: 67 bytes)
FRAME_DEADLINE_S = 60.0  # a frame begun must be whole within this (no slow trickle holds a slot)
PICKLE_PROTOCOL_MARK = 0x80  # the first byte of a pickle stream (protocol 2 and later)


class WireError(SignatureError):
    """A frame the signer will not read (not JSON, too long, not an op it offers)."""


class OpenRunRequest(BaseModel):
    """A capability for the checkpoints of the run in ``run_dir`` (an absolute path), each holding
    the run spec whose sha256 is ``run_spec`` (the launch's ``RunSpec.sha256()``). None: a channel
    that seals no checkpoint (a search driver's, for its Tune state)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["open_run"]
    run_dir: str
    run_spec: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class CloseRunRequest(BaseModel):
    """Revoke the capability of the run in ``run_dir``: its fit ended."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["close_run"]
    run_dir: str


class SealRequest(BaseModel):
    """Seal checkpoint ``folder`` (``RUN_DIR/checkpoint_STEP``) at ``step``: the signer hashes its
    files and signs their manifest. ``referenced``: the frozen base the checkpoint refers to by its
    sha256 instead of holding it (``{"model.safetensors": SHA256}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["seal"]
    capability: str
    folder: str
    step: int = Field(ge=0)
    referenced: dict[str, str] = Field(default_factory=dict)


class SealStateRequest(BaseModel):
    """Seal ``folder`` (``SEARCH/tune-state-SEQUENCE``, SEARCH the capability's directory) at
    ``sequence``, later than any the signer sealed there: it hashes the files and signs their
    digests (``govray.train.checkpoints.state_seals``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["seal_state"]
    capability: str
    folder: str
    sequence: int = Field(ge=0)


class SealedAfterRequest(BaseModel):
    """A node's signer agent, about to seal ``step`` of the capability's run: the run's directory,
    the sha256 of its run spec, and the steps sealed at or after ``step`` (whose standing it
    checks on its node). Only over the agents' TLS link (``govray.signer.tls``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["sealed_after"]
    capability: str
    step: int = Field(ge=0)


class SealHashedRequest(BaseModel):
    """A node's signer agent's seal: the checkpoint of ``step`` of the capability's run, as the
    agent hashed and checked it on its node (``files``: every file's sha256; ``blocks``: the block
    digests of its tensor files, as ``BlockDigests`` JSON; ``refers``: the frozen base by sha256;
    ``standing``: for each step ``sealed_after`` named, whether its checkpoint still stands, and
    ``checked``: the manifest sha256 it named for it, which the standing was checked against). Only
    over the agents' TLS link: a worker never hands the signer digests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["seal_hashed"]
    capability: str
    step: int = Field(ge=0)
    files: dict[str, str]
    blocks: dict[str, dict[str, Any]] = Field(default_factory=dict)
    refers: dict[str, str] = Field(default_factory=dict)
    standing: dict[int, bool] = Field(default_factory=dict)
    checked: dict[int, str | None] = Field(
        default_factory=dict
    )  # the manifest sha256 each was checked against


class OffersRequest(BaseModel):
    """What this signer offers: its ops (a client built for more finds an older signer out)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["offers"]


class AttestRequest(BaseModel):
    """Attest ``checkpoint`` (an absolute path): the signer verifies it under the operator's
    trust (and that its manifest is ``recorded_manifest``, the sha256 the tracking store recorded
    when it was sealed, when given), builds its provenance and coverage statements and signs
    them; with ``model_signature`` also an OpenSSF model signature of the folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["attest"]
    checkpoint: str
    recorded_manifest: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    model_signature: bool = False


class DeriveRequest(BaseModel):
    """Seal ``directory`` (``STORAGE/models/NAME/VERSION``) as the version of ``source`` (a
    registered version's folder) without adapter ``adapter``: the signer verifies the source and
    ``source_attestation`` (its provenance envelope, JSON), recomputes every file the version must
    hold and seals it only if it holds exactly those. ``source_uri``: ``govray:model/NAME/VERSION``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: Literal["derive"]
    source: str
    adapter: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    directory: str
    source_uri: str = Field(pattern=r"^govray:model/[^/\s]+/[0-9]+$")
    source_attestation: str


AnyRequest = (
    OpenRunRequest
    | CloseRunRequest
    | SealRequest
    | SealStateRequest
    | AttestRequest
    | DeriveRequest
    | OffersRequest
    | SealedAfterRequest
    | SealHashedRequest
)
OPS = (
    "open_run",
    "close_run",
    "seal",
    "seal_state",
    "attest",
    "derive",
    "offers",
    "sealed_after",
    "seal_hashed",
)
AGENT_OPS = ("sealed_after", "seal_hashed")  # a node's signer agent's, over mutual TLS only
# What a signer agent may ask over TLS: open and close its node's launches' runs (it checked their
# OS users), and seal what it hashed.
TLS_OPS = ("open_run", "close_run", "offers", *AGENT_OPS)
# The wire's revision, in the answer to ``offers``: 2 binds a run's capability to its run spec (a
# signer answering with none, or an older one, is from an older govray).
WIRE_REVISION = 2
OPERATOR_OPS = ("open_run", "close_run", "attest", "derive")  # asked by the operator's OS users only
Request = Annotated[AnyRequest, Field(discriminator="op")]
_REQUEST: TypeAdapter[AnyRequest] = TypeAdapter(Request)


def parse_request(frame: bytes) -> AnyRequest:
    """The request in ``frame``, or ``WireError`` saying why it is refused."""
    if frame[:1] == bytes([PICKLE_PROTOCOL_MARK]):
        raise WireError("a pickled payload is refused: the signer reads JSON only")
    try:
        document = json.loads(frame.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WireError("the frame is not JSON: the signer reads JSON only") from None
    except RecursionError:
        raise WireError("the frame nests too deep to be a request") from None
    if not isinstance(document, dict):
        raise WireError("a request is a JSON object with an 'op'")
    if document.get("op") not in OPS:
        raise WireError(
            f"op {document.get('op')!r} is not offered: the signer opens runs, seals their checkpoints "
            "and attests verified ones, nothing else (no tree head, no bytes a caller chose)"
        )
    try:
        return _REQUEST.validate_python(document)
    except ValidationError as error:
        raise WireError(f"malformed {document['op']} request: {describe_validation_error(error)}") from None


def send(connection: socket.socket, document: dict[str, Any]) -> None:
    """One frame: ``document`` as canonical JSON."""
    data = canonical_json(document)
    connection.sendall(struct.pack(">I", len(data)) + data)


def receive_frame(connection: socket.socket, limit: int = MAX_FRAME) -> bytes | None:
    """The next frame's bytes (at most ``limit``); None when the peer closed the connection
    before one began."""
    head = _read(connection, 4)
    if head is None:
        return None
    (length,) = struct.unpack(">I", head)
    if length > limit:
        raise WireError(f"a frame of {length} bytes (at most {limit}): refused")
    data = _read(connection, length, deadline=time.monotonic() + FRAME_DEADLINE_S)
    if data is None:
        raise WireError("the connection closed inside a frame")
    return data


def receive(connection: socket.socket) -> dict[str, Any]:
    """The next frame as a JSON object (what a client reads back: an answer, up to
    ``MAX_ANSWER`` bytes)."""
    frame = receive_frame(connection, MAX_ANSWER)
    if frame is None:
        raise WireError("the signer closed the connection without an answer")
    document = json.loads(frame)
    if not isinstance(document, dict):
        raise WireError("the signer's answer is not a JSON object")
    return document


def _read(connection: socket.socket, count: int, deadline: float | None = None) -> bytes | None:
    """Exactly ``count`` bytes, or None if the peer closed the connection first; with
    ``deadline`` (``time.monotonic()``), ``WireError`` when they have not all come by then."""
    chunks, left = [], count
    idle = connection.gettimeout()
    late = WireError(f"a frame of {count} bytes did not arrive within {FRAME_DEADLINE_S:.0f} s")
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise late
            connection.settimeout(remaining if idle is None else min(idle, remaining))
        try:
            chunk = connection.recv(min(left, 1 << 16))
        except TimeoutError:
            if deadline is None:
                raise
            raise late from None
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
