"""Running a recorded code snapshot as sealed: its files' recorded bytes, nothing else.

A replay or a resume imports the trial from its snapshot (``STORAGE/code/DIGEST``, verified by
``snapshots.verify_code``). Verifying the files once is not enough on storage the governed can
write: a module added beside them, bytecode in a ``__pycache__`` that Python prefers to the source,
or a file changed between the check and the import would run instead. So this process imports a
snapshot's modules through ``RecordedCode``, first on ``sys.meta_path``:

- a recorded module is compiled from its source bytes, hashed again as they are read (a file
  changed since the check is refused); bytecode is neither read nor written for it;
- a module whose file lies in the snapshot but is not one of its recorded files is refused, be it
  a source, sourceless bytecode or an extension (also a namespace package's planted
  ``__init__``), since Python's own path finder would load it from there;
- any other module is left to the rest of the import system (govray, torch, the trial's
  dependencies).

Example::

    verify_code(directory, snapshot)
    import_code_from(directory, snapshot.files)
    importlib.import_module(snapshot.module)      # the recorded bytes, compiled here
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from govray.core.canonical import file_sha256
from govray.train.trial import importable


class RecordedCode(importlib.abc.MetaPathFinder):
    """Finds the modules of one recorded snapshot (``files``: path relative to ``directory`` →
    sha256) and loads them from their verified source only."""

    def __init__(self, directory: Path, files: Mapping[str, str]) -> None:
        self.directory, self.files = Path(directory), dict(files)

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        base = name.replace(".", "/")
        for relative in (f"{base}.py", f"{base}/__init__.py"):
            if relative in self.files:
                location = self.directory / relative
                loader = VerifiedSource(name, str(location), self.files[relative])
                package = [str(location.parent)] if relative.endswith("/__init__.py") else None
                return importlib.util.spec_from_file_location(
                    name, location, loader=loader, submodule_search_locations=package
                )
        # Any file the import system could load this name from (a source, sourceless bytecode, an
        # extension; a package's __init__ of each kind) that lies in the snapshot unrecorded.
        for relative in _candidates(base):
            if (self.directory / relative).exists():
                raise ImportError(
                    f"{name}: {self.directory / relative} lies in the recorded code snapshot but is not "
                    "one of its recorded files: refusing to run code that was not recorded",
                    name=name,
                )
        if (self.directory / base).is_dir() and not _is_recorded_package(base, self.files):
            raise ImportError(
                f"{name}: {self.directory / base} is no package of the recorded snapshot", name=name
            )
        return None


class VerifiedSource(importlib.machinery.SourceFileLoader):
    """A recorded module's source, compiled from the bytes read now if they hash to the record."""

    def __init__(self, name: str, path: str, digest: str) -> None:
        super().__init__(name, path)
        self.digest = digest

    def path_stats(self, path: str) -> Any:
        raise OSError("no bytecode for recorded code: compiled from its verified source")

    def get_data(self, path: str) -> bytes:
        data = super().get_data(path)
        if path == self.path and hashlib.sha256(data).hexdigest() != self.digest:
            raise ImportError(
                f"{path} changed since its snapshot was verified (sha256 {self.digest[:16]}… recorded): "
                "refusing to run other code than the recorded trial's",
                name=self.name,
            )
        return data


def import_code_from(directory: Path, files: Mapping[str, str]) -> None:
    """Make ``directory`` — a verified code snapshot holding ``files`` (path relative to the
    import root → sha256) — where this process imports those modules from, whatever its working
    directory, through ``RecordedCode`` (the latest snapshot's, first on ``sys.meta_path``).

    ``directory`` also goes first on ``sys.path``. A module already imported from other bytes
    than the recorded ones is dropped, so the next import reads the snapshot; one imported from the
    same bytes is kept (its classes stay the ones other code holds), and a package among them also
    looks in the snapshot first for its submodules.
    """
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, RecordedCode)]
    sys.meta_path.insert(0, RecordedCode(directory, files))
    if str(directory) in sys.path:
        sys.path.remove(str(directory))  # moved first: the snapshot wins over what else is importable
    importable(directory)
    for relative, digest in files.items():
        name = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        module = sys.modules.get(name)
        loaded = getattr(module, "__file__", None)
        if module is None or loaded is None:
            continue
        if not (Path(loaded).is_file() and file_sha256(Path(loaded)) == digest):
            del sys.modules[name]  # other code than recorded: imported again, from the snapshot
        elif relative.endswith("/__init__.py"):
            package_dir = str((directory / relative).parent)
            if package_dir not in module.__path__:
                module.__path__.insert(0, package_dir)
    importlib.invalidate_caches()


def _candidates(base: str) -> list[str]:
    """Where Python's path finder would look for module ``base`` (as a path) in one directory."""
    suffixes = importlib.machinery.all_suffixes()
    return [base + suffix for suffix in suffixes] + [f"{base}/__init__{suffix}" for suffix in suffixes]


def _is_recorded_package(relative: str, files: Mapping[str, str]) -> bool:
    """``relative`` is a directory of the snapshot that holds recorded files (a package's)."""
    prefix = relative.rstrip("/") + "/"
    return any(name.startswith(prefix) for name in files)
