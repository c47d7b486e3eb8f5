"""What the signer signs, and for whom: checkpoints of one run, moving forward, files it hashed.

``Signer.open_run(run_dir, run_spec)`` hands out a capability for one run (a random token; the
signer keeps only its sha256, with the run spec's). ``Signer.seal(capability, folder, step,
referenced)`` then signs a checkpoint of that run and nothing else:

- ``folder`` is ``RUN_DIR/checkpoint_STEP`` itself (no symbolic link out of the run);
- the signer lists and hashes every file of the folder itself, with the block digests of its
  tensor files (``govray.train.checkpoints.sealing``); a worker's own digests are never read;
- a frozen base the checkpoint refers to by digest is hashed in the run's base store
  (``RUN_DIR/base/SHA256.safetensors``) and must match it;
- the folder's run spec (``run.json``) must be the one the launch opened the run with (its
  sha256, given to ``open_run``): rank 0 writes it, so a trial could otherwise rewrite the routing
  the ledger is recomputed with, and the policy signer the provenance cites;
- the ledger the folder's ``state.json`` claims must be the one recomputed from that state's
  schedule and the routing of that run spec, after the ledger of the checkpoint the run started
  from, if any (``govray.train.checkpoints.ledger_check``; no trial
  code: token counts are compared where they are data, in a packed store);
- ``step`` is later than every step the signer sealed for the run whose checkpoint still stands
  (kept on the signer's disk, so a restart or a second capability never re-opens an earlier step):
  a checkpoint the signer sealed stands while its folder holds the manifest it signed and every
  file that manifest lists, unchanged. Once the later ones no longer stand (a worker killed
  between the seal and writing it, a checkpoint refused as tampered, a folder gone), a resume that
  retrains the steps after the checkpoint it verified can seal them again. Every seal is appended
  to the signer's own record first (``seals.jsonl``: run, step, manifest sha256, and the steps a
  going-back seal superseded; written and synced before the seal is answered), which no worker
  can write: a run's sealed history, supersessions included, is read there.

``Signer.attest(checkpoint, ...)`` is the operator's (the server asks it only for the operator's OS
users): the checkpoint is verified under the operator's trust and must be one this signer sealed
that still stands in its record (a run's checkpoint no going-back seal superseded, or a derived
version): a copy of the key used elsewhere, or an old checkpoint put back after its step was
sealed again, is not attested. The statements are built from what verified
(``govray.provenance.attest.sign_attestation``) and signed; nothing the caller wrote is signed.
No trial code is imported: the routing comes from the signed run spec.

Opening a run again (a resume) revokes its earlier capability: one attempt at a time writes it;
``close_run`` (the launch, when the fit ends) revokes it with nothing in its place.
The manifest names the run (its directory's name) it was sealed for. One seal per run at a time;
the hashing holds no lock that another run's seal needs.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from govray.core.dsse import Envelope
from govray.core.errors import SignatureError
from govray.core.keys import KeyRole, SigningKey
from govray.core.settings import operator_trust
from govray.signer.records import (
    capability_digest,
    checkpoint_folder,
    folder_check,
    refuse_another_run_spec,
    sealed_steps,
    stands_in,
)
from govray.train.checkpoints.ledger_check import LedgerCheck
from govray.train.checkpoints.manifest import CHECKPOINT_PREFIX, Manifest
from govray.train.checkpoints.sealing import (
    FolderCheck,
    HashedFolder,
    Sealed,
    SealRefused,
    base_store_of,
    hash_folder,
    seal_folder,
    sign_hashed,
)
from govray.train.checkpoints.state_seals import seal_state_folder

if TYPE_CHECKING:
    from govray.provenance.attest import SignedAttestation
    from govray.provenance.predicates import Derivation

RUNS_FILE = "runs.json"  # in the signer's state directory: per run, its sealed steps
SEALS_FILE = "seals.jsonl"  # every seal the signer made, one JSON object a line
DERIVED_FILE = "derived.jsonl"  # every version it sealed as derived from another, by manifest sha256

__all__ = ["SealRefused", "Sealed", "Signer"]


class Signer:
    """The platform key (role platform) and what it has sealed, per run (``state_dir``)."""

    def __init__(
        self,
        key: SigningKey,
        state_dir: Path,
        model_key: SigningKey | None = None,
        *,
        check_ledgers: bool = True,
    ) -> None:
        """``check_ledgers``: recompute each checkpoint's ledger before sealing it (always, but in
        unit tests whose folders hold no training state: ``LedgerCheck`` has its own)."""
        for held in (key, model_key):
            if held is not None and held.role != KeyRole.PLATFORM:
                raise SignatureError(
                    f"key {held.keyid} is a {held.role.value} key; the signer signs with the platform's keys"
                )
        self.key, self.model_key = key, model_key  # (model_key: ECDSA, for OpenSSF model signatures)
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the record of runs (held briefly, never while hashing)
        self._sealing: dict[str, threading.Lock] = {}  # per run: the seal in progress
        self._runs: dict[str, dict[str, object]] = self._read_runs()
        self._derived: dict[str, Derivation] = self._read_derived()  # manifest sha256 → derivation
        self._ledgers = LedgerCheck(lambda: operator_trust(key=self.key)) if check_ledgers else None

    def open_run(self, run_dir: str, run_spec: str | None = None) -> tuple[str, int]:
        """A new capability for the run in ``run_dir`` (an absolute path), and the last step the
        signer sealed for it (-1: none yet; a run may seal its step 0); an earlier capability of
        the run is revoked. ``run_spec``: the sha256 of the ``run.json`` each checkpoint sealed
        through it must hold, the launch's spec (None: it seals no checkpoint, unless the signer
        checks no ledgers)."""
        given = Path(run_dir)
        if not given.is_absolute() or ".." in given.parts:
            raise SealRefused(f"{run_dir}: a run directory is an absolute path without '..'")
        directory = given.resolve()  # one record per directory, however it is spelled or linked
        capability = secrets.token_urlsafe(32)
        with self._lock:
            run = self._runs.setdefault(str(directory), {"last_step": -1})
            run["capability"] = capability_digest(capability)
            run["run_spec"] = run_spec
            self._write_runs()
            return capability, int(run["last_step"])  # type: ignore[call-overload]

    def seal(self, capability: str, folder: str, step: int, referenced: dict[str, str]) -> Sealed:
        """Hash checkpoint ``folder`` of the capability's run at ``step`` and sign its manifest.
        One seal per run at a time; other runs' seals go on meanwhile (the hashing holds no lock
        they need)."""

        def hashed(run_dir: Path, check: FolderCheck | None) -> HashedFolder:
            directory = checkpoint_folder(run_dir, Path(folder), step)
            return hash_folder(directory, step, referenced, base_store_of(run_dir), check)

        return self._seal(capability, folder, step, hashed, lambda run_dir, s, d: stands_in(run_dir, s, d))

    def sealed_after(self, capability: str, step: int) -> tuple[str, str | None, dict[int, str | None]]:
        """For a node's signer agent about to seal ``step``: the capability's run directory, the
        sha256 of the run spec it is bound to, and the steps sealed at or after ``step`` (with
        their manifests' sha256), whose standing the agent checks on its node."""
        with self._lock:
            run_dir = self._run_of(capability)
            run = self._runs[run_dir]
            later = {s: d for s, d in sealed_steps(run).items() if s >= step}
            spec = run.get("run_spec")
            return run_dir, str(spec) if spec is not None else None, later

    def seal_hashed(
        self,
        capability: str,
        step: int,
        hashed: HashedFolder,
        standing: Mapping[int, tuple[str | None, bool]],
    ) -> Sealed:
        """Sign the manifest of a checkpoint a node's signer agent hashed and checked (its state's
        step, its ledger, its base: ``govray.signer.agent``), at ``step`` of the capability's run.
        Checked here: the capability, the run spec it is bound to (by the files' digests), and that
        ``step`` is after every sealed step the agent did not report no longer standing (``standing``:
        per step, the manifest sha256 it checked against and whether that checkpoint stands; one
        sealed again since is refused, to be sealed again)."""
        with self._lock:
            spec = self._runs[self._run_of(capability)].get("run_spec")

        def given(run_dir: Path, check: FolderCheck | None) -> HashedFolder:
            if check is not None:
                refuse_another_run_spec(run_dir / f"{CHECKPOINT_PREFIX}{step:08d}", hashed.files, str(spec))
            return hashed

        def stood(run_dir: Path, later: int, recorded: str | None) -> bool:
            checked, stands = standing.get(later, (None, False))
            if later not in standing or checked != recorded:
                raise SealRefused(f"step {later} of this run was sealed meanwhile: seal step {step} again")
            return stands

        return self._seal(capability, f"{CHECKPOINT_PREFIX}{step:08d}", step, given, stood)

    def _seal(
        self,
        capability: str,
        folder: str,
        step: int,
        hashed: Callable[[Path, FolderCheck | None], HashedFolder],
        stands: Callable[[Path, int, str | None], bool],
    ) -> Sealed:
        with self._lock:
            run_dir = self._run_of(capability)
            sealing = self._sealing.setdefault(run_dir, threading.Lock())
            check = folder_check(self._runs[run_dir].get("run_spec"), self._ledgers)
        if not sealing.acquire(blocking=False):
            raise SealRefused(f"{folder}: another checkpoint of this run is being sealed (one at a time)")
        try:
            superseded = self._going_back(run_dir, folder, step, stands)
            sealed = sign_hashed(self.key, Path(run_dir).name, step, hashed(Path(run_dir), check))
            digest = hashlib.sha256(sealed.manifest).hexdigest()
            with self._lock:  # the run may have been opened again meanwhile
                if self._run_of(capability) != run_dir:
                    raise SealRefused("the capability changed run while sealing")
                self._append_seal(run_dir, step, digest, superseded)  # the record first
                run = self._runs[run_dir]
                kept = {str(s): d for s, d in sealed_steps(run).items() if s < step}
                run.update(last_step=step, sealed=kept | {str(step): digest})
                run.pop("manifest", None)  # (an older record's last manifest: in ``sealed`` now)
                self._write_runs()
            return sealed
        finally:
            sealing.release()

    def attest(
        self, checkpoint: str, recorded_manifest: str | None = None, model_signature: bool = False
    ) -> SignedAttestation:
        """The signed statements of ``checkpoint`` (an absolute path), verified under the operator's
        trust (this signer's key and the settings' trust file) and, when given, holding the manifest
        ``recorded_manifest``; with ``model_signature`` also its OpenSSF model signature."""
        given = Path(checkpoint)
        if not given.is_absolute() or ".." in given.parts:
            raise SealRefused(f"{checkpoint}: a checkpoint is named by an absolute path without '..'")
        if model_signature and self.model_key is None:
            raise SealRefused(
                "this signer holds no model-signing key (govray signer init makes one): no model signature"
            )
        # (imported here: a signer that only seals never loads torch or Ray)
        from govray.provenance.attest import sign_attestation

        return sign_attestation(  # (a checkpoint that does not verify: its CheckpointError, AttestationError)
            given,
            self.key,
            operator_trust(key=self.key),
            model_key=self.model_key if model_signature else None,
            recorded_manifest=recorded_manifest,
            derivations=self._derived.get,
            sealed_here=self._sealed_here,
        )

    def _sealed_here(self, manifest_sha256: str) -> bool:
        """Whether this signer sealed that manifest and it still stands in its record: a run's
        checkpoint (not superseded by a later going-back seal) or a derived version."""
        with self._lock:
            standing = {d for run in self._runs.values() for d in sealed_steps(run).values() if d}
        return manifest_sha256 in standing or manifest_sha256 in self._derived

    def derive(self, source: str, adapter: str, directory: str, source_uri: str, envelope: str) -> Sealed:
        """Seal ``directory`` as the version of verified ``source`` without ``adapter``, if it
        holds exactly that version's files (``govray.provenance.derivation.expected_files``);
        ``envelope``: the source's provenance attestation, whose removed adapters and excluded
        corpora the derivation continues. The derivation is recorded by the manifest's sha256
        (``derived.jsonl``): ``attest`` states it."""
        from govray.provenance.derivation import (
            DerivedRecord,
            derivation_of,
            derived_state,
            expected_files,
            verified_source_statement,
        )
        from govray.provenance.locations import signed_run_spec
        from govray.train.checkpoints.files import load_checkpoint

        paths = [Path(source), Path(directory)]
        if any(not path.is_absolute() or ".." in path.parts for path in paths):
            raise SealRefused("a source and a version's folder are named by absolute paths without '..'")
        folder = paths[1].resolve()
        if not folder.name.isdigit() or folder.parent.parent.name != "models":
            raise SealRefused(
                f"{directory}: a derived version's folder is STORAGE/models/NAME/VERSION "
                "(never a run's checkpoint)"
            )
        trust = operator_trust(key=self.key)
        loaded = load_checkpoint(paths[0], trust)
        if adapter not in loaded.state.adapters:
            raise SealRefused(f"{source} carries no adapter {adapter!r}")
        spec = signed_run_spec(paths[0], trust)
        statement = verified_source_statement(envelope.encode(), paths[0], trust, loaded.manifest)
        state = derived_state(loaded.state, adapter)
        expected = expected_files(paths[0], trust, loaded.manifest, spec, state, adapter)
        sealed = seal_folder(
            self.key, folder.parent.name, folder, state.step, {}, base_store_of(folder.parent)
        )
        held = Manifest.model_validate_json(sealed.manifest).files
        if held != expected:
            wrong = sorted(name for name in set(held) | set(expected) if held.get(name) != expected.get(name))
            raise SealRefused(
                f"{directory}: not {source} without adapter {adapter!r} "
                f"(files that differ: {', '.join(wrong)})"
            )
        record = DerivedRecord(
            hashlib.sha256(sealed.manifest).hexdigest(),
            derivation_of(spec, loaded.state, adapter, statement, source_uri, envelope.encode()),
        )
        with self._lock, open(self.state_dir / DERIVED_FILE, "a") as kept:
            kept.write(record.to_json() + "\n")
            kept.flush()
            os.fsync(kept.fileno())
            self._derived[record.manifest_sha256] = record.derivation
        return sealed

    def seal_state(self, capability: str, folder: str, sequence: int) -> Envelope:
        """Sign the digests of the files of ``folder``, the capability's search state folder of
        ``sequence`` (``SEARCH/tune-state-SEQUENCE``), which must be later than any this signer
        sealed for it: what a resume of the search will unpickle (``state_seals``)."""
        with self._lock:
            run_dir = self._run_of(capability)
            last = int(self._runs[run_dir].get("last_state", -1))  # type: ignore[call-overload]
        if sequence <= last:
            raise SealRefused(
                f"{folder}: sequence {sequence} is not after {last}, the last state sealed here"
            )
        given = Path(folder)
        if not given.is_absolute() or given.is_symlink():
            raise SealRefused(f"{folder}: a state folder is named by an absolute path, not a link")
        envelope = seal_state_folder(self.key, Path(run_dir), given.resolve(), sequence)
        with self._lock:
            if self._run_of(capability) != run_dir:
                raise SealRefused("the capability changed run while sealing")
            held = int(self._runs[run_dir].get("last_state", -1))  # type: ignore[call-overload]
            self._runs[run_dir]["last_state"] = max(sequence, held)
            self._write_runs()
        return envelope

    def close_run(self, run_dir: str) -> None:
        """Revoke the run's capability (its fit ended); its record of sealed steps stays."""
        directory = str(Path(run_dir).resolve())
        with self._lock:
            if directory in self._runs and self._runs[directory].pop("capability", None) is not None:
                self._write_runs()

    def _going_back(
        self, run_dir: str, folder: str, step: int, stands: Callable[[Path, int, str | None], bool]
    ) -> list[int]:
        """The sealed steps at or after ``step`` (none: it is after them all), each checked to no
        longer stand (a going-back seal supersedes them); refused while any of them stands."""
        sealed = sealed_steps(self._runs[run_dir])
        later = sorted((s for s in sealed if s >= step), reverse=True)
        for earlier in later:  # newest first: the usual case is one lost or refused checkpoint
            if stands(Path(run_dir), earlier, sealed[earlier]):
                raise SealRefused(
                    f"{folder}: step {step} is not after step {earlier}, which this run sealed and whose "
                    "checkpoint stands"
                )
        return sorted(later)

    def _append_seal(self, run_dir: str, step: int, digest: str, superseded: list[int]) -> None:
        entry: dict[str, object] = {
            "run_dir": run_dir,
            "step": step,
            "manifest_sha256": digest,
            "at": dt.datetime.now(dt.UTC).isoformat(),
        }
        if superseded:
            entry["superseded_steps"] = superseded
        with open(self.state_dir / SEALS_FILE, "a") as record:
            record.write(json.dumps(entry, sort_keys=True) + "\n")
            record.flush()
            os.fsync(record.fileno())

    def _run_of(self, capability: str) -> str:
        digest = capability_digest(capability)
        for run_dir, run in self._runs.items():
            if secrets.compare_digest(str(run.get("capability", "")), digest):
                return run_dir
        raise SealRefused("unknown or revoked capability: open the run again (a resume revokes the last)")

    def _read_derived(self) -> dict[str, Derivation]:
        path = self.state_dir / DERIVED_FILE
        if not path.is_file():
            return {}
        from govray.provenance.derivation import DerivedRecord

        records = [DerivedRecord.from_json(line) for line in path.read_text().splitlines() if line.strip()]
        return {record.manifest_sha256: record.derivation for record in records}

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
        with open(scratch, "w") as handle:
            handle.write(json.dumps(self._runs, indent=1, sort_keys=True))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)  # whole, or the old record
