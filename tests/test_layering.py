"""The tree tells the architecture: govray/ is layered one way, imports nothing above it (the
package root included; an import by name through importlib or ``__import__`` counts), has no import
cycle (function-local imports count), and only its tracking and query layers speak SQL
(ARCHITECTURE.md, "Layers")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOVRAY = REPO / "govray"

# The layers, bottom to top: the one list. A package may import its own layer and those below it,
# never above. govray/__init__.py's docstring and README's layout section repeat this order (checked
# below).
LAYERS: list[set[str]] = [
    {"core"},
    {"governance"},
    {"config"},
    {"data"},
    {"train"},
    {"tracking"},
    {"provenance"},
    {"signer"},
    {"platform"},
    {"queries"},
    {"cli", "__main__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
ORDER = " → ".join(sorted(names - {"__main__"}).pop() for names in LAYERS)


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


IMPORTERS = {"import_module", "__import__", "import_attr"}  # importlib's, the builtin, Ray Serve's


def dynamic_imports(path: Path) -> list[str]:
    """The modules ``path`` imports by name at run time (``importlib.import_module``, ``__import__``,
    Ray's ``import_attr``) given as a string or a module-level string constant."""
    tree = ast.parse(path.read_text())
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        function = node.func
        called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
        argument = node.args[0]
        if called not in IMPORTERS:
            continue
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            found.append(argument.value.partition(":")[0])
        elif isinstance(argument, ast.Name) and argument.id in constants:
            found.append(constants[argument.id].partition(":")[0])
    return found


def calls_session(path: Path) -> bool:
    """Whether the module opens a database session (``store.session()``, ``reader.session()``)."""
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "session"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_every_module_lives_in_a_layer_package() -> None:
    units = {path.relative_to(GOVRAY).parts[0].removesuffix(".py") for path in GOVRAY.rglob("*.py")}
    units.discard("__init__")
    assert units - set(RANK) == set(), "place new govray modules in a package of LAYERS"
    loose = sorted(
        path.name for path in GOVRAY.glob("*.py") if path.name not in {"__init__.py", "__main__.py"}
    )
    assert loose == [], "govray/ holds only its layer packages"


def test_the_package_docstring_and_the_readme_give_the_layers_in_this_order() -> None:
    import govray

    assert govray.__doc__ is not None and ORDER in govray.__doc__
    layout = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    assert ORDER in layout
    for names in LAYERS:
        for name in names - {"__main__"}:
            assert f"{name}/" in layout, f"README's layout does not describe govray/{name}/"


def test_lower_layers_never_import_higher_ones() -> None:
    violations = []
    for path in GOVRAY.rglob("*.py"):
        unit = path.relative_to(GOVRAY).parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        for module in imported_modules(path) + dynamic_imports(path):
            if module.split(".")[0] in {"jobs", "searchers", "serve"}:
                violations.append(f"{path.name} imports {module} (govray imports none of them)")
            if module == "govray":  # the package root re-exports every layer: it sits above them all
                violations.append(f"{path.relative_to(GOVRAY)} ({unit}) imports the package root govray")
            target = top_unit(module)
            if target is not None and target in RANK and RANK[target] > RANK[unit]:
                violations.append(f"{path.relative_to(GOVRAY)} ({unit}) imports {module} ({target})")
    assert violations == []


def test_an_import_by_name_of_what_sits_above_govray_is_seen(tmp_path: Path) -> None:
    module = tmp_path / "cli.py"
    module.write_text(
        "import importlib\nAPP = 'serve.app'\n"
        "def run():\n    importlib.import_module(APP)\n    __import__('jobs.train')\n"
        "    import_attr('searchers.grid:plan')\n    importlib.import_module(name_from_a_config)\n"
    )
    assert dynamic_imports(module) == ["serve.app", "jobs.train", "searchers.grid"]


def module_name(path: Path) -> str:
    """'govray/data/schedule.py' → 'govray.data.schedule'; a package's __init__.py → the package."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The govray modules ``path`` imports when it runs, at the top or inside a function (a
    function-local import is still an edge); imports only for type checkers are left out."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for statement in node.body
        for inner in ast.walk(statement)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from govray.data import schedule`` imports the module govray.data.schedule
            found.update(
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            )
    return found & modules


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                cycles.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


CYCLE_FREE = ("govray", "searchers", "serve", "jobs")  # every package of the product's code


def test_no_import_cycle_even_through_function_local_imports() -> None:
    paths = {
        module_name(path): path
        for top in CYCLE_FREE
        for path in (REPO / top).rglob("*.py")
        if "migrations" not in path.parts
    }
    assert {name.split(".")[0] for name in paths} == set(CYCLE_FREE)
    graph = {module: runtime_imports(path, set(paths)) - {module} for module, path in paths.items()}
    assert import_cycles(graph) == [], "a module that needs another's code lives below it, not beside it"


def test_the_cycle_finder_finds_a_cycle_through_a_function_local_import(tmp_path: Path) -> None:
    (tmp_path / "govray" / "train").mkdir(parents=True)
    hf, trial = tmp_path / "govray" / "train" / "hf.py", tmp_path / "govray" / "train" / "trial.py"
    hf.write_text("from govray.train.trial import Trial\n")
    trial.write_text("def layers():\n    from govray.train.hf import decoder_layers\n")
    modules = {"govray.train.hf", "govray.train.trial"}
    graph = {
        name: runtime_imports(path, modules) for name, path in zip(sorted(modules), (hf, trial), strict=True)
    }
    assert import_cycles(graph) == [["govray.train.hf", "govray.train.trial"]]
    trial.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from govray.train.hf import x\n"
    )
    graph["govray.train.trial"] = runtime_imports(trial, modules)
    assert import_cycles(graph) == []


def test_the_version_is_pyprojects() -> None:
    import tomllib

    from govray.core.version import GOVRAY_VERSION

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == GOVRAY_VERSION


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


def defined_names(path: Path) -> set[str]:
    """Public classes, functions and constants a module defines at its top level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_") and len(name) > 1 and name != "logger"}


def test_one_meaning_per_name() -> None:
    """No public name is defined by two modules (the CLI's command modules aside: each defines its
    typer ``app`` and commands named after what they do); a re-export is not a definition."""
    owners: dict[str, list[str]] = {}
    for path in sorted(GOVRAY.rglob("*.py")):
        relative = path.relative_to(GOVRAY)
        if relative.parts[0] == "cli" or "migrations" in relative.parts:
            continue
        for name in defined_names(path):
            owners.setdefault(name, []).append(relative.as_posix())
    assert {name: paths for name, paths in owners.items() if len(paths) > 1} == {}


SHARED_FILE_NAMES = {"__init__.py", "errors.py"}  # a package's own; each layer's own refusals


def test_one_meaning_per_module_name() -> None:
    """No two modules outside the CLI share a file name (a newcomer who hears "record.py" or
    "trial.py" finds one file): the CLI's modules are named after their commands, and every layer
    may have its ``errors.py``."""
    owners: dict[str, list[str]] = {}
    for path in sorted(GOVRAY.rglob("*.py")):
        relative = path.relative_to(GOVRAY)
        if relative.parts[0] == "cli" or "migrations" in relative.parts or path.name in SHARED_FILE_NAMES:
            continue
        owners.setdefault(path.name, []).append(relative.as_posix())
    assert {name: paths for name, paths in owners.items() if len(paths) > 1} == {}


def test_the_public_api_resolves_lazily_to_the_layer_objects() -> None:
    import importlib
    import subprocess
    import sys

    import govray

    for name, module in govray.PUBLIC_API.items():
        assert getattr(govray, name) is getattr(importlib.import_module(module), name)
    assert govray.__all__ == sorted(govray.PUBLIC_API)
    try:
        govray.GovernedTraining  # noqa: B018  (a name the public API does not have)
    except AttributeError as error:
        assert "GovernedTraining" in str(error)
    else:
        raise AssertionError("an unknown name resolved")
    cheap = "import sys, govray; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    imported = subprocess.run([sys.executable, "-c", cheap], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"


def test_code_and_tests_cite_only_documents_in_the_repository() -> None:
    """A document (``*.md``) that code, tests or examples name is a file of this repository."""
    cited = re.compile(r"\b([A-Za-z][\w/-]*\.md)\b")  # (a path in the repository: docs/reference.md)
    missing = []
    for root in ("govray", "searchers", "serve", "jobs", "tests", "policies"):
        for path in sorted((REPO / root).rglob("*")):
            if path.suffix not in {".py", ".md", ".yaml", ".html"} or not path.is_file():
                continue
            for name in set(cited.findall(path.read_text(errors="replace"))):
                if not (REPO / name).is_file() and not (path.parent / name).is_file():
                    missing.append(f"{path.relative_to(REPO)} cites {name}")
    assert missing == []


# The tests' own layering: a test module imports no other test module (nor a conftest); what several
# share lives in tests/helpers/, their shared fixtures in tests/conftest.py (found without an import).
TEST_TREE_IMPORTERS = ("tests", "jobs")  # jobs/ borrows from tests/helpers/ too (benchmarks)


def outside_helpers(module: str) -> bool:
    """Whether ``module`` is of the test tree but not of tests/helpers/: a test module
    (``tests.test_x``, ``tests.cluster.test_x``), a conftest (``tests.conftest``, or ``conftest``
    as pytest puts it on the path), the cluster package. ``tests`` itself is only the namespace."""
    parts = module.split(".")
    if parts[0] == "conftest":
        return True
    return parts[0] == "tests" and len(parts) > 1 and parts[1] != "helpers"


def imported_test_modules(path: Path, root: Path = REPO) -> list[str]:
    """The modules of the test tree outside tests/helpers/ that ``path`` imports: at the top or
    inside a function, relatively, or by name through importlib (``from tests import test_fsdp``
    imports the module tests.test_fsdp)."""
    package = list(path.relative_to(root).parent.parts)
    found = dynamic_imports(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append(module)
            if not outside_helpers(module):
                found.extend(f"{module}.{alias.name}" for alias in node.names)
    return [module for module in found if outside_helpers(module)]


def test_no_test_module_imports_another_only_tests_helpers() -> None:
    """No file under tests/ (test modules, conftest, helpers) or jobs/ imports a test module or a
    conftest; and no helper module is named like a test module (pytest would collect it)."""
    violations = [
        f"{path.relative_to(REPO)} imports {module}"
        for top in TEST_TREE_IMPORTERS
        for path in sorted((REPO / top).rglob("*.py"))
        for module in imported_test_modules(path)
    ]
    assert violations == [], "move what they share to tests/helpers/ (shared fixtures: tests/conftest.py)"
    named_as_tests = sorted(path.name for path in (REPO / "tests" / "helpers").rglob("test_*.py"))
    assert named_as_tests == [], "a helper module is no test module: name it for what it holds"


def test_an_import_of_a_test_module_is_seen_wherever_it_is(tmp_path: Path) -> None:
    (tmp_path / "tests" / "cluster").mkdir(parents=True)
    module = tmp_path / "tests" / "cluster" / "test_x.py"
    module.write_text(
        "import importlib\nfrom tests.helpers.golden import GoldenRun\nfrom tests import helpers, test_fsdp\n"
        "def f():\n    import tests.cluster.test_job_submit\n    from conftest import GoldenRun\n"
        "    from .test_elastic import rank_main\n    from tests.conftest import golden_run\n"
        "    importlib.import_module('tests.test_engine')\n    from tests.helpers import golden\n"
    )
    assert sorted(imported_test_modules(module, root=tmp_path)) == [
        "conftest",
        "tests.cluster.test_elastic",
        "tests.cluster.test_job_submit",
        "tests.conftest",
        "tests.test_engine",
        "tests.test_fsdp",
    ]


MODULE_LINE_LIMIT = 450  # the house limit; ~400 is the aim (ARCHITECTURE.md, "Layers")


def test_no_module_is_longer_than_the_house_limit() -> None:
    """A module over the limit is split along meaning (migrations are generated and exempt)."""
    sources = [
        path
        for top in ("govray", "serve", "searchers", "jobs")
        for path in (REPO / top).rglob("*.py")
        if "migrations" not in path.parts
    ]
    assert len(sources) > 100
    too_long = {
        str(path.relative_to(REPO)): lines
        for path in sources
        if (lines := len(path.read_text().splitlines())) > MODULE_LINE_LIMIT
    }
    assert too_long == {}


FUNCTION_LINE_LIMIT = 80  # a function does one thing; over this it is split along meaning
LONGER_FUNCTIONS = {
    # (module, qualified name): why it may be longer, until when
    ("govray/train/step/governed.py", "GovernedStep.__init__"): "builds the step's parts in order; "
    "splits when the parallelism twin builds the base and the worker context holds the data",
}


def function_lengths(path: Path) -> dict[str, int]:
    """Every function's and method's length in lines (decorators and docstring included), by its
    qualified name."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    lengths[name] = child.end_lineno - first + 1
                visit(child, f"{name}.")

    visit(ast.parse(path.read_text()), "")
    return lengths


def test_no_function_is_longer_than_the_house_limit_but_the_named_ones() -> None:
    too_long = {
        (str(path.relative_to(REPO)), name): lines
        for top in ("govray", "serve", "searchers", "jobs")
        for path in sorted((REPO / top).rglob("*.py"))
        if "migrations" not in path.parts
        for name, lines in function_lengths(path).items()
        if lines > FUNCTION_LINE_LIMIT
    }
    assert set(too_long) - set(LONGER_FUNCTIONS) == set(), too_long
    assert set(LONGER_FUNCTIONS) - set(too_long) == set(), "an exception no longer needed: remove it"


def test_the_function_measure_counts_nested_functions_and_methods(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "class A:\n    @property\n    def b(self):\n        def c():\n            pass\n        return 1\n"
        "def d():\n    pass\n"
    )
    assert function_lengths(module) == {"A.b": 5, "A.b.c": 2, "d": 2}  # the decorator counts


def test_every_module_the_docs_name_exists() -> None:
    """README.md and ARCHITECTURE.md name modules by path; a move that forgets them fails here
    (an upper-case part is a placeholder: ``govray/cli/COMMAND.py``)."""
    cited = {
        (document, path)
        for document in ("README.md", "ARCHITECTURE.md")
        for path in re.findall(
            r"`((?:govray|tests|jobs|serve|searchers)/[\w/.]+\.py)", (REPO / document).read_text()
        )
        if not any(part.isupper() for part in Path(path).with_suffix("").parts)
    }
    assert len(cited) > 50
    assert sorted((document, path) for document, path in cited if not (REPO / path).is_file()) == []


def test_run_json_has_one_reader() -> None:
    """``read_run_spec`` (govray/train/runspec.py) is the only code that parses a run spec file."""
    readers = [
        f"{path.relative_to(REPO)}:{number}"
        for top in ("govray", "serve", "searchers", "jobs")
        for path in sorted((REPO / top).rglob("*.py"))
        if path != GOVRAY / "train" / "runspec.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "RunSpec.model_validate_json" in line
    ]
    assert readers == []


STRATEGY_FLAGS = {"collective_forward", "every_rank_writes"}  # the twin's own facts
STRATEGY_HOMES = (GOVRAY / "train" / "parallel", GOVRAY / "config")  # the twin; where a strategy is parsed


def strategy_tests(path: Path) -> list[str]:
    """Where ``path`` asks which strategy runs instead of asking the twin: a read of one of the
    twin's flags, or a comparison with a ``ParallelStrategy`` member."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in STRATEGY_FLAGS:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                for inner in ast.walk(operand):
                    if isinstance(inner, ast.Attribute) and ast.unparse(inner.value) == "ParallelStrategy":
                        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_strategy_is_tested_outside_the_parallelism_twin() -> None:
    """Single, DDP, FSDP and HSDP differ only inside ``govray/train/parallel/`` (the twin and its
    checkpoint layouts); everything else asks the twin (``govray/config/`` parses the strategy)."""
    tested = [
        f"{path.relative_to(REPO)}:{found}"
        for top in ("govray", "serve", "searchers", "jobs")
        for path in sorted((REPO / top).rglob("*.py"))
        if not any(path.is_relative_to(home) for home in STRATEGY_HOMES)
        for found in strategy_tests(path)
    ]
    assert tested == []


def test_the_strategy_rule_sees_a_flag_and_a_comparison(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f(parallel, strategy):\n"
        "    if parallel.layout.every_rank_writes:\n        pass\n"
        "    return strategy in (ParallelStrategy.FSDP, ParallelStrategy.HSDP)\n"
    )
    assert [line.split(":")[0] for line in strategy_tests(module)] == ["2", "4", "4"]
