"""Where the signer's private keys are held: a key backend, chosen once at ``govray signer init``.

Built in:

- ``file`` (the default): both keys in PKCS#8 files encrypted under a passphrase, in the
  signer's directory (development, or a host whose disk only the signer's OS user reads);
- ``pkcs11``: both keys generated inside a PKCS#11 token, marked sensitive and not extractable,
  used there and never read (an HSM, a cloud HSM's or KMS's PKCS#11 library, SoftHSM2);
  ``govray.signer.pkcs11``.

A **plugin** holds them anywhere else (a cloud KMS's API): a class with the attributes and
methods of :class:`govray.signer.held_keys.KeyBackend`, named by the entry point group
``govray.signer_backends`` (its package's ``pyproject.toml``:
``[project.entry-points."govray.signer_backends"] mykms = "mypkg.kms:KmsBackend"``) or by
``MODULE:CLASS``. Its keys are :class:`govray.core.keys.HeldKey`
objects: ``sign`` calls the KMS; nothing private comes back. The signer never asks a backend for
anything but signatures and public keys.

``DIR/backend.yaml`` (written by ``init``; the signer's directory) says which backend and its
options (a module path, a token label, a KMS key name — never a secret); ``DIR/platform.pub`` and
``DIR/platform-ecdsa.pub`` are the public halves made at init. ``unlock_keys`` refuses keys whose
ids differ from those (a token or a KMS key swapped under the signer). The secret that unlocks
(a passphrase, a token's user PIN) comes from a file the deployment mounts or is typed; it is
never an option, an argument or an environment variable.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from govray.core.errors import SignatureError
from govray.core.key_creation import audit_key_creation
from govray.core.keys import KeyRole, KeyType, PublicKey, SigningKey
from govray.core.yaml_files import parse_yaml_mapping, read_text
from govray.signer.held_keys import HeldKeys, KeyBackend

BACKEND_FILE = "backend.yaml"  # in the signer's directory: {backend: NAME, options: {...}}
ENTRY_POINTS = "govray.signer_backends"
KEY_NAMES = {KeyType.ED25519: "platform", KeyType.ECDSA: "platform-ecdsa"}  # DIR/NAME.pub (.key: file)


class FileBackend:
    """Both keys in ``DIR/platform.key`` and ``DIR/platform-ecdsa.key``, PKCS#8 encrypted under
    the passphrase."""

    needs_secret = True

    def create(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        _no_options("file", options)
        keys = {keytype: SigningKey.generate(KeyRole.PLATFORM, keytype) for keytype in KeyType}
        for keytype, key in keys.items():
            key.save(directory / KEY_NAMES[keytype], passphrase=secret)
        return HeldKeys(keys[KeyType.ED25519], keys[KeyType.ECDSA])

    def unlock(self, directory: Path, options: Mapping[str, str], secret: bytes | None) -> HeldKeys:
        _no_options("file", options)
        key = SigningKey.load(directory / f"{KEY_NAMES[KeyType.ED25519]}.key", secret)
        held = directory / f"{KEY_NAMES[KeyType.ECDSA]}.key"  # (a signer made before it had one)
        return HeldKeys(key, SigningKey.load(held, secret) if held.is_file() else None)


def _no_options(name: str, options: Mapping[str, str]) -> None:
    if options:
        raise SignatureError(f"the {name} backend takes no options (given: {', '.join(sorted(options))})")


def backend_named(name: str) -> KeyBackend:
    """The backend ``name``: ``file``, ``pkcs11``, an entry point of ``govray.signer_backends``,
    or ``MODULE:CLASS``."""
    if name == "file":
        return FileBackend()
    if name == "pkcs11":
        from govray.signer.pkcs11 import Pkcs11Backend  # (python-pkcs11: the `hsm` extra)

        return Pkcs11Backend()
    found = [point for point in importlib.metadata.entry_points(group=ENTRY_POINTS) if point.name == name]
    try:
        if found:
            factory = found[0].load()
        elif ":" in name:
            module, _, attribute = name.partition(":")
            factory = getattr(importlib.import_module(module), attribute)
        else:
            raise SignatureError(
                f"no key backend {name!r}: file, pkcs11, a plugin named in the entry point group "
                f"{ENTRY_POINTS}, or MODULE:CLASS"
            )
    except (ImportError, AttributeError) as error:
        raise SignatureError(f"key backend {name!r} cannot be loaded: {error}") from None
    backend = factory()
    for method in ("create", "unlock"):
        if not callable(getattr(backend, method, None)):
            raise SignatureError(f"key backend {name!r} has no {method}() (see govray.signer.backends)")
    return backend


def read_backend(directory: Path) -> tuple[str, dict[str, str]]:
    """The backend named in ``DIR/backend.yaml`` and its options (no file: ``file``, none)."""
    path = directory / BACKEND_FILE
    if not path.is_file():
        return "file", {}
    document = parse_yaml_mapping(
        read_text(path, SignatureError, "backend file"), str(path), SignatureError, "a backend file"
    )
    name, options = document.get("backend"), document.get("options", {})
    if not isinstance(name, str) or not isinstance(options, dict) or set(document) - {"backend", "options"}:
        raise SignatureError(f"{path}: a backend file is {{backend: NAME, options: {{KEY: VALUE}}}}")
    return name, {str(key): str(value) for key, value in options.items()}


def create_keys(
    directory: Path, name: str, options: Mapping[str, str], secret: bytes | None
) -> tuple[HeldKeys, KeyBackend]:
    """Make the signer's keys in backend ``name`` (refused where a signer was made already),
    write ``backend.yaml`` and the public halves, and audit the creation (``DIR/audit.jsonl``)."""
    for existing in (BACKEND_FILE, *(f"{stem}.pub" for stem in KEY_NAMES.values())):
        if (directory / existing).exists():
            raise SignatureError(f"{directory / existing} exists: this signer's keys were made already")
    backend = backend_named(name)
    _secret_as_needed(backend, name, secret)
    directory.mkdir(parents=True, exist_ok=True)
    keys = backend.create(directory, options, secret)
    _check_roles(keys)
    made = [key for key in (keys.platform, keys.model) if key is not None]
    for key in made:
        public = directory / f"{KEY_NAMES[key.public_key.keytype]}.pub"
        if not public.exists():  # (the file backend wrote it beside the private half)
            key.save_public(public.with_suffix(""))
    document: dict[str, Any] = {"backend": name, "options": dict(options)}
    (directory / BACKEND_FILE).write_text(yaml.safe_dump(document, sort_keys=True))
    audit_key_creation(directory, made, name)
    return keys, backend


def unlock_keys(directory: Path, secret: bytes | None) -> HeldKeys:
    """The signer's keys from its backend, each the key whose public half ``init`` wrote."""
    name, options = read_backend(directory)
    backend = backend_named(name)
    _secret_as_needed(backend, name, secret)
    keys = backend.unlock(directory, options, secret)
    _check_roles(keys)
    for key in (keys.platform, keys.model):
        if key is None:
            continue
        public = directory / f"{KEY_NAMES[key.public_key.keytype]}.pub"
        made = _public_half(public)
        if made is not None and made.keyid != key.keyid:
            raise SignatureError(
                f"the {name} backend holds key {key.keyid}, not {made.keyid} that `govray signer init` "
                f"made ({public}): refusing to sign with a key swapped under the signer"
            )
    return keys


def needs_secret(directory: Path) -> bool:
    """Whether the backend of the signer in ``directory`` takes a secret to unlock."""
    return bool(getattr(backend_named(read_backend(directory)[0]), "needs_secret", True))


def _secret_as_needed(backend: KeyBackend, name: str, secret: bytes | None) -> None:
    if getattr(backend, "needs_secret", True) and not secret:
        raise SignatureError(
            f"the {name} backend needs its secret (a passphrase or a PIN: --passphrase-file)"
        )


def _check_roles(keys: HeldKeys) -> None:
    expected = ((keys.platform, KeyType.ED25519), (keys.model, KeyType.ECDSA))
    for key, keytype in expected:
        if key is not None and (key.role != KeyRole.PLATFORM or key.public_key.keytype != keytype):
            raise SignatureError(
                f"a key backend answered a {key.role.value} {key.public_key.keytype.value} key "
                f"where the platform's {keytype.value} key belongs"
            )


def _public_half(path: Path) -> PublicKey | None:
    if not path.is_file():
        return None
    document = parse_yaml_mapping(
        read_text(path, SignatureError, "public key"), str(path), SignatureError, "a key"
    )
    return PublicKey.model_validate(document)
