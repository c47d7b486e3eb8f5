"""Who signs a checkpoint's manifest: one interface, one method per thing a worker may ask signed.

A worker asks for exactly one thing: the manifest of one of its own run's checkpoints. It never
holds a signing function of its own to point at other bytes. ``RunSigner`` is the worker's slot
(``govray.train.context.WorkerContext.signer``): it signs only a checkpoint manifest, of a
checkpoint folder of its own run's directory. Until the platform's signer runs outside the
trial's process (the wave-4 Evidence work), it loads the platform key in process, on first use;
the interface is what that service will answer.
``KeySigner`` is the platform's own commands' (``model register`` seals a registered version
with the key the operator's process holds).

Example::

    signer = RunSigner(Path(spec.platform_key), Path(spec.run_dir))
    envelope = signer.sign_manifest(folder, manifest_bytes, signed_at)
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Protocol

from govray.core.dsse import Envelope, sign_envelope
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey
from govray.train.checkpoints.manifest import CHECKPOINT_PREFIX, MANIFEST_TYPE, Manifest


class ManifestSigner(Protocol):
    """Signs a checkpoint's manifest (the bytes of its ``manifest.json``)."""

    @property
    def signs(self) -> bool:
        """Whether this signer signs at all (a run without a platform key writes no checkpoint)."""

    def sign_manifest(self, directory: Path, payload: bytes, signed_at: dt.datetime) -> Envelope:
        """The DSSE envelope over the manifest ``payload`` of the checkpoint in ``directory``."""


class KeySigner:
    """A platform key its holder signs with (the operator's own process, not a worker's)."""

    signs = True

    def __init__(self, key: SigningKey) -> None:
        _refuse_other_roles(key)
        self.key = key

    def sign_manifest(self, directory: Path, payload: bytes, signed_at: dt.datetime) -> Envelope:
        return sign_envelope(payload, MANIFEST_TYPE, self.key, signed_at)


class RunSigner:
    """A worker's signer: manifests of its own run's checkpoints (folders of ``run_dir``) only.
    ``key_path`` empty: the run signs nothing (and so writes no checkpoint)."""

    def __init__(self, key_path: Path | None, run_dir: Path) -> None:
        self.key_path = key_path
        self.run_dir = Path(run_dir)
        self._key: SigningKey | None = None

    @property
    def signs(self) -> bool:
        return self.key_path is not None

    def load(self) -> None:
        """Load the key now (the rank that seals checkpoints, when its run starts): a missing file
        or another role's key is refused before any step trains, not at the first checkpoint."""
        if self.key_path is None:
            raise SignatureError("this run signs no checkpoint: it was planned without the platform key")
        if self._key is None:
            key = SigningKey.load(self.key_path)
            _refuse_other_roles(key)
            self._key = key

    def sign_manifest(self, directory: Path, payload: bytes, signed_at: dt.datetime) -> Envelope:
        directory = Path(directory)
        if self.key_path is not None and (
            directory.parent.resolve() != self.run_dir.resolve()
            or not directory.name.startswith(CHECKPOINT_PREFIX)
        ):
            raise SignatureError(
                f"{directory}: not a checkpoint folder of this run ({self.run_dir}): a worker signs "
                "its own run's checkpoints only"
            )
        self.load()
        _refuse_other_payloads(directory, payload)
        assert self._key is not None
        return sign_envelope(payload, MANIFEST_TYPE, self._key, signed_at)


def _refuse_other_roles(key: SigningKey) -> None:
    if key.role != KeyRole.PLATFORM:
        raise SignatureError(f"key {key.keyid} is a {key.role.value} key; checkpoints need the platform key")


def _refuse_other_payloads(directory: Path, payload: bytes) -> None:
    """The payload is a checkpoint manifest: what gets signed is a checkpoint's."""
    try:
        Manifest.model_validate_json(payload)
    except ValueError as error:
        raise SignatureError(
            f"{directory}: what was handed to sign is no checkpoint manifest: {error}"
        ) from None
