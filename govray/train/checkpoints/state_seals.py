"""A search driver's restore state, sealed by the platform's signer: what Ray Tune unpickles when a
search resumes (``tuner.pkl``, its searcher's ``*.pkl``, its ``*.json`` state) lies in storage
every trial's workers can write, so it is unpickled only from a copy the signer sealed.

The driver copies Tune's state files into ``SEARCH/tune-state-SEQUENCE`` and asks the signer to
seal that folder (``Signer.seal_state``: it hashes the files itself and signs their digests, the
search's directory and the sequence number, which only moves forward); the envelope is written
into the folder as ``manifest.sig``. A resume takes the newest such folder whose files match a
statement the operator's trust verifies, about this search's directory, and puts exactly its
files back where Tune reads them (``govray.platform.search.tune_state``).

Example::

    envelope = seal_state_folder(key, search_dir, search_dir / "tune-state-00000003", 3)
    files = verified_state(search_dir / "tune-state-00000003", trust, search_dir)  # name → sha256
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govray.core.canonical import canonical_json
from govray.core.dsse import Envelope, read_envelope, sign_envelope, signing_time, verify_envelope
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey, TrustConfig
from govray.train.checkpoints.manifest import MANIFEST_FILE, SIGNATURE_FILE, CheckpointError
from govray.train.checkpoints.sealing import SealRefused, hashed_files

STATE_SEAL_TYPE = "application/vnd.govray.search-state+json"
STATE_PREFIX = "tune-state-"  # SEARCH/tune-state-00000007: the folder sealed with sequence 7
STATE_SIGNATURE = SIGNATURE_FILE  # the envelope, beside the files (a seal never hashes it)
RESERVED = (MANIFEST_FILE, SIGNATURE_FILE)  # names no state file may have


class StateStatement(BaseModel):
    """What the signer signs about a sealed state folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    directory: str  # the search's directory (resolved), for whose channel it was sealed
    sequence: int = Field(ge=0)
    files: dict[str, str]  # name → sha256
    signed_at: dt.datetime


def state_folder(directory: Path, sequence: int) -> Path:
    return directory / f"{STATE_PREFIX}{sequence:08d}"


def seal_state_folder(key: SigningKey, directory: Path, folder: Path, sequence: int) -> Envelope:
    """Hash every file of ``folder`` (``directory/tune-state-SEQUENCE``, both resolved) and sign
    the statement of its digests with ``key``: the signer's half."""
    expected = state_folder(directory, sequence)
    if folder != expected or folder.is_symlink() or not folder.is_dir():
        raise SealRefused(f"{folder}: not this search's state folder of sequence {sequence} ({expected})")
    files, _ = hashed_files(folder)
    statement = StateStatement(
        directory=str(directory), sequence=sequence, files=files, signed_at=signing_time()
    )
    payload = canonical_json(statement.model_dump(mode="json"))
    return sign_envelope(payload, STATE_SEAL_TYPE, key, statement.signed_at)


def verified_state(folder: Path, trust: TrustConfig, directory: Path) -> StateStatement:
    """The statement sealing ``folder``, which holds exactly the files it names with the digests
    it names, signed by a platform key ``trust`` accepts for the search in ``directory`` (by its
    name); anything else is ``CheckpointError`` (read before any of the files is unpickled)."""
    what = f"the search state {folder}"
    try:
        envelope = read_envelope(folder / STATE_SIGNATURE)
        payload, _ = verify_envelope(
            envelope, trust, KeyRole.PLATFORM, expected_type=STATE_SEAL_TYPE, what=what
        )
        statement = StateStatement.model_validate(json.loads(payload))
        held, _ = hashed_files(folder)
    except (SignatureError, ValidationError, ValueError, OSError) as error:
        raise CheckpointError(f"{what} is not sealed by the platform's signer: {error}") from None
    # By the search's name, as a manifest names its run: on object storage each node's cache of the
    # bucket lies elsewhere, and the name (experiment name and id) is the search's in its storage.
    if Path(statement.directory).name != directory.name:
        raise CheckpointError(f"{what} was sealed for another search ({statement.directory})")
    if folder.name != state_folder(directory, statement.sequence).name:
        raise CheckpointError(f"{what} holds the seal of sequence {statement.sequence}, another folder's")
    if held != statement.files:
        changed = sorted(
            set(held) ^ set(statement.files) | {n for n in held if held[n] != statement.files.get(n)}
        )
        raise CheckpointError(f"{what} changed since the signer sealed it: {', '.join(changed)}")
    return statement
