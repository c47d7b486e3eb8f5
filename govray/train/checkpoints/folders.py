"""A run's checkpoint folders where they lie: listing them (in this node's cache and on object
storage), fetching what a rank reads, and the resume rule (the newest folder that verifies).

Example::

    newest = newest_verified_checkpoint(run_dir, trust, storage)   # None: a fresh start
    for folder, refusal in checkpoint_candidates(run_dir, trust, storage):
        ...                                                         # newest first, each verified
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from govray.core.canonical import file_sha256
from govray.core.errors import GovrayError
from govray.core.keys import TrustConfig
from govray.core.storage import IN_PLACE, Storage
from govray.train.checkpoints.files import (
    CHECKPOINT_PREFIX,
    MANIFEST_FILE,
    REPORT_FILE,
    SIGNATURE_FILE,
    STATE_FILE,
    CheckpointError,
    Manifest,
    base_store_file,
    checkpoint_step,
    rank_reads,
    shard_owner,
    verify_checkpoint,
)


def fetch_part(directory: Path, storage: Storage, rank: int) -> None:
    """Of a checkpoint on object storage, the files ``rank`` reads made present in this node's
    cache (a node holds the shards its own ranks wrote; the shared files come from the bucket).
    Unverified: the caller verifies them (``verify_checkpoint(..., rank=R)``)."""
    for name in (MANIFEST_FILE, SIGNATURE_FILE):
        storage.fetch(directory / name)
    try:
        listed = Manifest.model_validate_json((directory / MANIFEST_FILE).read_bytes()).files
    except (OSError, ValidationError):
        return  # no readable manifest: verification says so
    sharded = any(shard_owner(name) is not None for name in listed)
    for name in listed:
        if rank_reads(name, rank, sharded):
            storage.fetch(directory / name)
    fetch_referenced(directory, storage)


def fetch_referenced(directory: Path, storage: Storage, run_dir: Path | None = None) -> None:
    """Of a checkpoint on object storage that refers to its run's base file, that file made
    present in this node's cache (checked against the digest the manifest lists before it
    appears there; the caller verifies the manifest's signature). ``run_dir``: as for
    ``verify_checkpoint``."""
    run_dir = run_dir or directory.parent
    try:
        manifest = Manifest.model_validate_json((directory / MANIFEST_FILE).read_bytes())
    except (OSError, ValidationError):
        return  # no readable manifest: verification says so
    for name in manifest.referenced or ():
        if (directory / name).is_file():
            continue
        digest = manifest.files[name]

        def matches(staged: Path, digest: str = digest) -> None:
            if file_sha256(staged) != digest:
                raise CheckpointError(f"{base_store_file(run_dir, digest)}: sha256 differs on the storage")

        storage.fetch(base_store_file(run_dir, digest), matches)


def ordered_checkpoints(run_dir: Path, storage: Storage = IN_PLACE) -> list[Path]:
    """A run's checkpoint folders with a readable manifest, newest first (by step, then name),
    unverified (each manifest fetched from the storage if needed)."""
    found: list[tuple[int, str, Path]] = []
    for directory in checkpoint_directories(run_dir, storage):
        try:
            storage.fetch(directory / MANIFEST_FILE)
            found.append((-checkpoint_step(directory), directory.name, directory))
        except (OSError, ValueError, KeyError, TypeError, GovrayError):
            continue  # no readable manifest: not a checkpoint (yet)
    return [directory for _, _, directory in sorted(found)]


def checkpoint_directories(run_dir: Path, storage: Storage = IN_PLACE) -> list[Path]:
    """Every checkpoint folder of a run (``checkpoint_*`` right below ``run_dir``, in this node's
    cache and, for object storage, in the storage), whole or partial, sorted by name."""
    return [run_dir / name for name in storage.subdirectories(run_dir, CHECKPOINT_PREFIX)]


def present_checkpoint(directory: Path, trust: TrustConfig, storage: Storage = IN_PLACE) -> Manifest:
    """Verify one of a run's checkpoint folders where it lies (when only the storage holds it,
    fetched into this node's cache, verified before it appears there); returns its manifest and
    raises ``CheckpointError`` naming what does not verify."""
    _fetch_verified(directory, trust, storage)
    return verify_checkpoint(directory, trust)[0]


def _fetch_verified(directory: Path, trust: TrustConfig, storage: Storage) -> None:
    """Fetch a checkpoint folder only the storage holds into this node's cache, verified before it
    appears there (``CheckpointError`` when it does not verify), with the run's base file it
    refers to."""
    if not directory.exists():

        def verified(staged: Path) -> None:
            fetch_referenced(staged, storage, directory.parent)
            verify_checkpoint(staged, trust, run_dir=directory.parent)

        storage.fetch(directory, verified)
    fetch_referenced(directory, storage)


def newest_verified_checkpoint(run_dir: Path, trust: TrustConfig, storage: Storage = IN_PLACE) -> Path | None:
    """The resume rule, the only one: of a run's checkpoint folders, the one with the highest step
    that verifies (signature and every digest); among equal steps the first by name. Folders that
    do not verify (a partial upload by a worker killed mid-copy, a tampered one) are passed over.
    A report lost when a worker died still left its checkpoint here, and resuming from it is
    exact: the tracking store recovers the report from the checkpoint's ``report.json``. (The
    ranks of a sharded run apply the same rule together: ``RunDirectory.resume_point``.)"""
    for directory, refusal in checkpoint_candidates(run_dir, trust, storage):
        if refusal is None:
            return directory
    return None


def checkpoint_candidates(
    run_dir: Path, trust: TrustConfig, storage: Storage = IN_PLACE, rank: int | None = None
) -> Iterator[tuple[Path, str | None]]:
    """A run's checkpoint folders with a readable manifest, newest first (by step, then name),
    each with why it does not verify (None: it does; with ``rank``, as far as that rank reads),
    verified one at a time as the caller asks for the next."""
    candidates: list[tuple[int, str, Path]] = []
    for directory in checkpoint_directories(run_dir, storage):
        try:
            _fetch_verified(directory, trust, storage)
            candidates.append((-checkpoint_step(directory), directory.name, directory))
        except (CheckpointError, OSError, ValueError, KeyError, TypeError):
            continue  # no readable manifest: not a checkpoint (yet)
    for _, _, directory in sorted(candidates):
        try:
            verify_checkpoint(directory, trust, rank, of_run=run_dir.name)
        except CheckpointError as error:
            yield directory, str(error)
        else:
            yield directory, None


def checkpoint_report(directory: Path) -> dict[str, Any]:
    """The report a (verified) checkpoint was reported with: every checkpoint keeps its own."""
    path = directory / REPORT_FILE
    try:
        report = json.loads(path.read_text())
    except OSError as error:
        raise CheckpointError(f"{path}: no report ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not JSON: {error}") from None
    if not isinstance(report, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return report


def checkpoint_run(directory: Path) -> str:
    """The run that wrote a checkpoint, from its state (unverified: loading verifies it)."""
    return str(json.loads((directory / STATE_FILE).read_text()).get("run", ""))
