"""The tree tells the architecture: govray/ is layered one way, and imports nothing above it."""

from __future__ import annotations

import ast
from pathlib import Path

GOVRAY = Path(__file__).resolve().parents[1] / "govray"

# Bottom to top. A module may import its own layer and those below it, never above.
LAYERS: list[set[str]] = [
    {"errors", "canonical", "documents", "runtime", "logs", "memorization", "canaries", "storage"},
    {"identifiers"},
    {"credentials"},
    {"keys"},
    {"dsse"},
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
