"""The experiment lifecycle: pause checkpoints at a step boundary and activate continues to the
uninterrupted run's exact weights; kill stops for good; a fork records its parent and starts from
a verified checkpoint, keeping that checkpoint's ledger on the record."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file

from govray.cli import main
from govray.config.experiment import ExperimentConfig
from govray.core.logs import log_dir, read_logs
from govray.core.storage import open_storage
from govray.data.schedule import ScheduleSpec, derive_seed
from govray.data.shards import ShardSet
from govray.platform.lifecycle import LifecycleError, parent_checkpoint, request_kill, request_pause
from govray.platform.run.plan import run_spec_path
from govray.platform.run.runner import TrialOutcome, run_trial
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import MODEL_FILE, STATE_FILE, checkpoint_step, find_checkpoints
from govray.train.context import WorkerContext
from govray.train.parallel.worker import Worker
from govray.train.run.state import TrialRun
from govray.train.runspec import RunSpec
from govray.train.step.ledger import Ledger, recompute_ledger
from jobs.examples.digits.golden import GOLDEN_HPARAMS, GOLDEN_REPORT_EVERY, GOLDEN_STEPS, opened
from jobs.examples.digits.golden import golden_example as golden_example_at
from tests.helpers.golden import GoldenRun, assert_run_as_planned

WEIGHT_FILES = ("model.safetensors", "adapter-pii-lora.safetensors", "optimizer.safetensors")


def slow_example(root: Path, workers: int) -> Path:
    path = golden_example_at(root, workers=workers, max_length={"batches": GOLDEN_STEPS})
    raw = yaml.safe_load(path.read_text())
    raw["trial"] = "tests.helpers.slow_trial:SlowDigitsTrial"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_and_request(
    path: Path, command: str, reference: bool = False
) -> tuple[TrialOutcome, TrackingStore, int, TrialOutcome | None]:
    """Train the example; once the first report (step 10) is in, `govray experiment COMMAND` it.
    With ``reference``, first train it uninterrupted in the same experiment, at full speed."""
    config, store, checked, experiment, ingested = opened(path)
    assert experiment.id is not None
    uninterrupted = None
    if reference:
        hparams = {**config.default_hparams(), "step_seconds": 0.0}  # the same arithmetic, no sleep
        uninterrupted = run_trial(
            config,
            checked,
            experiment,
            ingested.root,
            store,
            hparams=hparams,
            report_every=GOLDEN_REPORT_EVERY,
        )
    asked: list[int] = []

    def progress(step: int, max_steps: int, latest: dict[str, float], workers: int | None) -> None:
        if not asked:
            asked.append(step)
            code = main(["experiment", command, str(experiment.id), "--database", config.database_url])
            assert code == 0

    outcome = run_trial(
        config, checked, experiment, ingested.root, store, report_every=GOLDEN_REPORT_EVERY, progress=progress
    )
    assert asked == [GOLDEN_REPORT_EVERY]
    return outcome, store, experiment.id, uninterrupted


Paused = tuple[TrialOutcome, TrackingStore, int, TrialOutcome | None]


@pytest.fixture(scope="module")
def paused_in_process(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Paused:
    """One worker in the driver's process (Train V2 local mode): an uninterrupted reference run, then
    the same run paused at its first report."""
    return run_and_request(
        slow_example(tmp_path_factory.mktemp("paused"), workers=1), "pause", reference=True
    )


@pytest.fixture(scope="module")
def paused(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Paused:
    """Two Ray Train workers, paused at the first report (the golden run is the reference)."""
    return run_and_request(slow_example(tmp_path_factory.mktemp("paused2"), workers=2), "pause")


def test_pause_checkpoints_at_a_step_boundary_and_activate_finishes_bit_identically(
    paused_in_process: Paused,
) -> None:
    """In-process, where Ray Train adds nothing to the pause: rank 0 reads the request at a step
    boundary; the 2-worker run (its ranks agreeing on the stop) is the slow tier's test below."""
    outcome, store, experiment_id, reference = paused_in_process
    assert reference is not None
    pause_and_activate(outcome, store, experiment_id, reference.run_dir, ranks=1)


@pytest.mark.slow  # two runs on 2 Ray Train workers of their own: the in-process test above stays
def test_pause_of_two_ray_train_workers_and_activate_finish_as_the_golden_run(
    paused: Paused, golden_run: GoldenRun
) -> None:
    outcome, store, experiment_id, _ = paused
    pause_and_activate(outcome, store, experiment_id, golden_run.outcome.run_dir, ranks=2)


def pause_and_activate(
    outcome: TrialOutcome, store: TrackingStore, experiment_id: int, uninterrupted: Path, ranks: int
) -> None:
    """The paused run checkpointed at a step boundary; `govray experiment activate` finishes it with
    the ``uninterrupted`` run's exact weights, ledger and decisions."""
    assert outcome.state == "paused" and GOLDEN_REPORT_EVERY <= outcome.steps_done < GOLDEN_STEPS
    assert store.get_trial(outcome.trial_id).state == "paused"
    assert store.get_experiment(experiment_id).state == "paused"
    assert store.get_experiment(experiment_id).requested is None  # the request was carried out
    saved = find_checkpoints(outcome.run_dir)
    assert checkpoint_step(saved[-1]) == outcome.steps_done  # the pause checkpoint

    assert main(["experiment", "activate", str(experiment_id), "--database", store.url]) == 0
    assert store.get_trial(outcome.trial_id).state == "completed"
    assert store.get_experiment(experiment_id).state == "completed"
    final = find_checkpoints(outcome.run_dir)[-1]
    golden = find_checkpoints(uninterrupted)[-1]
    assert checkpoint_step(final) == checkpoint_step(golden) == GOLDEN_STEPS
    for name in WEIGHT_FILES:
        assert (final / name).read_bytes() == (golden / name).read_bytes(), name
    state, golden_state = (json.loads((d / STATE_FILE).read_text()) for d in (final, golden))
    assert state["ledger"] == golden_state["ledger"]
    assert state["plateau"]["decisions"] == golden_state["plateau"]["decisions"]
    # The resume imported the run's recorded code, its first attempt the working directory's (and
    # the two-worker attempts reported to sinks of their own): the run's spec is one document.
    config = load_experiment_config(store, experiment_id)
    assert_run_as_planned(config.storage_path, outcome.run_name, outcome.run_dir)

    lines = read_logs(log_dir(config.storage_path, outcome.run_name))
    assert any(
        f"pause requested: stopped after step {outcome.steps_done} with a checkpoint" in line
        for line in lines
    )
    assert any(f"resumed from a verified checkpoint at step {outcome.steps_done}" in line for line in lines)
    assert sum("completed 30 steps" in line for line in lines) == ranks
    requested = [e for e in AuditLog(store).list() if e.event_type == AuditEventType.EXPERIMENT_REQUESTED]
    assert [json.loads(e.payload_json)["request"] for e in requested] == ["pause"]


def load_experiment_config(store: TrackingStore, experiment_id: int) -> ExperimentConfig:
    return ExperimentConfig.model_validate_json(store.get_experiment(experiment_id).config_json)


def test_kill_stops_a_local_run_for_good(ray_session: None, tmp_path: Path) -> None:
    outcome, store, experiment_id, _ = run_and_request(slow_example(tmp_path, workers=1), "kill")
    assert outcome.state == "killed" and GOLDEN_REPORT_EVERY <= outcome.steps_done < GOLDEN_STEPS
    assert outcome.ledger is None
    assert store.get_trial(outcome.trial_id).state == "killed"
    assert store.get_experiment(experiment_id).state == "killed"
    # No checkpoint after the kill: the last one is from a period or validation boundary.
    assert all(checkpoint_step(c) % GOLDEN_REPORT_EVERY == 0 for c in find_checkpoints(outcome.run_dir))
    url = store.url
    assert main(["experiment", "activate", str(experiment_id), "--database", url]) == 14
    assert main(["experiment", "kill", str(experiment_id), "--database", url]) == 14
    assert main(["resume", str(experiment_id), "--database", url]) != 0  # nothing left to resume


def test_requests_follow_the_state_machine(tmp_path: Path) -> None:
    store = TrackingStore.open(f"sqlite:///{tmp_path / 'lifecycle.db'}")
    experiment = store.create_experiment("machine", "{}", "d", str(tmp_path))
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=0)
    assert trial.id is not None
    with pytest.raises(LifecycleError, match="is created: only an active one can be paused"):
        request_pause(store, experiment.id)
    store.set_experiment_state(experiment.id, "active")
    store.set_trial_state(trial.id, "active")
    assert request_pause(store, experiment.id).requested == "pause"
    assert request_kill(store, experiment.id).requested == "kill"  # the running driver acts on it
    assert store.get_experiment(experiment.id).state == "active"
    # A paused experiment has no driver: killing it is immediate, trial and all.
    store.set_experiment_state(experiment.id, "paused")
    store.set_trial_state(trial.id, "paused")
    killed = request_kill(store, experiment.id)
    assert (killed.state, killed.requested, store.get_trial(trial.id).state) == ("killed", None, "killed")
    with pytest.raises(LifecycleError, match="is killed: nothing to pause"):
        request_pause(store, experiment.id)


def test_fork_from_the_latest_checkpoint_records_parent_source_and_inherited_ledger(
    golden_run: GoldenRun, golden_example: Path
) -> None:
    store = golden_run.store
    parent = store.get_experiment(golden_run.config.name)
    raw = yaml.safe_load(golden_example.read_text())
    raw["name"] = "digits-forked"  # the golden experiment's name keeps finding the golden experiment
    raw["resources"] = {"workers": 1, "cpus_per_worker": 1}
    raw["searcher"]["max_length"] = {"batches": 5}
    del raw["lr_schedule"], raw["min_validation_period"]
    edited = golden_example.parent / "forked.yaml"
    edited.write_text(yaml.safe_dump(raw, sort_keys=False))
    code = main(
        [
            "experiment",
            "fork",
            str(parent.id),
            "--config",
            str(edited),
            "--from-checkpoint",
            "latest",
            "--database",
            store.url,
        ]
    )
    assert code == 0
    child = store.list_experiments()[-1]
    assert child.parent_id == parent.id and child.state == "completed"
    (trial,) = store.list_trials(child.id)
    source = json.loads(trial.source_checkpoint_json or "{}")
    # "latest": the parent's newest kept checkpoint (other tests may have added trials to it).
    golden_final = parent_checkpoint(store, parent.id)  # type: ignore[arg-type]
    parent_runs = {t.ray_run_name for t in store.list_trials(parent.id)}
    assert golden_final.parent.name in parent_runs and checkpoint_step(golden_final) == GOLDEN_STEPS
    assert Path(source["path"]) == golden_final and source["step"] == GOLDEN_STEPS
    forked_events = [e for e in AuditLog(store).list() if e.event_type == AuditEventType.EXPERIMENT_FORKED]
    assert json.loads(forked_events[-1].payload_json)["parent"] == parent.id

    # The fork's ledger: the source checkpoint's, plus exactly what its own 5 steps routed.
    final = find_checkpoints(Path(golden_run.config.storage_path) / "ray" / trial.ray_run_name)[-1]
    state = json.loads((final / STATE_FILE).read_text())
    assert state["source"]["manifest_sha256"] == source["manifest_sha256"]
    schedule = ScheduleSpec.from_manifest(
        ShardSet.open(golden_run.shard_root).manifest,
        seed=derive_seed(golden_run.config.seed, 0, "schedule"),
        world_size=1,
        batch_size=GOLDEN_HPARAMS["batch_size"],
    )
    own = recompute_ledger(schedule, golden_run.checked.routing, 5)
    golden_ledger = json.loads((golden_final / STATE_FILE).read_text())["ledger"]
    assert Ledger.from_json(state["ledger"]) == Ledger.from_json(golden_ledger).merge(own)

    # Step 0 of the fork is the source's weights exactly.
    spec = RunSpec.model_validate_json(
        run_spec_path(open_storage(golden_run.config.storage_path), trial.ray_run_name).read_text()
    )
    training = TrialRun.open(WorkerContext.of(spec, Worker(0, 1)))
    training.start_from(golden_final)
    expected = load_file(str(golden_final / MODEL_FILE))
    assert all(training.governed.model.base_state()[name].equal(tensor) for name, tensor in expected.items())


def test_a_tampered_source_checkpoint_is_refused_before_anything_is_recorded(
    golden_run: GoldenRun, golden_example: Path, tmp_path: Path
) -> None:
    tampered = tmp_path / "tampered"
    shutil.copytree(find_checkpoints(golden_run.outcome.run_dir)[-1], tampered)
    weights = bytearray((tampered / MODEL_FILE).read_bytes())
    weights[-1] ^= 1
    (tampered / MODEL_FILE).write_bytes(bytes(weights))
    trials_before = len(store_trials(golden_run))
    code = main(["run", str(golden_example), "--from-checkpoint", str(tampered)])
    assert code == 10  # CheckpointError
    assert len(store_trials(golden_run)) == trials_before


def store_trials(run: GoldenRun) -> list[Any]:
    return [t for e in run.store.list_experiments() for t in run.store.list_trials(e.id)]
