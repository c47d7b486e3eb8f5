"""Corpus fingerprints a third party can recompute.

The fingerprint of a corpus is the sha256 of, for each of its files in sorted relative-POSIX-path
order::

    utf8(relative_path) || 0x00 || ascii(decimal byte length) || 0x00 || file bytes

A single-file corpus has that file's name as its relative path; a directory corpus takes every
non-hidden file with the format's extension, recursively. The length prefix keeps the encoding
unambiguous (a file's bytes cannot pose as the next path). Any other directory a run reads (a
tokenizer's) has the same digest over every non-hidden file in it (:func:`directory_digest`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from govray.core.errors import IngestError

EXTENSIONS = {"parquet": (".parquet",), "jsonl": (".jsonl", ".json"), "csv": (".csv",)}


def corpus_files(path: Path, format_name: str, *, corpus_id: str) -> list[tuple[str, Path]]:
    """(relative POSIX path, file) pairs of a corpus, sorted by relative path."""
    if not path.exists():
        raise IngestError(f"corpus '{corpus_id}': path {path} does not exist")
    if path.is_file():
        return [(path.name, path)]
    suffixes = EXTENSIONS[format_name]
    found = [(relative, file) for relative, file in visible_files(path) if file.suffix.lower() in suffixes]
    if not found:
        raise IngestError(
            f"corpus '{corpus_id}': directory {path} holds no {format_name} files ({', '.join(suffixes)})"
        )
    return found


def visible_files(directory: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, file) pairs of every file below ``directory`` outside hidden folders
    and not hidden itself, recursively, sorted by relative path."""
    found = []
    for file in directory.rglob("*"):
        relative = file.relative_to(directory)
        if file.is_file() and not any(part.startswith(".") for part in relative.parts):
            found.append((relative.as_posix(), file))
    return sorted(found)


def directory_digest(directory: Path) -> str:
    """The fingerprint of every visible file below ``directory`` (:func:`visible_files`): what a run
    records of a directory it reads besides its corpora, e.g. a tokenizer's."""
    return fingerprint_files(visible_files(directory))


def fingerprint_files(files: list[tuple[str, Path]]) -> str:
    """sha256 over (relative path, length, bytes) of each file, in the given (sorted) order."""
    digest = hashlib.sha256()
    for relative, file in files:
        size = file.stat().st_size
        digest.update(relative.encode() + b"\x00" + str(size).encode() + b"\x00")
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
