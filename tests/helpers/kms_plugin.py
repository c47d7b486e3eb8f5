"""A key-backend plugin as a cloud KMS's would be written (``govray.signer.backends``), its "KMS"
a vault directory outside the signer's (option ``vault``): the keys are made and used there, and
the signer's process only ever holds objects that sign and say their public half. Reached with
the host's own credentials, so it takes no secret. ``signed`` counts the signatures it made."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from govray.core.keys import KeyRole, KeyType, SigningKey
from govray.signer.held_keys import HeldKeys

NAMES = {KeyType.ED25519: "ed25519", KeyType.ECDSA: "ecdsa"}


class VaultKey:
    """A key the vault holds: signing is a call to it (a KMS's ``Sign`` API)."""

    signed = 0

    def __init__(self, vault_key: SigningKey) -> None:
        self._vault_key = vault_key  # (in a real plugin: a key name in the KMS, never the key)

    def public_key(self) -> Ed25519PublicKey | ec.EllipticCurvePublicKey:
        return self._vault_key._private.public_key()

    def sign(self, data: bytes) -> bytes:
        VaultKey.signed += 1
        return self._vault_key.sign(data)


class VaultKms:
    needs_secret = False

    def create(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        vault = Path(options["vault"])
        for keytype, name in NAMES.items():
            SigningKey.generate(KeyRole.PLATFORM, keytype).save(vault / name)
        return self.unlock(directory, options, secret)

    def unlock(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        vault = Path(options["vault"])
        role = KeyRole(options.get("role", KeyRole.PLATFORM.value))  # (a test makes it answer another)
        held = {
            keytype: SigningKey(VaultKey(SigningKey.load(vault / f"{name}.key")), role)
            for keytype, name in NAMES.items()
        }
        return HeldKeys(held[KeyType.ED25519], held[KeyType.ECDSA])
