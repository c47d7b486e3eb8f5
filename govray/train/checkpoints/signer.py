"""Who seals a checkpoint: one interface, one thing a worker may ask sealed.

A worker asks for exactly one thing: that one of its own run's checkpoint folders be sealed. It
hands over no digests and no bytes to sign: the sealer lists and hashes the folder itself
(``govray.train.checkpoints.sealing``). Three twins:

- ``ChannelSigner`` is a worker's (``govray.train.context.WorkerContext.signer``): it asks the
  platform's signer (``govray signer serve``, a separate process that holds the platform key and
  never imports trial code) over its Unix socket, with the capability the run's launch opened for
  this run (``SignerChannel``, in the ``Attempt``). The worker process never holds a key.
- ``KeySigner`` seals in the process that holds the key: the signer service's own sealing runs
  the same code (``sealing.seal_folder``); no platform command uses it any more (tests and tools do).
- ``NoSigner``: a worker built for a tool, outside any run, seals nothing (and so writes no
  checkpoint).

Example::

    signer = ChannelSigner(attempt.signer)          # SignerChannel(socket, capability, run_dir)
    sealed = signer.seal(run_dir / "checkpoint_00000010", 10, referenced={})
"""

from __future__ import annotations

import base64
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from govray.core.dsse import Envelope
from govray.core.errors import AttestationError, ConfigError, GovrayError, SignatureError
from govray.core.keys import KeyRole, SigningKey
from govray.core.signer_wire import AttestRequest, DeriveRequest, SealRequest, SealStateRequest, receive, send
from govray.train.checkpoints.manifest import CHECKPOINT_PREFIX, CheckpointError
from govray.train.checkpoints.sealing import Sealed, base_store_of, seal_folder

# The kinds of refusal a client raises as themselves (their exit codes): any other is a SignatureError.
REFUSALS: dict[str, type[GovrayError]] = {
    kind.__name__: kind for kind in (CheckpointError, AttestationError, ConfigError, SignatureError)
}


class ManifestSigner(Protocol):
    """Seals a checkpoint folder: hashes its files and signs their manifest."""

    @property
    def signs(self) -> bool:
        """Whether this signer seals at all (a worker outside any run writes no checkpoint)."""

    def seal(self, directory: Path, step: int, referenced: Mapping[str, str]) -> Sealed:
        """The manifest of the checkpoint in ``directory`` at ``step`` and its envelope;
        ``referenced``: the frozen base it refers to by sha256 (``{"model.safetensors": SHA}``)."""


class SignerChannel(BaseModel):
    """A run's channel to the platform's signer: its socket, and the capability the run's launch
    opened for the run's directory ``run_dir`` (what a worker alone receives, in its ``Attempt``;
    never in the run spec, never recorded)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: str
    capability: str
    run_dir: str

    def __repr__(self) -> str:  # a capability is a secret: never in a log line or a traceback
        return f"SignerChannel(socket={self.socket!r}, run_dir={self.run_dir!r})"

    __str__ = __repr__


class SignerClient:
    """A connection to the platform's signer at ``path``: one request at a time."""

    def __init__(self, path: Path, timeout: float = 4 * 3600.0) -> None:
        self.path, self.timeout = Path(path), timeout  # (a seal hashes the whole checkpoint: ~1 GB/s)

    def open_run(self, run_dir: str, run_spec: str | None = None) -> tuple[str, int]:
        """(a capability for the run's checkpoints, the last step the signer sealed for it).
        ``run_spec``: the sha256 of the ``run.json`` every checkpoint of the run must hold (None: a
        channel that seals no checkpoint)."""
        answer = self.ask({"op": "open_run", "run_dir": run_dir, "run_spec": run_spec})
        return str(answer["capability"]), int(answer["after_step"])

    def close_run(self, run_dir: str) -> None:
        """Revoke the run's capability (the launch, when its fit ended)."""
        self.ask({"op": "close_run", "run_dir": run_dir})

    def seal(
        self, capability: str, folder: str, step: int, referenced: Mapping[str, str] | None = None
    ) -> Sealed:
        """The signer's manifest of checkpoint ``folder`` at ``step``, and its envelope."""
        request = SealRequest(
            op="seal", capability=capability, folder=folder, step=step, referenced=dict(referenced or {})
        )
        answer = self.ask(request.model_dump())
        return Sealed(base64.b64decode(answer["manifest"]), Envelope.model_validate(answer["envelope"]))

    def seal_state(self, capability: str, folder: str, sequence: int) -> Envelope:
        """The signer's envelope over the files of search-state ``folder`` at ``sequence``."""
        request = SealStateRequest(op="seal_state", capability=capability, folder=folder, sequence=sequence)
        return Envelope.model_validate(self.ask(request.model_dump())["envelope"])

    def attest(self, checkpoint: str, recorded_manifest: str | None, model_signature: bool) -> dict[str, Any]:
        """The signer's signed statements of ``checkpoint`` (an absolute path): ``envelopes`` (kind →
        JSON), ``subjects``, ``prefix`` and ``model_signature`` (``govray.signer.attesting`` writes
        them). A checkpoint that does not verify raises what the signer raised (``CheckpointError``
        for a tampered one: exit 10)."""
        request = AttestRequest(
            op="attest",
            checkpoint=checkpoint,
            recorded_manifest=recorded_manifest,
            model_signature=model_signature,
        )
        return self.ask(request.model_dump())

    def derive(
        self, source: str, adapter: str, directory: str, source_uri: str, source_attestation: str
    ) -> Sealed:
        """The signer's manifest of ``directory`` as the version of ``source`` without ``adapter``
        (it checks every file against its own recomputation), and its envelope."""
        request = DeriveRequest(
            op="derive",
            source=source,
            adapter=adapter,
            directory=directory,
            source_uri=source_uri,
            source_attestation=source_attestation,
        )
        answer = self.ask(request.model_dump())
        return Sealed(base64.b64decode(answer["manifest"]), Envelope.model_validate(answer["envelope"]))

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request's answer; ``SignatureError`` when the signer is not there, or the error the
        signer refused with (its kind: ``CheckpointError``, ``AttestationError`` ...)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(self.timeout)
            try:
                connection.connect(str(self.path))
            except OSError as error:
                raise SignatureError(f"no signer at {self.path}: {error.strerror}") from None
            try:
                send(connection, request)
                answer = receive(connection)
            except (TimeoutError, OSError) as error:
                raise SignatureError(f"the signer at {self.path} did not answer: {error}") from None
        if not answer.get("ok"):
            if " is not offered" in str(answer.get("error")):
                raise SignatureError(
                    f"the signer at {self.path} does not offer {request.get('op')!r}: it runs an older "
                    "govray than this one; restart it with this version"
                )
            kind = REFUSALS.get(str(answer.get("kind")), SignatureError)
            raise kind(f"the signer refused: {answer.get('error')}")
        return answer

    def offers(self) -> tuple[tuple[str, ...], int]:
        """The ops the signer offers and its wire revision (1: it says none; a signer from before
        ``offers`` existed: ``SignatureError``)."""
        answer = self.ask({"op": "offers"})
        return tuple(str(op) for op in answer["ops"]), int(answer.get("wire", 1))


class ChannelSigner:
    """A worker's signer: its own run's checkpoint folders, sealed by the platform's signer."""

    signs = True

    def __init__(self, channel: SignerChannel) -> None:
        from govray.core.settings import load_settings

        self.channel = channel
        # This node's signer: the settings' socket where they name one (on a node without the
        # platform's keys, its signer agent: govray.signer.agent), else the one the launch opened
        # the run on (the development signer of the launch's machine).
        configured = load_settings().signer.socket
        self.socket = str(configured) if configured is not None else channel.socket
        self.client = SignerClient(Path(self.socket))

    def reach(self) -> None:
        """Connect to the signer once (a run whose signer is not there stops before its first
        step, not at its first checkpoint)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(10.0)
            try:
                connection.connect(self.socket)
            except OSError as error:
                where = self.socket
                raise SignatureError(
                    f"no signer at {where} on node {socket.gethostname()} ({error.strerror}): this run "
                    "could seal no checkpoint (a node other than the launch's needs a signer agent: "
                    "`govray signer agent`, at the settings' signer.socket)"
                ) from None

    def seal(self, directory: Path, step: int, referenced: Mapping[str, str]) -> Sealed:
        directory = Path(directory)
        run_dir = Path(self.channel.run_dir)
        if directory.parent.resolve() != run_dir.resolve() or not directory.name.startswith(
            CHECKPOINT_PREFIX
        ):
            raise SignatureError(
                f"{directory}: not a checkpoint folder of this run ({run_dir}): a worker's channel "
                "seals its own run's checkpoints only"
            )
        return self.client.seal(self.channel.capability, str(directory.resolve()), step, referenced)


class KeySigner:
    """A platform key its holder seals with, in process (tests and tools; never a worker's, and no
    platform command's: those ask the signer)."""

    signs = True

    def __init__(self, key: SigningKey) -> None:
        if key.role != KeyRole.PLATFORM:
            raise SignatureError(
                f"key {key.keyid} is a {key.role.value} key; checkpoints need the platform key"
            )
        self.key = key

    def seal(self, directory: Path, step: int, referenced: Mapping[str, str]) -> Sealed:
        folder = Path(directory).resolve()
        return seal_folder(
            self.key, folder.parent.name, folder, step, referenced, base_store_of(folder.parent)
        )


class NoSigner:
    """Seals nothing: a worker built outside any run (a tool's) writes no checkpoint."""

    signs = False

    def seal(self, directory: Path, step: int, referenced: Mapping[str, str]) -> Sealed:
        raise SignatureError(
            f"{directory}: this worker has no channel to the platform's signer; it seals nothing"
        )
