"""What ingest checks in each corpus file itself, so a refusal names the file, row and column.

Ray Data's readers refuse some bad files with an error that names nothing (a 0-byte CSV, a
malformed JSONL line, a duplicated CSV header) and silently accept others (a JSONL object with a
key given twice keeps the last value). Ingest therefore checks every file before Ray Data reads it
(:func:`check_file`, one Ray task per file), and when Ray Data still fails, reads the files again
one by one to say which one and where (:func:`diagnose_file`).

Positions, in every format: **rows count from 0** (the first data row is row 0; a CSV header
and blank lines are not rows), as the shards' ``_row`` and ``govray lineage row`` do; for text
files (CSV, JSONL) the message adds the **line**, counted from 1 as editors show it.

Example::

    problem = check_file(Path("lic.jsonl"), "jsonl")
    # "/data/lic.jsonl row 2 (line 3): key 'x' appears twice in the same object"
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq


def at(file: Path, row: int | None = None, line: int | None = None) -> str:
    """``FILE row R (line L)``: where in a corpus file (row from 0, line from 1)."""
    where = str(file)
    if row is not None:
        where += f" row {row}"
    if line is not None:
        where += f" (line {line})"
    return where


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def duplicated(names: list[str]) -> list[str]:
    """The names given more than once, in order of first appearance."""
    counts = Counter(names)
    return [name for name in dict.fromkeys(names) if counts[name] > 1]


def check_file(file: Path, format_name: str) -> str | None:
    """The first problem of one corpus file, ``"WHERE: WHAT"``, or None.

    Every format: a 0-byte file is empty. Parquet: the schema names no column twice. CSV: the
    header names no column twice. JSONL: every non-blank line is one JSON object that names no
    key twice (at any depth).
    """
    try:
        if file.stat().st_size == 0:
            return f"{file} is empty (0 bytes)"
        if format_name == "parquet":
            try:
                names = pq.read_schema(file).names
            except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ...
                return f"{file}: not a readable parquet file: {error}"
            if twice := duplicated(names):
                return f"{file}: the parquet schema names column(s) {_names(twice)} more than once"
            return None
        if format_name == "csv":
            return _check_csv_header(file)
        return _check_jsonl(file)
    except UnicodeDecodeError as error:
        return f"{file}: not UTF-8 text ({error.reason} at byte {error.start})"
    except OSError as error:
        return f"{file}: cannot read it: {error.strerror or error}"


def _names(names: list[str]) -> str:
    return ", ".join(f"'{name}'" for name in names)


def _check_csv_header(file: Path) -> str | None:
    for line, record in _csv_records(file):
        if twice := duplicated(record):
            return f"{at(file, line=line)}: the CSV header names column(s) {_names(twice)} more than once"
        return None
    return f"{file} is empty (no header, no rows)"


def _csv_records(file: Path) -> Iterator[tuple[int, list[str]]]:
    """(1-based line where the record starts, fields) of each non-blank CSV record."""
    with open(file, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        start = 1
        for record in reader:
            if record:  # a blank line is no record (pyarrow skips it too)
                yield start, record
            start = reader.line_num + 1


def _check_jsonl(file: Path) -> str | None:
    rows = 0
    with open(file, encoding="utf-8") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue  # blank lines are no rows (Ray Data skips them too)
            row = rows
            rows += 1
            try:
                value = json.loads(text, object_pairs_hook=_no_duplicate_keys)
            except _DuplicateKey as error:
                return f"{at(file, row, line)}: key '{error}' appears twice in the same object"
            except json.JSONDecodeError as error:
                return f"{at(file, row, line)}: malformed JSON: {error.msg} (column {error.colno})"
            if not isinstance(value, dict):
                return f"{at(file, row, line)}: a JSONL row must be a JSON object, not {type(value).__name__}"
    if rows == 0:
        return f"{file} is empty (only blank lines)"
    return None


def diagnose_file(file: Path, format_name: str) -> str | None:
    """After Ray Data failed to read a corpus: this file's problem, if reading it alone shows one.

    CSV: a row whose number of fields differs from the header's is named by row and line; any
    other problem is pyarrow's own message for this file.
    """
    if format_name == "csv":
        width = None
        for row, (line, record) in enumerate(_csv_records(file), start=-1):
            if width is None:
                width = len(record)
            elif len(record) != width:
                return f"{at(file, row, line)}: {len(record)} fields, but the header has {width}"
    try:
        if format_name == "parquet":
            pq.read_table(file)
        elif format_name == "csv":
            import pyarrow.csv as pacsv

            pacsv.read_csv(file)
        else:
            import pandas as pd

            pd.read_json(file, lines=True)  # what Ray Data's JSONL reader uses
    except Exception as error:
        return f"{file}: {type(error).__name__}: {error}"
    return None


def row_counts(files: list[Path], format_name: str) -> list[int]:
    """Rows per file, counted as :func:`check_file` and Ray Data count them (to locate a row)."""
    counts = []
    for file in files:
        if format_name == "parquet":
            counts.append(pq.read_metadata(file).num_rows)
        elif format_name == "csv":
            counts.append(max(sum(1 for _ in _csv_records(file)) - 1, 0))
        else:
            with open(file, encoding="utf-8") as handle:
                counts.append(sum(1 for text in handle if text.strip()))
    return counts


def locate(files: list[Path], format_name: str, corpus_row: int) -> str | None:
    """``FILE row R (line L)`` of a corpus row (0-based, files in sorted order), or None."""
    try:
        counts = row_counts(files, format_name)
    except (OSError, ValueError):
        return None
    for file, count in zip(files, counts, strict=True):
        if corpus_row < count:
            return at(file, corpus_row, _line_of(file, format_name, corpus_row))
        corpus_row -= count
    return None


def _line_of(file: Path, format_name: str, row: int) -> int | None:
    if format_name == "csv":
        for index, (line, _) in enumerate(_csv_records(file), start=-1):
            if index == row:
                return line
    elif format_name == "jsonl":
        index = -1
        with open(file, encoding="utf-8") as handle:
            for line, text in enumerate(handle, start=1):
                if text.strip():
                    index += 1
                    if index == row:
                        return line
    return None
