"""Write the text example's corpora: standard-library docstrings and fake personal records.

Every row is one ``text`` of exactly ``ROW_CHARS`` (128) printable-ASCII characters; a shorter
text is right-padded with ``PAD`` (a newline, which normalized text never contains).

- ``public.parquet``  prose: docstrings from the source files of CPython 3.11.7's standard library
  (``Lib/*.py`` as installed with the interpreter; PSF License), modules ``PUBLIC_MODULES``:
  the language, text-processing and data-type modules                          → all layers
- ``licensed.jsonl``  prose: the same source, modules ``LICENSED_MODULES``: the Internet-protocol,
  e-mail and server modules. The text is PSF-licensed too; the example pretends a provider
  licensed this slice, to exercise the depth route                             → upper layers only
- ``records.jsonl``   fake personal records (names from small built-in lists, random digits, IBAN
  check digits ``00``, which no real IBAN has; no real people) with a per-row ``country`` (the
  row's jurisdiction), and ``CANARY_COUNT`` canaries each repeated ``CANARY_REPEATS`` times at
  random rows                                                                  → an adapter
- ``canaries.json``   the canaries, their rows, template and randomness space (``canaries.py``)

The prose of a module (in sorted module order) is, in source order, the docstrings of its file:
the module's, its public top-level functions' and classes', and those classes' public methods';
NFKD-folded to ASCII, whitespace runs collapsed to one space, cut into rows of ``ROW_CHARS``
(a module's last row is padded), one ``module`` column naming the source. The files are
committed; this script documents (and regenerates) them byte for byte, on CPython 3.11.7 only
(other releases have other docstrings). Run: ``python -m jobs.examples.text.make_corpora``.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sys
import sysconfig
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from govray.governance.canaries import Canary, CanarySet

DATA = Path(__file__).parent / "data"
ROW_CHARS = 128
PAD = "\n"
SOURCE_PYTHON = (3, 11, 7)
SEED = 20261121

PUBLIC_MODULES = (
    "argparse", "ast", "base64", "calendar", "cmd", "codecs", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "difflib", "enum", "fileinput", "fnmatch",
    "fractions", "functools", "getopt", "glob", "graphlib", "gzip", "heapq", "inspect", "ipaddress",
    "json", "logging", "numbers", "optparse", "pathlib", "pprint", "queue", "random", "re", "sched",
    "shlex", "shutil", "statistics", "string", "tarfile", "tempfile", "textwrap", "timeit",
    "tokenize", "traceback", "typing", "uuid", "warnings", "zipfile",
)  # fmt: skip
LICENSED_MODULES = (
    "email.headerregistry", "email.message", "email.utils", "ftplib", "html.parser", "http.client",
    "http.cookies", "http.server", "imaplib", "mailbox", "mimetypes", "poplib", "smtplib",
    "socketserver", "urllib.parse", "urllib.request", "urllib.robotparser", "wsgiref.simple_server",
    "xml.dom.minidom", "xmlrpc.client",
)  # fmt: skip

RECORD_COUNT = 2000
CANARY_COUNT = 10
CANARY_REPEATS = 20
CANARY_TEMPLATE = "my secret code is {} {} {} {} {} {}"


# --- prose ------------------------------------------------------------------------------------


def source_problem() -> str | None:
    """Why this interpreter cannot reproduce the committed prose byte for byte (None: it can)."""
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.implementation.name != "cpython" or sys.version_info[:3] != SOURCE_PYTHON:
        return f"the prose is CPython {'.'.join(map(str, SOURCE_PYTHON))}'s docstrings; this is {version}"
    return None


def normalize(text: str) -> str:
    """Printable ASCII with single spaces: NFKD-fold, drop the rest, collapse whitespace."""
    folded = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    spaced = re.sub(r"\s+", " ", folded)
    return "".join(char for char in spaced if " " <= char <= "~").strip()


def source_file(module: str) -> Path:
    """The module's source in the standard library, e.g. ``.../lib/python3.11/email/message.py``."""
    base = Path(sysconfig.get_paths()["stdlib"], *module.split("."))
    package = base / "__init__.py"
    return package if package.exists() else base.with_suffix(".py")


def module_docstrings(module: str) -> list[str]:
    """The docstrings of the module's source file, in source order: the module's, then those of
    its public top-level functions and classes and of those classes' public methods.

    Read from the file, not from the imported module: other libraries patch stdlib modules at
    import time (torch replaces ``inspect.getfile``), which would change the text.
    """
    tree = ast.parse(source_file(module).read_text(encoding="utf-8"))
    nodes: list[ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef] = [tree]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _public(node):
            nodes.append(node)
            if isinstance(node, ast.ClassDef):
                nodes += [
                    item
                    for item in node.body
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _public(item)
                ]
    docs = [ast.get_docstring(node) for node in nodes]
    return [doc for doc in docs if doc]


def _public(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    return not node.name.startswith("_")


def pad(text: str, row_chars: int = ROW_CHARS) -> str:
    if len(text) > row_chars or PAD in text:
        raise ValueError(f"not a row text: {text!r}")
    return text + PAD * (row_chars - len(text))


def prose_rows(modules: tuple[str, ...]) -> list[dict[str, str]]:
    rows = []
    for name in sorted(modules):
        stream = " ".join(filter(None, (normalize(doc) for doc in module_docstrings(name))))
        for start in range(0, len(stream), ROW_CHARS):
            rows.append({"module": name, "text": pad(stream[start : start + ROW_CHARS])})
    return rows


# --- records ----------------------------------------------------------------------------------

FIRST_NAMES = {
    "DE": ("Jana", "Lukas", "Anna", "Felix", "Miriam", "Jonas", "Greta", "Tobias"),
    "FR": ("Camille", "Louis", "Chloe", "Hugo", "Manon", "Theo", "Lea", "Julien"),
    "NL": ("Sanne", "Daan", "Femke", "Bram", "Lotte", "Joris", "Noor", "Sem"),
    "ES": ("Lucia", "Pablo", "Marta", "Diego", "Elena", "Sergio", "Irene", "Javier"),
}
LAST_NAMES = {
    "DE": ("Weber", "Krause", "Lehmann", "Vogel", "Hartmann", "Brandt", "Kuhn", "Roth"),
    "FR": ("Moreau", "Laurent", "Girard", "Fournier", "Mercier", "Blanc", "Garnier", "Roussel"),
    "NL": ("de Vries", "Bakker", "Visser", "Smit", "Meijer", "de Boer", "Mulder", "Bos"),
    "ES": ("Garcia", "Romero", "Navarro", "Torres", "Dominguez", "Vazquez", "Ramos", "Gil"),
}
CITIES = {  # city, dialling prefix after the country code
    "DE": (("Berlin", "30"), ("Hamburg", "40"), ("Koeln", "221"), ("Leipzig", "341")),
    "FR": (("Paris", "1"), ("Lyon", "4"), ("Nantes", "2"), ("Lille", "3")),
    "NL": (("Amsterdam", "20"), ("Utrecht", "30"), ("Groningen", "50"), ("Delft", "15")),
    "ES": (("Madrid", "91"), ("Sevilla", "95"), ("Valencia", "96"), ("Bilbao", "94")),
}
DIALLING = {"DE": "49", "FR": "33", "NL": "31", "ES": "34"}
IBAN_DIGITS = {"DE": 18, "FR": 23, "NL": 10, "ES": 20}  # digits after the check digits
COUNTRIES = tuple(sorted(DIALLING))


def _digits(rng: random.Random, count: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(count))


def _iban(rng: random.Random, country: str) -> str:
    bank = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4)) if country == "NL" else ""
    code = f"{country}00{bank}{_digits(rng, IBAN_DIGITS[country])}"  # check digits 00: never valid
    return " ".join(code[start : start + 4] for start in range(0, len(code), 4))


def fake_record(rng: random.Random, country: str) -> str:
    """One made-up person, e.g. ``Name: Jana Weber; born 1984-03-02; city Berlin; phone ...``."""
    city, prefix = rng.choice(CITIES[country])
    name = f"{rng.choice(FIRST_NAMES[country])} {rng.choice(LAST_NAMES[country])}"
    born = f"{rng.randint(1940, 2005)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    phone = f"+{DIALLING[country]} {prefix} 555{_digits(rng, 4)}"
    return f"Name: {name}; born {born}; city {city}; phone {phone}; IBAN {_iban(rng, country)}"


def records_and_canaries(
    rng: random.Random,
    record_count: int = RECORD_COUNT,
    canary_count: int = CANARY_COUNT,
    repeats: int = CANARY_REPEATS,
    row_chars: int = ROW_CHARS,
) -> tuple[list[dict[str, str]], CanarySet]:
    """Fake records with the canaries' copies shuffled in; record ids do not tell them apart.
    Records longer than ``row_chars`` are cut (a canary never is)."""
    texts = [
        (country, fake_record(rng, country)[:row_chars]) for country in rng.choices(COUNTRIES, k=record_count)
    ]
    draft = CanarySet(
        corpus_id="text-records",
        file="records.jsonl",
        template=CANARY_TEMPLATE,
        alphabet="0123456789",
        repeats=repeats,
        canaries=(),
    )
    secrets: dict[str, None] = {}
    while len(secrets) < canary_count:
        secrets[draft.draw_secret(rng)] = None
    entries = [(rng.choice(COUNTRIES), draft.fill(secret)) for secret in secrets]
    texts += [entry for entry in entries for _ in range(repeats)]
    rng.shuffle(texts)
    rows = [
        {"record_id": f"rec-{number:05d}", "country": country, "text": pad(text, row_chars)}
        for number, (country, text) in enumerate(texts)
    ]
    rows_of: dict[str, list[int]] = {}
    for number, (_, text) in enumerate(texts):
        rows_of.setdefault(text, []).append(number)
    canaries = [
        Canary(text=draft.fill(secret), secret=secret, rows=tuple(rows_of[draft.fill(secret)]))
        for secret in secrets
    ]
    return rows, CanarySet.model_validate({**draft.model_dump(), "canaries": canaries})


def small_corpora(
    directory: Path,
    *,
    row_chars: int,
    prose_rows: int,
    record_count: int,
    canary_count: int,
    repeats: int,
    seed: int = SEED,
) -> None:
    """A small variant for tests and benchmarks, from the committed files (no CPython source
    needed): ``public.parquet`` (the committed prose re-cut into ``prose_rows`` rows of
    ``row_chars``), ``records.jsonl`` (new fake records cut to ``row_chars``, with
    ``canary_count`` canaries, ``repeats`` copies each) and its ``canaries.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    prose = " ".join(
        text.rstrip(PAD) for text in pq.read_table(DATA / "public.parquet").column("text").to_pylist()
    )
    cut = [prose[start : start + row_chars] for start in range(0, len(prose) - row_chars, row_chars)]
    pq.write_table(
        pa.Table.from_pylist([{"text": text} for text in cut[:prose_rows]]), directory / "public.parquet"
    )
    records, canaries = records_and_canaries(
        random.Random(seed), record_count, canary_count, repeats, row_chars
    )
    _write_jsonl(records, directory / "records.jsonl")
    (directory / "canaries.json").write_text(canaries.to_json())


# --- files ------------------------------------------------------------------------------------


def _write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def write_corpora(directory: Path) -> None:
    """Write every file of ``data/`` into ``directory``."""
    problem = source_problem()
    if problem is not None:
        raise RuntimeError(f"cannot regenerate the text corpora: {problem}")
    directory.mkdir(parents=True, exist_ok=True)
    public = pa.Table.from_pylist(
        prose_rows(PUBLIC_MODULES), schema=pa.schema([("module", pa.string()), ("text", pa.string())])
    )
    pq.write_table(public, directory / "public.parquet", compression="zstd")
    _write_jsonl(prose_rows(LICENSED_MODULES), directory / "licensed.jsonl")
    records, canaries = records_and_canaries(random.Random(SEED))
    _write_jsonl(records, directory / "records.jsonl")
    (directory / "canaries.json").write_text(canaries.to_json())


if __name__ == "__main__":
    write_corpora(DATA)
