"""Canonical JSON and digests: the bytes that get hashed and signed.

Canonical JSON here is ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``
encoded as UTF-8, which equals securesystemslib's canonical encoding for the float-free documents
govray signs (key descriptions, signature records, audit events).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# What json.dumps builds on every call with these options: ingest encodes every row once.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> bytes:
    """Serialize ``value`` deterministically (sorted keys, no whitespace, UTF-8)."""
    return _ENCODER.encode(value).encode()


def canonical_text(value: Any) -> str:
    """``canonical_json(value)`` before its UTF-8 encoding."""
    return _ENCODER.encode(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path, chunk_size: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
