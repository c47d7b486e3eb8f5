"""Early stopping is a recorded decision: the trial stops at the evaluation that decided it, with
its ledger and a checkpoint there, and a replay stops at the same step whatever its metrics."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from govray.config.experiment import load_experiment
from govray.data.schedule import ScheduleSpec, derive_seed
from govray.data.shards import ShardSet
from govray.platform.rerun.replay import replay_trial
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.run.runner import run_trial
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import STATE_FILE, checkpoint_step, find_checkpoints
from govray.train.step.ledger import recompute_ledger
from jobs.examples.digits.golden import GOLDEN_HPARAMS
from jobs.examples.digits.golden import golden_example as golden_example_at


def test_patience_stops_at_the_deciding_evaluation_and_the_replay_stops_there_too(
    ray_session: None, tmp_path: Path
) -> None:
    path = golden_example_at(tmp_path, workers=1, max_length={"batches": 60}, lr_schedule=False)
    raw = yaml.safe_load(path.read_text())
    raw["min_validation_period"] = 10
    # Demanding an improvement of 10 in validation loss: the second evaluation (step 20) stops it.
    raw["early_stopping"] = {"metric": "validation_loss", "patience": 1, "min_delta": 10.0}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    config = load_experiment(path)
    store = TrackingStore.open(config.database_url)
    checked = check_policy(config, store, allow_unsigned=False)
    experiment, ingested = ingest_experiment(config, checked, store)
    outcome = run_trial(config, checked, experiment, ingested.root, store, report_every=10)

    assert (outcome.state, outcome.steps_done, outcome.max_steps) == ("completed", 20, 60)
    (decision,) = store.decisions(outcome.trial_id)
    assert (decision.step, decision.kind, json.loads(decision.payload_json)["reason"]) == (
        20,
        "early_stop",
        "patience",
    )
    final = find_checkpoints(outcome.run_dir)[-1]
    assert checkpoint_step(final) == 20
    schedule = ScheduleSpec.from_manifest(
        ShardSet.open(ingested.root).manifest,
        seed=derive_seed(config.seed, 0, "schedule"),
        world_size=1,
        batch_size=GOLDEN_HPARAMS["batch_size"],
    )
    assert outcome.ledger == recompute_ledger(schedule, checked.routing, 20)  # exactly 20 steps
    assert json.loads((final / STATE_FILE).read_text())["early_stopping"]["decision"]["step"] == 20

    replayed = replay_trial(store, config.name, ("digits-licensed",), trial_id=outcome.trial_id)
    assert replayed.outcome.steps_done == 20 and replayed.report.step == 20
    (applied,) = store.decisions(replayed.outcome.trial_id)
    assert applied.replayed and (applied.step, applied.kind) == (20, "early_stop")
    assert json.loads(applied.payload_json)["observed"] is None  # applied from the record
