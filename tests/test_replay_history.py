"""A replay follows the world sizes its trial trained on (issue 34, item 5): a run resized during
its life is replayed segment by segment on the same world sizes from the same steps, so the replay,
and removal = replay, stay bit-identical."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from govray.cli import main
from govray.platform.rerun.replay import Replay, carried_decisions, replay_trial
from govray.platform.rerun.world_history import (
    WorldHistoryError,
    WorldSegment,
    describe_segments,
    replay_segments,
    segments_left,
    split_at,
)
from govray.platform.run.runner import run_trial
from govray.tracking.store import TrackingStore
from govray.tracking.tables import TrialRecord
from govray.train.checkpoints.files import SIGNATURE_FILE, STATE_FILE, CheckpointState, find_checkpoints
from govray.train.checkpoints.manifest import TrainedUnder, continued_history, continued_lineage
from govray.train.control.decisions import GateDecision, LrDecision, PlateauState
from jobs.benchmarks.elastic_replay import paused
from jobs.examples.digits.golden import GOLDEN_STEPS
from tests.helpers.golden import GoldenRun
from tests.helpers.processes import kill_driver_when

WEIGHT_FILES = ("model.safetensors", "adapter-pii-lora.safetensors", "optimizer.safetensors")


def test_a_history_of_one_world_is_one_run_and_no_history_runs_on_the_configured_workers() -> None:
    assert replay_segments([(0, 2)], 30) == (WorldSegment(0, 30, 2),)
    said = "replay segments (the replayed trial's world sizes): 2 workers for steps 1-30"
    assert describe_segments((WorldSegment(0, 30, 2),)) == said


def test_a_resized_history_is_split_at_each_step_a_world_began() -> None:
    assert replay_segments([(0, 3), (10, 2), (25, 3)], 40) == (
        WorldSegment(0, 10, 3),
        WorldSegment(10, 25, 2),
        WorldSegment(25, 40, 3),
    )


def test_a_world_that_trained_no_step_gives_way_to_the_one_after_it() -> None:
    """A run resumed on another world size from the checkpoint it began the world with (its step-0
    one: a sharded run's starting state) trained every step of that stretch on the new world: the
    history a resume continues, and one recorded before it was folded so, replay on the new world
    only (the replay planning the original's slots per step: ``test_world_resize``)."""
    assert continued_history([(0, 4)], 0, 2) == [(0, 2)]
    assert continued_history([(0, 4), (10, 2)], 10, 1) == [(0, 4), (10, 1)]
    assert continued_history([(0, 4), (10, 2)], 10, 4) == [(0, 4)]  # back where it was: one world
    assert continued_history([(0, 4), (10, 2)], 20, 2) == [(0, 4), (10, 2)]  # the same world goes on
    assert continued_history([], 0, 3) == [(0, 3)]
    assert replay_segments([(0, 4), (0, 2)], 30) == (WorldSegment(0, 30, 2),)
    assert replay_segments([(0, 3), (10, 2), (10, 1), (20, 3)], 30) == (
        WorldSegment(0, 10, 3),
        WorldSegment(10, 20, 1),
        WorldSegment(20, 30, 3),
    )


def test_a_resumed_replay_trains_the_segment_its_checkpoint_falls_in_and_those_after() -> None:
    segments = (WorldSegment(0, 10, 3), WorldSegment(10, 25, 2), WorldSegment(25, 40, 3))
    assert segments_left(segments, 0) == segments
    assert segments_left(segments, 15) == (WorldSegment(15, 25, 2), WorldSegment(25, 40, 3))
    assert segments_left(segments, 25) == (WorldSegment(25, 40, 3),)  # paused at a segment's end
    assert segments_left(segments, 40) == ()


def test_a_clones_lineage_is_its_donors_then_its_own_and_a_resume_continues_its_own_entry() -> None:
    """A PBT clone restoring its donor's state at step 5 under other hyperparameters adds its own
    entry; a resume of its own state (same run, same hyperparameters) adds none; an entry that
    began at the step restored from trained nothing of it and gives way."""
    donor = TrainedUnder(from_step=0, run="t-a", hparams={"lr": 0.1})
    clone = TrainedUnder(from_step=0, run="t-b", hparams={"lr": 0.01})
    cloned = continued_lineage([donor], 5, clone)
    assert cloned == [donor, clone.model_copy(update={"from_step": 5})]
    assert continued_lineage(cloned, 8, clone) == cloned  # its own state resumed
    assert continued_lineage(cloned, 5, TrainedUnder(from_step=0, run="t-c", hparams={"lr": 1.0})) == [
        donor,
        TrainedUnder(from_step=5, run="t-c", hparams={"lr": 1.0}),
    ]  # t-b's entry, begun at step 5, trained nothing of a state restored at step 5
    assert continued_lineage([donor], 5, donor) == [donor]  # the donor goes on itself


def test_a_lineage_cuts_the_world_segments_where_its_hyperparameters_change() -> None:
    segments = (WorldSegment(0, 10, 2), WorldSegment(10, 30, 1))
    assert split_at(segments, []) == segments
    assert split_at(segments, [10]) == segments  # already a boundary
    assert split_at(segments, [5, 20, 30, 40]) == (
        WorldSegment(0, 5, 2),
        WorldSegment(5, 10, 2),
        WorldSegment(10, 20, 1),
        WorldSegment(20, 30, 1),
    )


def test_a_clones_replay_applies_the_decisions_its_state_carries_then_the_schedulers_stop(
    store: TrackingStore, tmp_path: Path
) -> None:
    """The decisions a clone's replay applies are its state's — its donor's LR cut at step 5 and
    gate at 5, its own cut at 10 (numbered by two controllers) — in step order, then the ASHA stop
    the driver recorded for the trial, numbered anew; the clone's row (its pre-exploit cut) is not read."""
    cut = LrDecision(seq=0, step=5, metric="validation_loss", observed=0.9, previous_scale=1.0, scale=0.5)
    later = cut.model_copy(update={"seq": 2, "step": 10, "previous_scale": 0.5, "scale": 0.25})
    gate = GateDecision(seq=1, step=5, corpus_id="digits-writers", score=3.0)
    state = CheckpointState(
        step=10,
        epoch=0,
        seed=7,
        trial_seed=0,
        schedule={},
        schedule_digest="s",
        policy_digest="p",
        config_digest="c",
        ledger={},
        world_history=[(0, 1)],
        hparams_history=[TrainedUnder(from_step=0, run="clone", hparams={})],
        plateau=PlateauState(scale=0.25, decisions=(cut, later)).model_dump(mode="json"),
        gates=[gate.model_dump(mode="json")],
    )
    (tmp_path / STATE_FILE).write_text(state.model_dump_json())
    experiment = store.create_experiment("clone", "{}", "d", str(tmp_path))
    assert experiment.id is not None
    trial = store.create_trial(experiment.id, "{}", seed=0)
    assert trial.id is not None
    own_cut = {**cut.model_dump(mode="json"), "observed": 0.2}  # of the state the exploit replaced
    stop = {
        "seq": 1,
        "step": 10,
        "kind": "early_stop",
        "reason": "scheduler",
        "metric": "m",
        "observed": None,
    }
    store.record_decisions(trial.id, [own_cut, stop], replayed=False)
    carried = carried_decisions(tmp_path, trial.id, store)
    assert [(d.seq, d.step, d.kind) for d in carried] == [
        (0, 5, "lr_scale"),
        (1, 5, "gate"),
        (2, 10, "lr_scale"),
        (3, 10, "early_stop"),
    ]
    assert carried[0] == cut and carried[2] == later.model_copy(update={"seq": 2})


@pytest.mark.parametrize(
    "history",
    [
        [(0, 2), (20, 1), (10, 2)],  # out of order
        [(5, 2)],  # not from the start
        [(0, 2), (30, 1)],  # a world beginning after the last step
    ],
)
def test_a_history_no_segments_reproduce_is_refused(history: list[tuple[int, int]]) -> None:
    with pytest.raises(WorldHistoryError, match=r"does not split steps 1-30 into segments"):
        replay_segments(history, 30)


# --- a resized run, replayed (slow tier: a killed driver, a resume, two replays of two segments) --


@dataclass(frozen=True)
class ResizedRun:
    """The golden configuration paused as it starts (at its first control boundary, step 5) and
    resumed with `govray resume --workers 1` to step 30."""

    trial: TrialRecord
    final: Path  # its final checkpoint
    resumed_at: int  # the step it paused at and resumed from on 1 worker


def final_checkpoint(run_dir: Path) -> Path:
    found = find_checkpoints(run_dir)
    assert found and json.loads((found[-1] / STATE_FILE).read_text())["step"] == GOLDEN_STEPS
    return found[-1]


def cli(*args: str) -> str:
    """``govray ARGS`` in this process (exit 0 required); what it printed, whitespace collapsed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(list(args))
    out = " ".join(printed.getvalue().split())
    assert code == 0, out
    return out


@pytest.fixture(scope="module")
def resized_run(golden_run: GoldenRun) -> ResizedRun:
    config, store = golden_run.config, golden_run.store
    experiment = store.get_experiment(store.get_trial(golden_run.outcome.trial_id).experiment_id)
    paused(
        store,
        experiment.id,
        lambda: run_trial(config, golden_run.checked, experiment, golden_run.shard_root, store),
    )
    cli("resume", str(experiment.id), "--database", config.database_url, "--workers", "1")
    trial = store.list_trials(experiment.id)[-1]
    assert trial.state == "completed"
    final = final_checkpoint(Path(golden_run.config.storage_path) / "ray" / str(trial.ray_run_name))
    (first, world), (resumed_at, workers) = json.loads((final / STATE_FILE).read_text())["world_history"]
    assert (first, world, workers) == (0, 2, 1)
    assert 0 < resumed_at < GOLDEN_STEPS
    return ResizedRun(trial, final, resumed_at)


@pytest.mark.slow
def test_a_replay_of_a_resized_run_follows_its_world_sizes_bit_for_bit(
    golden_run: GoldenRun, resized_run: ResizedRun
) -> None:
    """Replayed with nothing excluded: 2 workers to the pause, then 1 worker, and the final
    weights, optimizer state, ledger and world history are the resized run's, byte for byte. (With
    two slots a step, a sum of two, the order cannot show: the replay's world history says it
    followed the run's; ``jobs/benchmarks/elastic_replay.py`` shows the bytes on 3 -> 2 -> 3.)"""
    replay: Replay = replay_trial(golden_run.store, golden_run.config.name, (), trial_id=resized_run.trial.id)
    assert replay.outcome.state == "completed"
    resumed_at = resized_run.resumed_at
    assert replay.segments == (WorldSegment(0, resumed_at, 2), WorldSegment(resumed_at, GOLDEN_STEPS, 1))
    replayed = final_checkpoint(replay.outcome.run_dir)
    for name in WEIGHT_FILES:
        assert (replayed / name).read_bytes() == (resized_run.final / name).read_bytes(), name
    states = [json.loads((folder / STATE_FILE).read_text()) for folder in (resized_run.final, replayed)]
    assert states[1]["ledger"] == states[0]["ledger"]
    assert states[1]["world_history"] == states[0]["world_history"]
    assert {row.kind for row in replay.report.tensors} == {"none"}
    # Two segments, one record: each report once (the pause's too), nothing trained twice into it.
    steps = [m.step for m in golden_run.store.metrics(replay.outcome.trial_id, "training_loss")]
    assert steps == sorted({resumed_at, 10, 20, 30})


@pytest.mark.slow
def test_removing_the_adapter_of_a_resized_run_is_its_replay_without_the_pii_corpus(
    golden_run: GoldenRun, resized_run: ResizedRun
) -> None:
    """`govray replay --exclude-corpus digits-writers` of the resized run says its segments; the
    PII corpus trains only its adapter, so the replay's base is the resized run's byte for byte
    (removal = replay) while its adapter differs."""
    resumed_at = resized_run.resumed_at
    experiment_id = resized_run.trial.experiment_id
    out = cli(
        "replay",
        str(experiment_id),
        "--database",
        golden_run.config.database_url,
        "--exclude-corpus",
        "digits-writers",
        "--trial",
        str(resized_run.trial.id),
    )
    said = f"2 workers for steps 1-{resumed_at}, 1 worker for steps {resumed_at + 1}-{GOLDEN_STEPS}"
    assert f"replay segments (the replayed trial's world sizes): {said}" in out, out
    report = json.loads(Path(out.split("influence report: ")[1].split()[0]).read_text())
    replay_trial_row = golden_run.store.get_trial(report["replay_trial"])
    replayed = final_checkpoint(
        Path(golden_run.config.storage_path) / "ray" / str(replay_trial_row.ray_run_name)
    )
    base = "model.safetensors"
    assert (replayed / base).read_bytes() == (resized_run.final / base).read_bytes()
    adapter = "adapter-pii-lora.safetensors"
    assert (replayed / adapter).read_bytes() != (resized_run.final / adapter).read_bytes()
    assert json.loads((replayed / STATE_FILE).read_text())["world_history"] == [[0, 2], [resumed_at, 1]]


@pytest.mark.slow
def test_an_interrupted_replay_of_a_resized_run_resumes_on_its_world_sizes(
    golden_run: GoldenRun, resized_run: ResizedRun
) -> None:
    """A replay (`jobs/replay.py`, its own driver) SIGKILLed once its first segment (2 workers) has
    sealed its end is refused a resume on 3 workers, losing nothing, and `govray resume` finishes
    it on 1 worker: its world history is the resized run's (a resume on the configured 2 workers
    would have added a third world) and, the PII corpus excluded, its base is the resized run's
    byte for byte (removal = replay)."""
    store, url = golden_run.store, golden_run.config.database_url
    experiment_id = resized_run.trial.experiment_id
    resumed_at = resized_run.resumed_at
    known = {trial.id for trial in store.list_trials(experiment_id)}
    runs = Path(golden_run.config.storage_path) / "ray"
    end = f"checkpoint_{resumed_at:08d}/{SIGNATURE_FILE}"
    sealed_before = set(runs.glob(f"*/{end}"))

    def first_segment_sealed() -> bool:  # the moment rank 0 signs it
        return bool(set(runs.glob(f"*/{end}")) - sealed_before)

    arguments = [str(experiment_id), "--database", url, "--trial", str(resized_run.trial.id)]
    arguments += ["--exclude-corpus", "digits-writers"]  # the PII corpus: it trains only its adapter
    kill_driver_when("replay.py", arguments, first_segment_sealed)
    (replay,) = [t for t in store.list_trials(experiment_id) if t.id not in known]
    assert replay.replay_of == resized_run.trial.id and replay.state in ("active", "paused")

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = main(["resume", str(experiment_id), "--database", url, "--workers", "3"])
    out = " ".join(printed.getvalue().split())
    assert code == WorldHistoryError.exit_code, out
    assert f"trial {replay.id} replays trial {resized_run.trial.id}, which was resized" in out, out
    assert store.get_trial(replay.id).state == replay.state  # refused: nothing ran, nothing lost

    cli("resume", str(experiment_id), "--database", url)
    assert store.get_trial(replay.id).state == "completed"
    replayed = final_checkpoint(Path(golden_run.config.storage_path) / "ray" / str(replay.ray_run_name))
    states = [json.loads((folder / STATE_FILE).read_text()) for folder in (resized_run.final, replayed)]
    assert states[1]["world_history"] == states[0]["world_history"] == [[0, 2], [resumed_at, 1]]
    base, adapter = "model.safetensors", "adapter-pii-lora.safetensors"
    assert (replayed / base).read_bytes() == (resized_run.final / base).read_bytes()  # removal = replay
    assert (replayed / adapter).read_bytes() != (resized_run.final / adapter).read_bytes()
