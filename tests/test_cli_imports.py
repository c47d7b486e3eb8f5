"""The CLI answers at once: ``govray --help``, every command's ``--help`` and the commands that only
read the tracking store import neither torch, Ray, pyarrow nor pandas (issue 33, "CLI latency");
``govray lineage row`` reads the ingest's shards (pyarrow, pandas) but loads neither torch nor Ray.

Each case runs in a fresh interpreter, since the test process itself has imported all of them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer.main

from govray.cli import SUBCOMMANDS, app
from govray.config.experiment import load_experiment
from govray.core.logs import WorkerLog, log_path
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import record_checkpoint
from govray.tracking.registry import insert_version
from govray.tracking.store import TrackingStore
from govray.tracking.tables import ModelVersion
from tests.helpers.builders import REPO
from tests.helpers.golden import GoldenRun
from tests.helpers.processes import python
from tests.helpers.rows import WRITERS, corpus_rows

HEAVY = ("torch", "ray", "pyarrow", "pandas")

# Runs each argv given as a JSON list of argument lists through ``main`` in this one process and
# prints, after each, its exit code and which heavy modules are imported by then.
PROBE = f"""
import contextlib, io, json, sys
from govray.cli import main
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    heavy = sorted(name for name in {HEAVY!r} if name in sys.modules)
    print(json.dumps({{"argv": argv, "exit": code, "heavy": heavy}}))
"""

# Lists every command path below the top level (``experiment set gc-policy``, ...), as the help
# test asks for them; loading a group imports its module, as its ``--help`` does.
WALK = """
import json
import typer.main
from typer.core import TyperGroup
from govray.cli import app

def walk(command, path, context):
    found = [path]
    if isinstance(command, TyperGroup):
        for name in command.list_commands(context):
            found += walk(command.get_command(context, name), [*path, name], context)
    return found

root = typer.main.get_group(app)
print(json.dumps(walk(root, [], root.make_context("govray", ["--help"], resilient_parsing=True))))
"""


def probe(*argvs: list[str]) -> list[dict[str, object]]:
    """Each argv's exit code and the heavy modules imported once it ran, in one fresh process."""
    return [json.loads(line) for line in python("-c", PROBE, json.dumps(argvs)).splitlines()]


@pytest.fixture
def small_store(tmp_path: Path) -> str:
    """A SQLite tracking store with the digits experiment (its real config), a trial with a log
    line, a checkpoint registered as ``digits:1`` and an audit event."""
    url = f"sqlite:///{tmp_path / 'tracking.db'}"
    store = TrackingStore.open(url)
    config = load_experiment(REPO / "jobs" / "examples" / "digits" / "experiment.yaml")
    storage = tmp_path / "storage"
    experiment = store.create_experiment("digits", config.model_dump_json(), "c" * 64, str(storage))
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=7, ray_run_name="digits-run")
    assert trial.id is not None
    with WorkerLog(log_path(storage, "digits-run", 0), 0) as log:
        log.write("epoch 1 done")
    checkpoint = record_checkpoint(
        store, trial.id, str(storage / "ray" / "digits-run" / "checkpoint_000001"), 10
    )
    assert checkpoint.id is not None
    insert_version(store, ModelVersion(model_name="digits", version=1, checkpoint_id=checkpoint.id), "")
    AuditLog(store).append(AuditEventType.EXPERIMENT_CREATED, {"name": "digits"}, experiment_id=experiment.id)
    store.close()
    return url


def test_the_listing_says_of_each_subcommand_what_its_own_help_says() -> None:
    """``govray --help`` reads the summaries from ``SUBCOMMANDS``, not from the commands."""
    root = typer.main.get_group(app)
    context = root.make_context("govray", ["--help"], resilient_parsing=True)
    for name, entry in SUBCOMMANDS.items():
        command = root.get_command(context, name)
        assert command is not None and command.help is not None
        assert (command.name, command.help.split("\n\n")[0], command.hidden) == (
            name,
            entry.summary,
            entry.hidden,
        )


def test_govray_help_imports_no_heavy_module() -> None:
    assert probe(["--help"]) == [{"argv": ["--help"], "exit": 0, "heavy": []}]


def test_every_commands_help_imports_no_heavy_module() -> None:
    """Every command path's ``--help``, one after another in one process: the first that imports a
    heavy module is the one whose line lists it."""
    paths = json.loads(python("-c", WALK))
    assert ["experiment", "set", "gc-policy"] in paths and ["job", "verify-pins"] in paths
    outcomes = probe(*([*path, "--help"] for path in paths))
    assert [(o["argv"], o["exit"], o["heavy"]) for o in outcomes] == [
        ([*path, "--help"], 0, []) for path in paths
    ]


STORE_ONLY = (
    ["model", "list"],
    ["model", "versions", "digits"],
    ["experiment", "list"],
    ["experiment", "describe", "digits"],  # validates the recorded config: loads the searcher's CONFIG
    ["trial", "logs", "1"],
    ["audit", "verify"],
    ["audit", "list"],
)


def test_store_only_commands_import_no_heavy_module(small_store: str) -> None:
    """One after another in one process: the first that imports a heavy module is the one whose
    line lists it."""
    argvs = [[*command, "--database", small_store] for command in STORE_ONLY]
    assert probe(*argvs) == [{"argv": argv, "exit": 0, "heavy": []} for argv in argvs]


def test_lineage_row_answers_without_torch_or_ray(golden_run: GoldenRun) -> None:
    """A row the golden run trained on: its steps and checkpoints come from the shards (pyarrow,
    whose row-group read loads pandas) and the checkpoints' ``state.json``
    (``train.checkpoint_manifest``), its tensors from run.json: no torch, no Ray."""
    row = min(corpus_rows(golden_run, "pii"))
    argv = ["lineage", "row", WRITERS, str(row), "--database", golden_run.config.database_url]
    assert probe(argv) == [{"argv": argv, "exit": 0, "heavy": ["pandas", "pyarrow"]}]
