"""The tree tells the architecture: govray/ is layered one way, imports nothing above it, and only
its tracking and query layers speak SQL."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOVRAY = REPO / "govray"

# Bottom to top. A module may import its own layer and those below it, never above.
LAYERS: list[set[str]] = [
    {"errors", "canonical", "documents", "runtime", "logs", "memorization", "canaries", "storage"},
    {"identifiers"},
    {"credentials"},
    {"keys"},
    {"dsse"},
    {"training"},
    {"config"},
    {"policy"},
    {"data"},
    {"schedule"},
    {"routing"},
    {"adapters"},
    {"allreduce"},
    {"ledger", "decisions"},
    {"checkpoint"},
    {"harness", "reproducibility"},
    {"tracking"},
    {"gc", "reconcile"},
    {"preflight"},
    {"attest"},
    {"rows", "eu_summary"},
    {"registry", "recompute"},
    {"runner"},
    {"replay", "lifecycle", "search", "queries", "submission"},
    {"describe"},
    {"cli", "__main__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def top_unit(module: str) -> str | None:
    """'govray.data.ingest' → 'data'; non-govray modules → None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "govray" and len(parts) > 1 else None


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def calls_session(path: Path) -> bool:
    """Whether the module opens a database session (``store.session()``, ``reader.session()``)."""
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "session"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_every_module_has_a_layer() -> None:
    units = {path.relative_to(GOVRAY).parts[0].removesuffix(".py") for path in GOVRAY.rglob("*.py")}
    units.discard("__init__")
    assert units - set(RANK) == set(), "place new govray modules in LAYERS"


def test_lower_layers_never_import_higher_ones() -> None:
    violations = []
    for path in GOVRAY.rglob("*.py"):
        unit = path.relative_to(GOVRAY).parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        for module in imported_modules(path):
            if module.split(".")[0] in {"jobs", "searchers", "serve"}:
                violations.append(f"{path.name} imports {module} (govray imports none of them)")
            target = top_unit(module)
            if target is not None and target in RANK and RANK[target] > RANK[unit]:
                violations.append(f"{path.relative_to(GOVRAY)} ({unit}) imports {module} ({target})")
    assert violations == []


# SQL lives in the tracking layer (the schema, migrations and the writers' verbs) and the query
# layer (the readers' verbs); every other module asks them by name.
SQL_LAYERS = (GOVRAY / "tracking", GOVRAY / "queries")
DATABASE_MODULES = {"sqlalchemy", "sqlmodel", "alembic", "sqlite3", "psycopg", "psycopg2"}
SPEAKS_SQL_ANYWAY = {
    # a benchmark fixture: bulk-inserts millions of synthetic rows with SQLAlchemy Core, which no
    # platform verb does
    "jobs/benchmarks/lineage_store.py",
}


def test_only_the_tracking_and_query_layers_speak_sql() -> None:
    violations = []
    for root in ("govray", "serve", "searchers", "jobs"):
        for path in sorted((REPO / root).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if any(path.is_relative_to(layer) for layer in SQL_LAYERS) or name in SPEAKS_SQL_ANYWAY:
                continue
            violations += [
                f"{name} imports {module}"
                for module in imported_modules(path)
                if module.split(".")[0] in DATABASE_MODULES
            ]
            if calls_session(path):
                violations.append(f"{name} opens a database session")
    assert violations == [], "ask govray.tracking or govray.queries instead"
