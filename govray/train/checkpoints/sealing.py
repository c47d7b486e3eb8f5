"""Sealing a checkpoint folder: every file hashed by the sealer itself, then its manifest signed.

The one implementation of what a seal reads. The platform's signer (``govray.signer``) runs it
for a run's channel; the operator's own commands (``model register``) run it in their process.
Nobody hands the sealer digests: it lists the folder and hashes each file in one pass, which also
yields the block digests of every tensor file a rank may read by byte ranges (``BLOCKED``: model
and optimizer files, whole or sharded), kept in the signed manifest (``Manifest.blocks``).

Each file is opened relative to the folder's own descriptor, never following a link (a link, a
directory, a FIFO or a device is refused), and refused if its size, modification or change time
or inode changed while it was read. A frozen base the checkpoint refers to by digest is hashed in
the run's base store and must match.

Example::

    sealed = seal_folder(key, run_dir, run_dir / "checkpoint_00000010", 10, referenced={})
    (folder / MANIFEST_FILE).write_bytes(sealed.manifest)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from govray.core.dsse import Envelope, sign_envelope, signing_time
from govray.core.errors import SignatureError
from govray.core.keys import SigningKey
from govray.train.checkpoints.blocks import BLOCK_SIZE, BlockDigests
from govray.train.checkpoints.manifest import (
    BASE_STORE,
    MANIFEST_FILE,
    MANIFEST_TYPE,
    MODEL_FILE,
    OPTIMIZER_TENSORS,
    SIGNATURE_FILE,
    STATE_FILE,
    Manifest,
)

HASH_CHUNK = 1 << 20  # bytes read at a time from a file without block digests
MAX_STATE = 256 << 20  # bytes: a checkpoint's state.json (its ledger grows with the model's tensors)
MAX_HEADER = 100 << 20  # a safetensors header the sealer hashes (a larger one is no tensor file)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The tensor files a resharding resume reads by ranges: whole, or one rank's shard.
BLOCKED = re.compile(
    rf"^(?:{re.escape(MODEL_FILE)}|{re.escape(OPTIMIZER_TENSORS)}|(?:model|optimizer)-shard-\d{{5}}-of-\d{{5}}\.safetensors)$"
)


class SealRefused(SignatureError):
    """The sealer will not sign this (the message says why)."""


@dataclass(frozen=True)
class Sealed:
    """A sealed checkpoint: its manifest's bytes (``manifest.json``) and their DSSE envelope."""

    manifest: bytes
    envelope: Envelope


# What else a sealer checks of a folder before signing it: (folder, its files by the sha256 just
# computed, a reader of one of its files' bytes) → None, or SealRefused (the signer's ledger check).
FolderCheck = Callable[[Path, Mapping[str, str], Callable[[str], bytes]], None]


@dataclass(frozen=True)
class HashedFolder:
    """What a sealer read of a checkpoint folder: every file's sha256, the block digests of its
    tensor files, and the frozen base it refers to (by sha256, hashed in the run's base store).
    A signer agent sends it to the key-holding signer (``govray.signer.agent``)."""

    files: dict[str, str]
    blocks: dict[str, BlockDigests]
    refers: dict[str, str]


def seal_folder(
    key: SigningKey,
    run: str,
    folder: Path,
    step: int,
    referenced: Mapping[str, str],
    base_store: Path,
    check: FolderCheck | None = None,
) -> Sealed:
    """Hash every file of ``folder`` (a resolved path) and sign the manifest of run ``run`` at
    ``step`` with ``key``; ``referenced``: the frozen base it refers to by sha256 instead of holding
    it, hashed in ``base_store``; ``check``: refuses a folder it finds wrong before anything is signed."""
    return sign_hashed(key, run, step, hash_folder(folder, step, referenced, base_store, check))


def hash_folder(
    folder: Path, step: int, referenced: Mapping[str, str], base_store: Path, check: FolderCheck | None = None
) -> HashedFolder:
    """Everything ``seal_folder`` reads of ``folder`` (its state that of ``step``; ``check`` passed)."""
    files, blocks = hashed_files(folder)
    state = _refuse_another_step(folder, files, step)
    if check is not None:  # (state.json as just read: read once)
        check(folder, files, lambda name: state if name == STATE_FILE else _read_listed(folder, name))
    refers = referenced_files(base_store, referenced)
    if held := sorted(set(refers) & set(files)):
        raise SealRefused(f"{folder}: holds {', '.join(held)} itself, and refers to it by digest too")
    return HashedFolder(files, blocks, refers)


def sign_hashed(key: SigningKey, run: str, step: int, hashed: HashedFolder) -> Sealed:
    """The manifest of run ``run`` at ``step`` over ``hashed``, signed with ``key``."""
    manifest = Manifest(
        run=run,
        step=step,
        files=hashed.files | hashed.refers,
        signed_at=signing_time(),
        referenced=sorted(hashed.refers) or None,
        blocks=hashed.blocks or None,
    )
    payload = manifest.to_bytes()
    return Sealed(payload, sign_envelope(payload, MANIFEST_TYPE, key, manifest.signed_at))


def _refuse_another_step(folder: Path, files: Mapping[str, str], step: int) -> bytes:
    """The folder's ``state.json`` is the state of ``step``, and the one just hashed: a manifest
    never says one step while the state it seals says another. Returns its bytes."""
    if STATE_FILE not in files:
        raise SealRefused(f"{folder}: holds no {STATE_FILE}; a checkpoint holds its state")
    with opened_folder(folder) as descriptor:
        content = read_small(descriptor, folder / STATE_FILE, MAX_STATE)
    if hashlib.sha256(content).hexdigest() != files[STATE_FILE]:
        raise SealRefused(f"{folder / STATE_FILE}: changed while the sealer read it")
    try:
        found = json.loads(content).get("step")
    except (ValueError, AttributeError):
        found = None
    if found != step:
        raise SealRefused(f"{folder / STATE_FILE}: the state of step {found!r}, not of step {step}")
    return content


def _read_listed(folder: Path, name: str) -> bytes:
    with opened_folder(folder) as descriptor:
        return read_small(descriptor, folder / name, MAX_STATE)


def hashed_files(directory: Path) -> tuple[dict[str, str], dict[str, BlockDigests]]:
    """Every file of a checkpoint folder (a stale manifest and signature aside) by its sha256, and
    the block digests of its ``BLOCKED`` tensor files, computed in the same pass."""
    with opened_folder(directory) as folder:
        names = sorted(name for name in os.listdir(folder) if name not in (MANIFEST_FILE, SIGNATURE_FILE))
        files: dict[str, str] = {}
        blocks: dict[str, BlockDigests] = {}
        for name in names:
            files[name], computed = hash_at(
                folder, directory / name, BLOCK_SIZE if BLOCKED.match(name) else None
            )
            if computed is not None:
                blocks[name] = computed
        return files, blocks


def referenced_files(base_store: Path, referenced: Mapping[str, str]) -> dict[str, str]:
    """The frozen base a checkpoint refers to, hashed in the run's base store."""
    for name, digest in referenced.items():
        if name != MODEL_FILE:
            raise SealRefused(f"only {MODEL_FILE} may be referenced by digest (not {name!r})")
        base = base_store / f"{digest}.safetensors"
        if not _SHA256.match(digest) or base.is_symlink() or not base.is_file():
            raise SealRefused(f"{base}: the referenced base is not a file of the run's base store")
        with opened_folder(base_store) as store:
            if hash_at(store, base, None)[0] != digest:
                raise SealRefused(f"{base}: its sha256 is not the {digest} the checkpoint refers to")
    return dict(referenced)


def base_store_of(run_dir: Path) -> Path:
    """The run's base store (``RUN_DIR/base``)."""
    return run_dir / BASE_STORE


@contextlib.contextmanager
def opened_folder(directory: Path) -> Iterator[int]:
    """A descriptor of ``directory`` (a resolved path), opened without following a link, and
    still that path once open (no component swapped for a link meanwhile)."""
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise SealRefused(f"{directory}: not a folder the sealer can open ({error.strerror})") from None
    try:
        if os.readlink(f"/proc/self/fd/{folder}") != str(directory):
            raise SealRefused(f"{directory}: moved or replaced by a link while the sealer opened it")
        yield folder
    finally:
        os.close(folder)


def hash_at(folder: int, path: Path, block_size: int | None) -> tuple[str, BlockDigests | None]:
    """The sha256 of file ``path.name`` in ``folder`` (and its block digests, with
    ``block_size``): a regular file, not a link, unchanged while it was read."""
    descriptor = _open_file(folder, path)
    with os.fdopen(descriptor, "rb", buffering=0) as handle:
        before = os.fstat(descriptor)
        whole, blocks, size = hashlib.sha256(), list[str](), 0
        chunk = block_size or HASH_CHUNK
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        while filled := _fill(handle, view):  # whole blocks, however short each read is
            whole.update(view[:filled])
            if block_size:
                blocks.append(hashlib.sha256(view[:filled]).hexdigest())
            size += filled
        after = os.fstat(descriptor)
        # ctime and the inode too, which the file's owner cannot set back (mtime they can)
        stamp = ("st_size", "st_mtime_ns", "st_ctime_ns", "st_ino", "st_dev")
        if size != before.st_size or any(getattr(before, f) != getattr(after, f) for f in stamp):
            raise SealRefused(f"{path}: changed while the sealer read it")
        digests = None
        if block_size:
            digests = BlockDigests(
                block_size=block_size, size=size, blocks=blocks, header=_header(descriptor, size)
            )
        return whole.hexdigest(), digests


def read_small(folder: int, path: Path, limit: int) -> bytes:
    """A small file's bytes (at most ``limit``), opened as ``hash_at`` opens files: no link, no
    FIFO, nothing but a regular file."""
    with os.fdopen(_open_file(folder, path), "rb") as handle:
        content = handle.read(limit + 1)
    if len(content) > limit:
        raise SealRefused(f"{path}: larger than {limit} bytes")
    return content


def _open_file(folder: int, path: Path) -> int:
    """A descriptor of regular file ``path.name`` in ``folder``: opened without following a link
    and without blocking (a FIFO), and refused unless it is a regular file."""
    try:
        descriptor = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError as error:
        raise SealRefused(f"{path}: not a regular file the sealer can open ({error.strerror})") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise SealRefused(f"{path}: not a regular file; a checkpoint holds files only")
    return descriptor


def _fill(handle: io.RawIOBase, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; the bytes read."""
    filled = 0
    while filled < len(view) and (read := handle.readinto(view[filled:])):
        filled += read
    return filled


def _header(descriptor: int, size: int) -> str | None:
    """sha256 of a safetensors file's header (its 8-byte length and the JSON; None: not one, or a
    header larger than ``MAX_HEADER``, which no tensor file the platform writes has)."""
    prefix = os.pread(descriptor, 8, 0)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else size
    if 8 + length > size or length > MAX_HEADER:
        return None
    return hashlib.sha256(prefix + os.pread(descriptor, length, 8)).hexdigest()
