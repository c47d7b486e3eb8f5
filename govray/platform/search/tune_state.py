"""Ray Tune's restore state, sealed as a search goes and verified before a resume unpickles it.

Tune keeps what it needs to resume a search (``tuner.pkl``: the trainable, the search space and
the run config, pickled; its searcher's ``*.pkl``; its ``*.json`` state, trials pickled inside)
at the top of the search's directory, in storage every trial's workers can write. A resume
unpickles all of it in the driver — which opens runs on the signer and holds the store's
credentials. So:

- while the search runs, ``StateSealer`` (a Tune callback, in the driver) copies those files into
  ``SEARCH/tune-state-SEQUENCE`` whenever Tune has saved a new state (each file read whole: a
  pickle that ends with its STOP opcode, a JSON document that parses; on object storage, read
  where Tune writes it first, the driver's staging directory: Tune syncs it up on its own
  schedule, and a state older than the trials' checkpoints may name one GC deleted), and the
  platform's signer seals the folder over the search's own channel (``seal_state``: it hashes the
  files itself; the sequence only moves forward); older folders go;
- before ``Tuner.restore``, ``restore_sealed_state`` takes the newest folder whose seal the
  operator's trust verifies for this search's directory and puts exactly its files (the bytes it
  verified) where Tune reads them; every other ``*.json`` or ``*.pkl`` there goes. A search with
  no sealed state (one begun before this, or interrupted before Tune's first save) is refused.

Why a seal and not a place workers cannot write: Tune keeps its state and its trials' checkpoints
in one directory tree (the storage every node shares), and the driver is a process of the same
user as the workers; only the signer is out of their reach. What remains: a process that can write
the storage could still swap a file in the moment between this module's write and Tune's read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from govray.core.keys import TrustConfig
from govray.core.storage import Storage
from govray.train.checkpoints.manifest import CheckpointError
from govray.train.checkpoints.signer import SignerChannel, SignerClient
from govray.train.checkpoints.state_seals import (
    RESERVED,
    STATE_PREFIX,
    STATE_SIGNATURE,
    state_folder,
    verified_state,
)

TUNE_STATE = (".json", ".pkl")  # what Tune reads back from the top of a search's directory
PICKLE_MARK = b"\x80"  # a pickle's first byte (protocol 2 and later)
PICKLE_STOP = b"."  # a pickle's last byte (its STOP opcode): one that lacks it was read half written
REMOTE_PERIOD_S = 5.0  # object storage: look for a new Tune state at most this often


class StateSealer(Callback):
    """Seals each new Tune state of the search in ``path`` over ``channel`` (the search's own, the
    driver's), after sequence ``after`` (the one a resume restored; -1: none)."""

    def __init__(self, storage: Storage, path: Path, channel: SignerChannel, after: int = -1) -> None:
        self.storage, self.path, self.channel = storage, path, channel
        self.sequence = after
        self._sealed: dict[str, str] = {}  # name → sha256 of the last state sealed
        self._seen: object = None  # what the files looked like when last read (local storage)
        self._looked = 0.0
        self._staging: Path | None = None  # the driver's staging copy of Tune's state (object storage)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if self._staging is None and trials:  # (object storage: where Tune writes its state first)
            self._staging = Path(trials[0].local_experiment_path)
        throttled = self.storage.is_remote and self._staging is None
        if throttled and time.monotonic() - self._looked < REMOTE_PERIOD_S:
            return
        self.seal()

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        self.seal()  # (Tune saved its final state, waiting for it, just before this)

    def seal(self) -> bool:
        """Seal Tune's state if it changed since the last seal and every file was read whole;
        returns whether it sealed."""
        self._looked = time.monotonic()
        local = self._staging if self.storage.is_remote else self.path
        seen = _stat(local) if local is not None else None
        if seen is not None and seen == self._seen:
            return False
        files = tune_files(self.storage, self.path, self._staging)
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        if not files or not all(_whole(data) for data in files.values()):
            return False  # (looked at again next step: a file half written is being written)
        self._seen = seen
        if digests == self._sealed:
            return False
        # After every folder there (one a crash left unsigned included: the signer may have recorded
        # its sequence, and only moves forward).
        held = self.storage.subdirectories(self.path, STATE_PREFIX)
        numbers = [int(name[len(STATE_PREFIX) :]) for name in held if name[len(STATE_PREFIX) :].isdigit()]
        sequence = max([self.sequence, *numbers]) + 1
        folder = state_folder(self.path, sequence)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        client = SignerClient(Path(self.channel.socket), timeout=120.0)
        envelope = client.seal_state(self.channel.capability, str(folder.resolve()), sequence)
        (folder / STATE_SIGNATURE).write_text(envelope.to_json())
        self.storage.upload(folder)
        for name in self.storage.subdirectories(self.path, STATE_PREFIX):
            if name != folder.name:
                self.storage.delete_directory(self.path / name)
        self.sequence, self._sealed = sequence, digests
        return True


def restore_sealed_state(storage: Storage, path: Path, trust: TrustConfig) -> int:
    """Put the newest sealed Tune state of the search in ``path`` back where Tune reads it: its
    files, as verified, and no other ``*.json`` or ``*.pkl``. Returns its sequence;
    ``CheckpointError`` (naming why each folder was refused) when none verifies."""
    refused: list[str] = []
    for name in reversed(storage.subdirectories(path, STATE_PREFIX)):
        folder = path / name
        storage.fetch(folder)
        try:
            statement = verified_state(folder, trust, path)
            held = {file: (folder / file).read_bytes() for file in statement.files}
        except (CheckpointError, OSError) as error:
            refused.append(str(error))
            continue
        if any(hashlib.sha256(data).hexdigest() != statement.files[file] for file, data in held.items()):
            refused.append(f"{folder} changed while it was read")
            continue
        for stale in set(_tune_names(storage, path)) - set(held):
            storage.delete_file(path / stale)
        path.mkdir(parents=True, exist_ok=True)  # (object storage: this node's cache may lack it)
        for file, data in held.items():
            (path / file).write_bytes(data)
            storage.upload(path / file)
        return statement.sequence
    raise CheckpointError(
        f"search {path.name}: no Ray Tune state sealed by the platform's signer verifies"
        f"{' (' + '; '.join(refused) + ')' if refused else ' (none was sealed)'}; Tune's own state "
        "there is pickled in storage the trials can write, and is not unpickled: start a new experiment"
    )


def tune_files(storage: Storage, path: Path, staging: Path | None = None) -> dict[str, bytes]:
    """The ``*.json`` and ``*.pkl`` at the top of ``path``, as the storage holds them now; on object
    storage, with ``staging`` (the driver's directory Tune writes its state into before it syncs
    it up, on its own schedule), the files there as Tune last wrote them, and from the storage
    only those it does not hold (``tuner.pkl``, an earlier session's state)."""
    files = {}
    if storage.is_remote and staging is not None:
        for name in _local_names(staging):
            with contextlib.suppress(OSError):  # (replaced while listing: the next look reads it)
                files[name] = (staging / name).read_bytes()
    for name in _tune_names(storage, path):
        if name in files:
            continue
        local = path / name
        if storage.is_remote:
            local.unlink(missing_ok=True)  # (the cache's copy is an older state)
            storage.fetch(local)
        with contextlib.suppress(OSError):
            files[name] = local.read_bytes()
    return files


def _tune_names(storage: Storage, path: Path) -> list[str]:
    if not storage.is_remote:
        return _local_names(path)
    names = storage.list_files(path)
    return sorted(name for name in names if name.endswith(TUNE_STATE) and name not in RESERVED)


def _local_names(path: Path) -> list[str]:
    names = [p.name for p in path.iterdir() if p.is_file() and not p.is_symlink()] if path.is_dir() else []
    return sorted(name for name in names if name.endswith(TUNE_STATE) and name not in RESERVED)


def _stat(path: Path) -> list[tuple[str, int, int]] | None:
    """Tune's state files in ``path`` by name, mtime and size: a cheap look for a change."""
    seen = []
    try:
        for entry in os.scandir(path):
            if entry.name.endswith(TUNE_STATE) and entry.is_file(follow_symlinks=False):
                held = entry.stat(follow_symlinks=False)
                seen.append((entry.name, held.st_mtime_ns, held.st_size))
    except OSError:
        return None  # (gone, or a file replaced while listing: read it all)
    return sorted(seen)


def _whole(data: bytes) -> bool:
    """Whether a state file was read whole (Tune's sync may be writing it): a pickle (Tune pickles
    some ``*.json`` too, e.g. its variant generator's state) that ends with its STOP opcode, else a
    JSON document that parses."""
    if data[:1] == PICKLE_MARK:
        return data.endswith(PICKLE_STOP)
    try:
        json.loads(data)
    except ValueError:
        return False
    return True
