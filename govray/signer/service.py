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
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from govray.core.canonical import file_sha256
from govray.core.dsse import Envelope, sign_envelope, signing_time
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey
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
        self._lock = threading.Lock()
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
        """Hash checkpoint ``folder`` of the capability's run at ``step`` and sign its manifest."""
        with self._lock:
            run_dir = self._run_of(capability)
            last = int(self._runs[run_dir]["last_step"])  # type: ignore[call-overload]
            directory = _checkpoint_folder(Path(run_dir), Path(folder), step)
            if step <= last:
                raise SealRefused(f"{folder}: step {step} is not after step {last}, the last this run sealed")
            files, refers = _hashed_files(directory), _referenced(Path(run_dir), referenced)
            if held := sorted(set(refers) & set(files)):
                raise SealRefused(f"{folder}: holds {', '.join(held)} itself, and refers to it by digest too")
            files |= refers
            manifest = Manifest(
                step=step, files=files, signed_at=signing_time(), referenced=sorted(referenced) or None
            )
            payload = manifest.to_bytes()
            envelope = sign_envelope(payload, MANIFEST_TYPE, self.key, manifest.signed_at)
            self._runs[run_dir]["last_step"] = step
            self._write_runs()
            return Sealed(payload, envelope)

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
    """Every file of the checkpoint folder, hashed here (a stale manifest and signature aside)."""
    files: dict[str, str] = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name in (MANIFEST_FILE, SIGNATURE_FILE):
            continue
        if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
            raise SealRefused(f"{entry.path}: not a regular file; a checkpoint holds files only")
        files[entry.name] = file_sha256(Path(entry.path))
    return files


def _referenced(run_dir: Path, referenced: dict[str, str]) -> dict[str, str]:
    """The frozen base a checkpoint refers to, hashed in the run's base store."""
    for name, digest in referenced.items():
        if name != MODEL_FILE:
            raise SealRefused(f"only {MODEL_FILE} may be referenced by digest (not {name!r})")
        base = run_dir / BASE_STORE / f"{digest}.safetensors"
        if (
            base.is_symlink()
            or not base.is_file()
            or base.resolve().parent != (run_dir / BASE_STORE).resolve()
        ):
            raise SealRefused(f"{base}: the referenced base is not a file of the run's base store")
        if file_sha256(base) != digest:
            raise SealRefused(f"{base}: its sha256 is not the {digest} the checkpoint refers to")
    return dict(referenced)
