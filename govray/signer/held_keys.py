"""What a key backend answers (``govray.signer.backends``): the signer's two platform keys, and
the interface a backend — built in, or a plugin for a cloud KMS — implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from govray.core.keys import SigningKey


@dataclass(frozen=True)
class HeldKeys:
    """The signer's platform keys: Ed25519 (checkpoints, attestations) and ECDSA P-256 (OpenSSF
    model signatures; None for a signer made before it had one)."""

    platform: SigningKey
    model: SigningKey | None


class KeyBackend(Protocol):
    """What a key backend is (``file``, ``pkcs11``, or a plugin's class, instantiated without
    arguments). ``needs_secret``: whether ``create``/``unlock`` take a secret (a KMS reached with
    the host's own credentials needs none). ``options`` are ``backend.yaml``'s, as given to
    ``govray signer init --option KEY=VALUE``."""

    needs_secret: bool

    def create(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        """Make both keys (refusing any that exist already) and return them."""
        ...

    def unlock(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        """The keys made by ``create``, ready to sign (a wrong secret: ``SignatureError``)."""
        ...
