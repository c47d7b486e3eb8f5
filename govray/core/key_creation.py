"""Creating the platform's keys: explicit, once, and written down.

``init_platform_keys`` creates this machine's keys (the development signer's, ``govray keys
init``); ``govray signer init`` creates a deployed signer's (in a passphrase-encrypted file, a
PKCS#11 token or a KMS: ``govray.signer.backends``). Either appends what it made to the audit
file of the directory it made them in (``audit.jsonl``: when, which OS user on which host, the
key ids, where they are held); nothing creates a platform key on use.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pwd
import socket
from collections.abc import Sequence
from pathlib import Path

from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, KeyType, SigningKey, govray_home, platform_key_path

KEYS_AUDIT_FILE = "audit.jsonl"  # in the keys' directory: every creation of platform keys there


def init_platform_keys(home: Path | None = None) -> list[SigningKey]:
    """Create this machine's platform keys (Ed25519, and ECDSA for model signatures) under
    ``HOME/keys``, once: an existing one is refused. Each creation is appended to
    ``HOME/keys/audit.jsonl``."""
    home = home if home is not None else govray_home()
    for keytype in KeyType:
        if (held := platform_key_path(home, keytype)).exists():
            raise SignatureError(
                f"{held} exists: this machine's platform keys were created already "
                "(rotate them with `govray keys rotate --role platform`)"
            )
    created = [SigningKey.generate(KeyRole.PLATFORM, keytype) for keytype in KeyType]
    for key in created:
        key.save(platform_key_path(home, key.public_key.keytype).with_suffix(""))
    audit_key_creation(home / "keys", created, "file")
    return created


def audit_key_creation(directory: Path, keys: Sequence[SigningKey], held_in: str) -> None:
    """Append the creation of ``keys`` (held in ``held_in``: ``file``, ``pkcs11``, a plugin's
    name) to ``DIRECTORY/audit.jsonl``, synced before returning."""
    entry = {
        "event": "platform_keys_created",
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "uid": os.getuid(),
        "user": _os_user(),
        "host": socket.gethostname(),
        "held_in": held_in,
        "keys": {key.public_key.keytype.value: key.keyid for key in keys},
    }
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / KEYS_AUDIT_FILE, "a") as audit:
        audit.write(json.dumps(entry, sort_keys=True) + "\n")
        audit.flush()
        os.fsync(audit.fileno())


def _os_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # (a uid without a passwd entry, as in some containers)
        return str(os.getuid())
