"""A recorded code snapshot runs as sealed (``govray.train.reproduce.sealed_code``): what a
bad-faith engineer with write access to ``STORAGE/code/DIGEST`` tries, and what a replay or a
resume then runs:

- a module added beside the recorded files: refused when the snapshot is verified, and refused at
  import if it appears after;
- bytecode planted in ``__pycache__`` that Python's own loader would prefer (a valid timestamp
  .pyc of other code): never read; a recorded module is compiled from its source, and no bytecode
  is written into the snapshot;
- a recorded file changed after the check: refused as it is read for the import.
"""

from __future__ import annotations

import importlib
import importlib.util
import marshal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from govray.core.canonical import file_sha256
from govray.train.reproduce.sealed_code import RecordedCode
from govray.train.reproduce.snapshots import (
    CodeSnapshot,
    ReproducibilityError,
    code_digest,
    use_recorded_code,
    verify_code,
)

RECORDED = "ANSWER = 'recorded'\n"


@pytest.fixture
def snapshot(tmp_path: Path) -> Iterator[tuple[Path, CodeSnapshot, str]]:
    """A snapshot of a package of its own (a fresh name: nothing imported it before) holding one
    module; yields (its directory, its record, the package's name)."""
    package = f"sealed_{uuid.uuid4().hex[:8]}"
    directory = tmp_path / "code"
    (directory / package).mkdir(parents=True)
    (directory / package / "__init__.py").write_text("")
    (directory / package / "trial.py").write_text(RECORDED)
    files = {
        f"{package}/__init__.py": file_sha256(directory / package / "__init__.py"),
        f"{package}/trial.py": file_sha256(directory / package / "trial.py"),
    }
    yield directory, CodeSnapshot(module=f"{package}.trial", files=files, digest=code_digest(files)), package
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, RecordedCode)]
    for name in [name for name in sys.modules if name == package or name.startswith(f"{package}.")]:
        del sys.modules[name]
    if str(directory) in sys.path:
        sys.path.remove(str(directory))


def test_the_recorded_module_runs_and_no_bytecode_is_written_into_the_snapshot(
    snapshot: tuple[Path, CodeSnapshot, str],
) -> None:
    directory, record, _ = snapshot
    use_recorded_code(record, directory)
    assert importlib.import_module(record.module).ANSWER == "recorded"
    assert not list(directory.rglob("__pycache__")) and not list(directory.rglob("*.pyc"))
    verify_code(directory, record)  # still exactly the recorded files


def test_a_module_added_beside_the_recorded_files_is_refused(
    snapshot: tuple[Path, CodeSnapshot, str],
) -> None:
    directory, record, package = snapshot
    (directory / package / "helpers.py").write_text("import os\n")
    with pytest.raises(ReproducibilityError, match=f"{package}/helpers.py is not one of its recorded files"):
        use_recorded_code(record, directory)
    (directory / package / "helpers.py").unlink()
    use_recorded_code(record, directory)
    (directory / package / "helpers.py").write_text("import os\n")  # after the check
    with pytest.raises(ImportError, match="is not one of its recorded files"):
        importlib.import_module(f"{package}.helpers")


def test_planted_bytecode_is_never_run(snapshot: tuple[Path, CodeSnapshot, str]) -> None:
    """A timestamp .pyc of other code, matching the recorded source's mtime and size (what
    Python's own loader checks), planted once the snapshot is verified: the import still runs the
    recorded source. Planted before, it is an unrecorded file, refused."""
    directory, record, package = snapshot
    source = directory / package / "trial.py"
    stat = source.stat()
    forged = compile("ANSWER = 'forged'\n", str(source), "exec")
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir()
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    header += int(stat.st_mtime).to_bytes(4, "little") + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    pyc.write_bytes(header + marshal.dumps(forged))
    with pytest.raises(ReproducibilityError, match="__pycache__/.* is not one of its recorded files"):
        use_recorded_code(record, directory)
    moved = directory.parent / "aside.pyc"
    pyc.rename(moved)
    use_recorded_code(record, directory)
    moved.rename(pyc)  # planted after the check
    assert importlib.import_module(record.module).ANSWER == "recorded"


def test_python_s_own_loader_would_have_run_the_planted_bytecode(
    snapshot: tuple[Path, CodeSnapshot, str],
) -> None:
    """The control above is not vacuous: without ``RecordedCode`` the same .pyc runs."""
    directory, record, package = snapshot
    source = directory / package / "trial.py"
    stat = source.stat()
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir()
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    header += int(stat.st_mtime).to_bytes(4, "little") + (stat.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    pyc.write_bytes(header + marshal.dumps(compile("ANSWER = 'forged'\n", str(source), "exec")))
    sys.path.insert(0, str(directory))
    assert importlib.import_module(record.module).ANSWER == "forged"


def test_a_recorded_file_changed_after_the_check_is_refused_as_it_is_read(
    snapshot: tuple[Path, CodeSnapshot, str],
) -> None:
    directory, record, package = snapshot
    use_recorded_code(record, directory)
    (directory / package / "trial.py").write_text("ANSWER = 'changed after the check'\n")
    with pytest.raises(ImportError, match="changed since its snapshot was verified"):
        importlib.import_module(record.module)


@pytest.mark.parametrize("where", ["root", "package", "namespace"])
def test_sourceless_bytecode_planted_after_the_check_is_refused(
    snapshot: tuple[Path, CodeSnapshot, str], where: str
) -> None:
    """A .pyc with no source (Python's path finder loads one as the module itself) planted where
    an import would find it: beside the recorded package, inside it, or as the ``__init__`` of a
    directory of the snapshot that is no recorded package."""
    directory, record, package = snapshot
    use_recorded_code(record, directory)
    name, planted = {
        "root": (f"lazy_{package}", directory / f"lazy_{package}.pyc"),
        "package": (f"{package}.optional", directory / package / "optional.pyc"),
        "namespace": (f"ns_{package}", directory / f"ns_{package}" / "__init__.pyc"),
    }[where]
    planted.parent.mkdir(exist_ok=True)
    code = compile("ANSWER = 'forged'\n", "forged.py", "exec")
    planted.write_bytes(importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code))
    with pytest.raises(ImportError, match="is not one of its recorded files"):
        importlib.import_module(name)
