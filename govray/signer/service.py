"""What the signer signs, and for whom: checkpoints of one run, later steps only, files it hashed.

``Signer.open_run(run_dir)`` hands out a capability for one run (a random token; the signer keeps
only its sha256). ``Signer.seal(capability, folder, step, referenced)`` then signs a checkpoint of
that run and nothing else:

- ``folder`` is ``RUN_DIR/checkpoint_STEP`` itself (no symbolic link out of the run), and ``step``
  is later than the last step the signer sealed for the run (kept on the signer's disk, so a
  restart or a second capability never re-opens an earlier step);
- the signer lists and hashes every file of the folder itself (a symbolic link or a directory in it
  is refused); a worker's own digests are never read;
- a frozen base the checkpoint refers to by digest is hashed in the run's base store
  (``RUN_DIR/base/SHA256.safetensors``) and must match it.

Opening a run again (a resume) revokes its earlier capability: one attempt at a time writes it.

Each file is opened relative to the folder's own descriptor, never following a link (a link, a
directory, a FIFO or a device is refused), and refused if its size or modification time changed
while the signer read it; a file's block digests (``NAME.blocks.json``, which a ranged reader
trusts) must be those the signer computed in the same pass. The manifest names the run (its
directory's name) it was sealed for. One seal per run at a time; the hashing holds no lock that
another run's seal needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from govray.core.dsse import Envelope, sign_envelope, signing_time
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey
from govray.train.checkpoints.blocks import BLOCKS_SUFFIX, BlockDigests, blocks_name
from govray.train.checkpoints.manifest import (
    BASE_STORE,
    CHECKPOINT_PREFIX,
    MANIFEST_FILE,
    MANIFEST_TYPE,
    MODEL_FILE,
    SIGNATURE_FILE,
    Manifest,
)

RUNS_FILE = "runs.json"  # in the signer's state directory: per run, its last sealed step
HASH_CHUNK = 1 << 20  # bytes read at a time from a file without block digests
MAX_SIDE_FILE = 64 << 20  # a side file of block digests: 64 bytes of hex a MiB block, and some
BLOCK_SIZES = (1 << 10, 64 << 20)  # the block sizes a side file may claim (what a buffer is sized by)
MAX_HEADER = 100 << 20  # a safetensors header the signer hashes (a larger one is no tensor file)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class SealRefused(SignatureError):
    """The signer will not sign this for this capability (the message says why)."""


@dataclass(frozen=True)
class Sealed:
    """A sealed checkpoint: its manifest's bytes (``manifest.json``) and their DSSE envelope."""

    manifest: bytes
    envelope: Envelope


class Signer:
    """The platform key (role platform) and what it has sealed, per run (``state_dir``)."""

    def __init__(self, key: SigningKey, state_dir: Path) -> None:
        if key.role != KeyRole.PLATFORM:
            raise SignatureError(
                f"key {key.keyid} is a {key.role.value} key; the signer seals with the platform key"
            )
        self.key = key
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the record of runs (held briefly, never while hashing)
        self._sealing: dict[str, threading.Lock] = {}  # per run: the seal in progress
        self._runs: dict[str, dict[str, object]] = self._read_runs()

    def open_run(self, run_dir: str) -> tuple[str, int]:
        """A new capability for the run in ``run_dir`` (an absolute path), and the last step the
        signer sealed for it (0: none); an earlier capability of the run is revoked."""
        given = Path(run_dir)
        if not given.is_absolute() or ".." in given.parts:
            raise SealRefused(f"{run_dir}: a run directory is an absolute path without '..'")
        directory = given.resolve()  # one record per directory, however it is spelled or linked
        capability = secrets.token_urlsafe(32)
        with self._lock:
            run = self._runs.setdefault(str(directory), {"last_step": 0})
            run["capability"] = _digest(capability)
            self._write_runs()
            return capability, int(run["last_step"])  # type: ignore[call-overload]

    def seal(self, capability: str, folder: str, step: int, referenced: dict[str, str]) -> Sealed:
        """Hash checkpoint ``folder`` of the capability's run at ``step`` and sign its manifest.
        One seal per run at a time; other runs' seals go on meanwhile (the hashing holds no lock
        they need)."""
        with self._lock:
            run_dir = self._run_of(capability)
            self._refuse_earlier(run_dir, folder, step)
            sealing = self._sealing.setdefault(run_dir, threading.Lock())
        if not sealing.acquire(blocking=False):
            raise SealRefused(f"{folder}: another checkpoint of this run is being sealed (one at a time)")
        try:
            directory = _checkpoint_folder(Path(run_dir), Path(folder), step)
            files, refers = _hashed_files(directory), _referenced(Path(run_dir), referenced)
            if held := sorted(set(refers) & set(files)):
                raise SealRefused(f"{folder}: holds {', '.join(held)} itself, and refers to it by digest too")
            manifest = Manifest(
                run=Path(run_dir).name,
                step=step,
                files=files | refers,
                signed_at=signing_time(),
                referenced=sorted(referenced) or None,
            )
            payload = manifest.to_bytes()
            envelope = sign_envelope(payload, MANIFEST_TYPE, self.key, manifest.signed_at)
            with self._lock:  # the run may have been opened again (or sealed further) meanwhile
                if self._run_of(capability) != run_dir:
                    raise SealRefused("the capability changed run while sealing")
                self._refuse_earlier(run_dir, folder, step)
                self._runs[run_dir]["last_step"] = step
                self._write_runs()
            return Sealed(payload, envelope)
        finally:
            sealing.release()

    def _refuse_earlier(self, run_dir: str, folder: str, step: int) -> None:
        last = int(self._runs[run_dir]["last_step"])  # type: ignore[call-overload]
        if step <= last:
            raise SealRefused(f"{folder}: step {step} is not after step {last}, the last this run sealed")

    def _run_of(self, capability: str) -> str:
        digest = _digest(capability)
        for run_dir, run in self._runs.items():
            if secrets.compare_digest(str(run.get("capability", "")), digest):
                return run_dir
        raise SealRefused("unknown or revoked capability: open the run again (a resume revokes the last)")

    def _read_runs(self) -> dict[str, dict[str, object]]:
        path = self.state_dir / RUNS_FILE
        if not path.is_file():
            return {}
        try:
            runs = json.loads(path.read_text())
        except ValueError:
            raise SignatureError(
                f"{path}: not JSON; the signer's record of sealed steps is damaged"
            ) from None
        if not isinstance(runs, dict):
            raise SignatureError(f"{path}: not the signer's record of sealed steps")
        return runs

    def _write_runs(self) -> None:
        path = self.state_dir / RUNS_FILE
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(self._runs, indent=1, sort_keys=True))
        os.replace(scratch, path)  # whole, or the old record


def _digest(capability: str) -> str:
    return hashlib.sha256(capability.encode()).hexdigest()


def _checkpoint_folder(run_dir: Path, folder: Path, step: int) -> Path:
    """The run's checkpoint folder of ``step`` (``run_dir`` is resolved), if ``folder`` is it: a
    folder, not a link, however the caller spells the path to it."""
    expected = run_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
    if folder.is_symlink() or not folder.is_dir():
        raise SealRefused(f"{folder}: not a folder inside the run directory {run_dir}")
    if folder.resolve() != expected:
        raise SealRefused(f"{folder}: not this run's checkpoint folder of step {step} ({expected})")
    return expected


def _hashed_files(directory: Path) -> dict[str, str]:
    """Every file of the checkpoint folder, hashed here (a stale manifest and signature aside),
    each opened without following a link (a link, a directory, a FIFO or a device is refused) and
    refused if it changed while it was read. A tensor file's block digests (``NAME.blocks.json``,
    what a ranged reader trusts) must be the ones computed in the same pass over the file."""
    with _opened_folder(directory) as folder:
        names = sorted(name for name in os.listdir(folder) if name not in (MANIFEST_FILE, SIGNATURE_FILE))
        files: dict[str, str] = {}
        claimed: dict[str, BlockDigests] = {}
        for name in (name for name in names if name.endswith(BLOCKS_SUFFIX)):
            content = _read_small(folder, directory / name)
            files[name] = hashlib.sha256(content).hexdigest()
            try:
                digests = BlockDigests.model_validate_json(content)
            except ValueError:
                raise SealRefused(f"{directory / name}: not the block digests of a file") from None
            if not BLOCK_SIZES[0] <= digests.block_size <= BLOCK_SIZES[1]:
                raise SealRefused(
                    f"{directory / name}: blocks of {digests.block_size} bytes (at most {BLOCK_SIZES[1]})"
                )
            claimed[name.removesuffix(BLOCKS_SUFFIX)] = digests
        for name in (name for name in names if not name.endswith(BLOCKS_SUFFIX)):
            blocks = claimed.pop(name, None)
            files[name], computed = _hash_at(folder, directory / name, blocks.block_size if blocks else None)
            if blocks is not None and blocks != computed:
                raise SealRefused(
                    f"{directory / blocks_name(name)}: not the block digests of {name} as the signer read it"
                )
        if claimed:
            raise SealRefused(
                f"{directory}: block digests of files it does not hold: {', '.join(sorted(claimed))}"
            )
        return files


def _referenced(run_dir: Path, referenced: dict[str, str]) -> dict[str, str]:
    """The frozen base a checkpoint refers to, hashed in the run's base store."""
    for name, digest in referenced.items():
        if name != MODEL_FILE:
            raise SealRefused(f"only {MODEL_FILE} may be referenced by digest (not {name!r})")
        base = run_dir / BASE_STORE / f"{digest}.safetensors"
        if not _SHA256.match(digest) or base.is_symlink() or not base.is_file():
            raise SealRefused(f"{base}: the referenced base is not a file of the run's base store")
        with _opened_folder(run_dir / BASE_STORE) as store:
            if _hash_at(store, base, None)[0] != digest:
                raise SealRefused(f"{base}: its sha256 is not the {digest} the checkpoint refers to")
    return dict(referenced)


@contextlib.contextmanager
def _opened_folder(directory: Path) -> Iterator[int]:
    """A descriptor of ``directory`` (a resolved path), opened without following a link, and
    still that path once open (no component swapped for a link meanwhile)."""
    try:
        folder = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise SealRefused(f"{directory}: not a folder the signer can open ({error.strerror})") from None
    try:
        if os.readlink(f"/proc/self/fd/{folder}") != str(directory):
            raise SealRefused(f"{directory}: moved or replaced by a link while the signer opened it")
        yield folder
    finally:
        os.close(folder)


def _hash_at(folder: int, path: Path, block_size: int | None) -> tuple[str, BlockDigests | None]:
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
            raise SealRefused(f"{path}: changed while the signer read it")
        digests = None
        if block_size:
            digests = BlockDigests(
                block_size=block_size, size=size, blocks=blocks, header=_header(descriptor, size)
            )
        return whole.hexdigest(), digests


def _open_file(folder: int, path: Path) -> int:
    """A descriptor of regular file ``path.name`` in ``folder``: opened without following a link
    and without blocking (a FIFO), and refused unless it is a regular file."""
    try:
        descriptor = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError as error:
        raise SealRefused(f"{path}: not a regular file the signer can open ({error.strerror})") from None
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


def _read_small(folder: int, path: Path) -> bytes:
    """A small file's bytes (a side file of block digests), opened as ``_hash_at`` opens files."""
    with os.fdopen(_open_file(folder, path), "rb") as handle:
        content = handle.read(MAX_SIDE_FILE + 1)
    if len(content) > MAX_SIDE_FILE:
        raise SealRefused(f"{path}: larger than {MAX_SIDE_FILE} bytes: not block digests")
    return content
