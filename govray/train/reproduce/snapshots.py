"""What a re-run must find again byte for byte, kept under the experiment's storage: a
content-addressed snapshot of the trial's code (like Determined's model definition) and of every
corpus, and the digests of the other directories the trial reads (its tokenizer's)::

    code/<code digest>/jobs/examples/digits/trial.py      the trial's package, importable as recorded
    corpora/<fingerprint>/public.parquet                  a corpus, in the layout its fingerprint uses

A corpus too large to copy is recorded by its immutable URI and fingerprint instead;
:func:`verify_corpus_snapshot` tells whether the bytes there are still the recorded ones. The
reproducibility record (:mod:`govray.train.reproduce.record`) holds these snapshots.

>>> code = store_trial_code(config.trial, Path(config.storage_path))    # doctest: +SKIP
>>> corpus = snapshot_corpus(config.data.corpora[0], Path(config.storage_path))  # doctest: +SKIP
>>> verify_corpus_snapshot(corpus)                                      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from pydantic import BaseModel, ConfigDict

from govray.config.data import CorpusSpec
from govray.core.canonical import canonical_json, file_sha256, sha256_hex
from govray.core.errors import ConfigError, GovrayError, IngestError
from govray.core.storage import IN_PLACE, Storage
from govray.data.fingerprint import corpus_files, directory_digest, fingerprint_files
from govray.train.reproduce.sealed_code import import_code_from
from govray.train.trial import Trial, load_trial_class

DEFAULT_MAX_COPY_BYTES = 2 * 1024**3

_SNAPSHOT = ConfigDict(extra="forbid", frozen=True)


class ReproducibilityError(GovrayError):
    """A trial's code or a corpus cannot be snapshotted, or a snapshot (or a directory the trial
    reads) no longer matches its recorded bytes."""

    exit_code = 12


# --- trial code -------------------------------------------------------------------------------


class CodeSnapshot(BaseModel):
    """The trial's source files, by path relative to the import root, with their sha256."""

    model_config = _SNAPSHOT

    module: str  # the trial's module, importable from the snapshot directory
    files: dict[str, str]  # relative POSIX path → sha256
    digest: str  # see code_digest


def code_digest(files: dict[str, str]) -> str:
    """sha256 of the canonical JSON of {relative path: file sha256} (sorted by path)."""
    return sha256_hex(canonical_json(dict(sorted(files.items()))))


def snapshot_trial_code(trial_path: str, destination: Path) -> CodeSnapshot:
    """Copy the code of trial ``"package.module:Class"`` into ``destination`` and digest it.

    The trial's module file is copied and, when it lives in a package, every ``.py`` file of that
    package's directory (not its subdirectories) and the ``__init__.py`` of each enclosing
    package, all at their import paths, so ``destination`` on ``sys.path`` imports the trial as
    recorded. A module without a Python source file (compiled, built in) is refused.
    """
    load_trial_class(trial_path)  # imports it exactly as a run would, and checks it is a Trial
    module_name = trial_path.partition(":")[0]
    sources = _module_sources(trial_path, module_name)
    destination.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    for relative, source in sources:
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        files[relative] = file_sha256(target)
    files = dict(sorted(files.items()))
    return CodeSnapshot(module=module_name, files=files, digest=code_digest(files))


def _module_sources(trial_path: str, module_name: str) -> list[tuple[str, Path]]:
    """(path relative to the import root, source file) of the files a code snapshot holds."""
    module = sys.modules[module_name]
    try:
        found = inspect.getsourcefile(module)
    except TypeError:  # built-in modules
        found = None
    if found is None or not found.endswith(".py"):
        raise ReproducibilityError(
            f"trial '{trial_path}': module '{module_name}' has no Python source file to snapshot"
        )
    source = Path(found).resolve()
    package = module.__package__ or ""
    if not package:
        return [(source.name, source)]
    package_dir = source.parent
    depth = package.count(".")  # enclosing packages above the trial's own
    root = package_dir.parents[depth]
    files = [file for file in package_dir.glob("*.py") if file.is_file()]
    enclosing = (package_dir.parents[level] / "__init__.py" for level in range(depth))
    files += [init for init in enclosing if init.is_file()]
    return sorted((file.relative_to(root).as_posix(), file) for file in files)


def verify_code(directory: Path, snapshot: CodeSnapshot) -> None:
    """Raise ReproducibilityError, naming the file, unless ``directory`` holds exactly the bytes
    ``snapshot`` recorded, and nothing else (an extra module, or bytecode Python would prefer to a
    source, would run unrecorded)."""
    where = f"code snapshot {snapshot.digest[:16]}… ({directory})"
    if code_digest(snapshot.files) != snapshot.digest:
        raise ReproducibilityError(f"{where}: the recorded file digests do not add up to its digest")
    if directory.is_dir():
        for path in sorted(directory.rglob("*")):
            relative = path.relative_to(directory).as_posix()
            if (path.is_file() or path.is_symlink()) and relative not in snapshot.files:
                raise ReproducibilityError(
                    f"{where}: {relative} is not one of its recorded files: refusing to run code that "
                    "was not recorded"
                )
    for relative, digest in snapshot.files.items():
        path = directory / relative
        if not path.is_file():
            raise ReproducibilityError(f"{where}: {relative} is missing")
        found = file_sha256(path)
        if found != digest:
            raise ReproducibilityError(
                f"{where}: {path} changed since it was recorded (sha256 {digest[:16]}…, now "
                f"{found[:16]}…): refusing to run other code than the recorded trial's"
            )


def use_recorded_code(snapshot: CodeSnapshot, directory: Path, storage: Storage = IN_PLACE) -> Path:
    """Import the trial from its recorded code snapshot at ``directory`` (``STORAGE/code/DIGEST``,
    fetched from object ``storage`` when this node lacks it), verified first; returns it.

    What a replay or a resume runs is then the recorded code, in the driver and in every worker,
    whatever the working directory and whatever changed in the project since.
    """
    storage.fetch(directory, verify=lambda staged: verify_code(staged, snapshot))
    if not directory.is_dir():
        raise ReproducibilityError(f"code snapshot {snapshot.digest[:16]}…: {directory} is missing")
    verify_code(directory, snapshot)
    import_code_from(directory, snapshot.files)
    return directory


def _code_matches(directory: Path, snapshot: CodeSnapshot) -> bool:
    try:
        verify_code(directory, snapshot)
    except ReproducibilityError:
        return False
    return True


def store_trial_code(trial_path: str, storage: Path) -> CodeSnapshot:
    """Snapshot the code of trial ``trial_path`` into ``STORAGE/code/<digest>/`` (kept once: an
    intact snapshot of the same digest is reused)."""
    code_root = storage / "code"
    with _staging(code_root) as staging:
        code = snapshot_trial_code(trial_path, staging)
        _publish(staging, code_root / code.digest, lambda directory: _code_matches(directory, code))
    return code


# --- corpora ----------------------------------------------------------------------------------


class CorpusSnapshot(BaseModel):
    """Where a corpus's exact bytes can be found again, and the fingerprint they must have."""

    model_config = _SNAPSHOT

    corpus_id: str
    fingerprint: str
    format: str  # selects a directory corpus's files, as the fingerprint does
    uri: str  # file:// URI of the snapshot (copied) or of the original corpus (too large to copy)
    copied: bool
    bytes: int


def snapshot_corpus(
    spec: CorpusSpec, storage: Path, *, max_copy_bytes: int = DEFAULT_MAX_COPY_BYTES
) -> CorpusSnapshot:
    """Keep the corpus's bytes under ``STORAGE/corpora/<fingerprint>/`` (copied once).

    The files keep the relative layout the fingerprint uses, so the snapshot has the same
    fingerprint as the original. An existing snapshot is reused when its bytes still match;
    a new one is written to a temporary directory and renamed into place. A corpus larger than
    ``max_copy_bytes`` is not copied: its original location is recorded with its fingerprint.
    """
    format_name = spec.resolved_format.value
    files = corpus_files(spec.path, format_name, corpus_id=spec.id)
    fingerprint = fingerprint_files(files)
    size = sum(file.stat().st_size for _, file in files)

    def record(location: Path, copied: bool) -> CorpusSnapshot:
        return CorpusSnapshot(
            corpus_id=spec.id,
            fingerprint=fingerprint,
            format=format_name,
            uri=location.resolve().as_uri(),
            copied=copied,
            bytes=size,
        )

    if size > max_copy_bytes:
        return record(spec.path, copied=False)

    def location_in(directory: Path) -> Path:  # a single-file corpus stays a file
        return directory / spec.path.name if spec.path.is_file() else directory

    def holds_corpus(directory: Path) -> bool:
        try:
            return _fingerprint_at(location_in(directory), format_name, spec.id) == fingerprint
        except IngestError:
            return False

    final = storage / "corpora" / fingerprint
    if not holds_corpus(final):
        with _staging(final.parent) as staging:
            for relative, file in files:
                (staging / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(file, staging / relative)
            if not holds_corpus(staging):
                raise ReproducibilityError(
                    f"corpus '{spec.id}': {spec.path} changed while it was being copied"
                )
            _publish(staging, final, holds_corpus)
    return record(location_in(final), copied=True)


def verify_corpus_snapshot(snapshot: CorpusSnapshot) -> None:
    """Raise ReproducibilityError, naming the corpus, unless the bytes at its URI still match."""
    where = f"corpus '{snapshot.corpus_id}'"
    parsed = urlparse(snapshot.uri)
    if parsed.scheme != "file":
        raise ReproducibilityError(f"{where}: cannot read {snapshot.uri} (only file:// URIs are supported)")
    try:
        found = _fingerprint_at(Path(url2pathname(parsed.path)), snapshot.format, snapshot.corpus_id)
    except IngestError as error:
        raise ReproducibilityError(
            f"{where}: the recorded bytes at {snapshot.uri} are gone: {error}"
        ) from None
    if found != snapshot.fingerprint:
        raise ReproducibilityError(
            f"{where}: the bytes at {snapshot.uri} changed since they were recorded "
            f"(fingerprint {snapshot.fingerprint}, now {found})"
        )


def verify_corpora_unchanged(
    corpora: Sequence[CorpusSpec], recorded: Sequence[CorpusSnapshot], *, since: str
) -> None:
    """Raise ReproducibilityError, naming the corpus, unless each configured corpus's bytes still
    have the fingerprint ``recorded`` (a trial's or a search's record) gives it: checked before an
    ingest records anything. ``since`` says what the record is of ("trial 3 trained on it")."""
    fingerprints = {snapshot.corpus_id: snapshot.fingerprint for snapshot in recorded}
    for spec in corpora:
        if spec.id not in fingerprints:
            continue
        found = _fingerprint_at(spec.path, spec.resolved_format.value, spec.id)
        if found != fingerprints[spec.id]:
            raise ReproducibilityError(
                f"corpus '{spec.id}' changed since {since} (fingerprint {fingerprints[spec.id][:16]}… "
                f"→ {found[:16]}…): the same bytes are needed"
            )


def _fingerprint_at(path: Path, format_name: str, corpus_id: str) -> str:
    return fingerprint_files(corpus_files(path, format_name, corpus_id=corpus_id))


# --- other directories a trial reads -----------------------------------------------------------


def input_digests(trial: Trial) -> dict[str, str]:
    """The digest of each directory ``trial`` reads besides its rows (``Trial.input_directories``,
    e.g. its tokenizer's), by the hyperparameter naming it: what a run records of them."""
    digests = {}
    for name, directory in sorted(trial.input_directories().items()):
        if not directory.is_dir():
            raise ConfigError(f"hyperparameter '{name}': {directory} is not a directory")
        digests[name] = directory_digest(directory)
    return digests


def verify_input_digests(recorded: Mapping[str, str], trial: Trial, *, run: str) -> None:
    """Raise ReproducibilityError, naming the directory and both digests, unless every directory
    ``trial`` reads besides its rows still holds the files ``run`` recorded (``recorded``: its
    ``RunSpec.input_digests``)."""
    directories = trial.input_directories()
    for name in sorted(set(recorded) | set(directories)):
        directory = directories.get(name)
        before = recorded.get(name, "none recorded")
        now = directory_digest(directory) if directory is not None and directory.is_dir() else "gone"
        if now != before:
            where = directory if directory is not None else "(the trial names none now)"
            raise ReproducibilityError(
                f"{run} read the {name} directory {where} with digest {before}; it now has "
                f"{now}: refusing to run on other files than the recorded run's"
            )


# --- content-addressed directories ------------------------------------------------------------


@contextlib.contextmanager
def _staging(parent: Path) -> Iterator[Path]:
    """A fresh hidden directory beside the final one (so the rename stays on one file system),
    removed on exit unless it was published."""
    staging = parent / f".staging-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, final: Path, is_intact: Callable[[Path], bool]) -> None:
    """Rename ``staging`` to ``final`` unless an intact ``final`` exists (a damaged one is replaced)."""
    if final.exists():
        if is_intact(final):
            return
        shutil.rmtree(final)
    try:
        staging.rename(final)
    except OSError:
        if not (final.exists() and is_intact(final)):  # else a concurrent writer got there first
            raise
