"""What the signer keeps of a run and checks of its folders, shared by the key-holding signer
(``govray.signer.service``) and a node's signer agent (``govray.signer.agent``), which reads the
folders on its node for it.

``folder_check(run_spec, ledgers)`` is what a checkpoint folder must pass besides its files: it
holds the run spec the run was launched with, and the ledger recomputed with it. ``stands(folder,
digest)`` says whether a sealed checkpoint is still there as sealed (a going-back seal supersedes
only checkpoints that no longer stand). ``sealed_steps(run)`` reads a run's record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

from govray.core.errors import SignatureError
from govray.train.checkpoints.ledger_check import LedgerCheck
from govray.train.checkpoints.manifest import CHECKPOINT_PREFIX, MANIFEST_FILE, Manifest
from govray.train.checkpoints.sealing import (
    FolderCheck,
    SealRefused,
    hashed_files,
    opened_folder,
    read_small,
)
from govray.train.runspec import RUN_SPEC_FILE

MAX_MANIFEST = 256 << 20  # bytes: a manifest the signer reads back (a 1 TiB checkpoint's: ~70 MB)


def folder_check(run_spec: object, ledgers: LedgerCheck | None) -> FolderCheck | None:
    """What a folder sealed through a capability bound to ``run_spec`` (a sha256, or None) must
    pass besides its files: it holds that run spec, and the ledger ``ledgers`` recomputes with it
    (None: a signer that checks no ledgers, whose unbound capabilities seal bare test folders)."""
    if run_spec is None:
        if ledgers is None:
            return None  # (unit tests' bare folders)
        raise SealRefused(
            "this run's capability was opened without its run spec: it seals no checkpoint "
            "(a launch binds every run it opens to the run spec its workers receive)"
        )

    def check(folder: Path, files: Mapping[str, str], read: Callable[[str], bytes]) -> None:
        refuse_another_run_spec(folder, files, str(run_spec))
        if ledgers is not None:
            ledgers(folder, files, read)

    return check


def refuse_another_run_spec(folder: Path, files: Mapping[str, str], run_spec: str) -> None:
    if (found := files.get(RUN_SPEC_FILE)) != run_spec:
        raise SealRefused(
            f"{folder}: its {RUN_SPEC_FILE} is not the run spec this run was launched with "
            f"(sha256 {run_spec}); the folder's: {found or 'none'}"
        )


def capability_digest(capability: str) -> str:
    return hashlib.sha256(capability.encode()).hexdigest()


def checkpoint_folder(run_dir: Path, folder: Path, step: int) -> Path:
    """The run's checkpoint folder of ``step`` (``run_dir`` is resolved), if ``folder`` is it: a
    folder, not a link, however the caller spells the path to it."""
    expected = run_dir / f"{CHECKPOINT_PREFIX}{step:08d}"
    if folder.is_symlink() or not folder.is_dir():
        raise SealRefused(f"{folder}: not a folder inside the run directory {run_dir}")
    if folder.resolve() != expected:
        raise SealRefused(f"{folder}: not this run's checkpoint folder of step {step} ({expected})")
    return expected


def sealed_steps(run: Mapping[str, object]) -> dict[int, str | None]:
    """A run's sealed steps and their manifests' sha256 (an older record kept only its last)."""
    sealed = run.get("sealed")
    if isinstance(sealed, dict):
        return {int(step): str(digest) for step, digest in sealed.items()}
    last = int(run.get("last_step", -1))  # type: ignore[call-overload]
    manifest = run.get("manifest")
    return {last: str(manifest) if manifest is not None else None} if last >= 0 else {}


def stands_in(run_dir: Path, step: int, recorded: str | None) -> bool:
    """``stands`` for the run's checkpoint folder of ``step``."""
    return stands(run_dir / f"{CHECKPOINT_PREFIX}{step:08d}", recorded)


def stands(folder: Path, recorded: str | None) -> bool:
    """Whether a checkpoint the signer sealed is still there as sealed: its manifest the one it
    signed (``recorded``: that manifest's sha256; an older record may have none) and every file it
    holds as the manifest lists it. Read as a seal reads: no link, no FIFO, a bounded manifest."""
    try:
        directory = folder.resolve()
        with opened_folder(directory) as descriptor:
            payload = read_small(descriptor, directory / MANIFEST_FILE, MAX_MANIFEST)
        if recorded is not None and hashlib.sha256(payload).hexdigest() != recorded:
            return False  # (before hashing the files: another manifest is no standing seal)
        manifest = Manifest.model_validate_json(payload)
        files, _ = hashed_files(directory)
    except (OSError, ValueError, SignatureError):
        return False
    held = {
        name: digest for name, digest in manifest.files.items() if name not in (manifest.referenced or ())
    }
    return files == held
