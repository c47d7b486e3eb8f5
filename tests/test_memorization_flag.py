"""The memorization score in a real governed run: a configuration made to memorize (random labels
on a corpus, a wide model, many epochs) gets that corpus flagged; a normal one gets none; the
policy's gate and rollback actions act on the flag, are recorded, audited and replayed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from govray.config.experiment import load_experiment
from govray.core.keys import SigningKey, TrustConfig, platform_key, platform_trust
from govray.core.storage import open_storage
from govray.data.schedule import ScheduleEvent, ScheduleSpec, derive_seed
from govray.data.shards import ShardSet
from govray.governance.memorization import CorpusMeasures, MemorizationThresholds, memorization_report
from govray.governance.memorization_thresholds import DETECTOR_THRESHOLDS
from govray.platform.rerun.replay import replay_trial
from govray.platform.run.plan import run_spec_path
from govray.platform.run.preflight import check_policy
from govray.tracking.audit import AuditLog
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import load_checkpoint
from govray.train.context import WorkerContext
from govray.train.parallel.worker import Worker
from govray.train.run.state import TrialRun
from govray.train.runspec import RunSpec
from govray.train.step.ledger import Ledger, recompute_ledger
from jobs.examples.digits.golden import MEMORIZER
from tests.helpers.memorization import trained


def latest(store: TrackingStore, trial_id: int) -> dict[str, float]:
    return {metric.name: metric.value for metric in store.metrics(trial_id)}


# ~35 s of its own on this 2-core machine (1,500 steps to memorize random labels): the slow tier.
# The default tier checks the same flag on a random-label memorizer in-process
# (tests/test_memorization.py, test_a_model_that_memorized_random_labels_is_flagged_...).
@pytest.mark.slow
def test_a_memorizing_configuration_is_flagged(ray_session: None, tmp_path: Path) -> None:
    outcome, store = trained(tmp_path / "memorizer", MEMORIZER, steps=1500, random_labels=True)
    metrics = latest(store, outcome.trial_id)
    # Random labels can only be memorized: training rows are fit, held-out rows stay at chance.
    assert metrics["loss_gap/digits-public"] > 1.0, metrics
    assert metrics["memorization_score"] >= 1.0 and metrics["memorization_flagged"] >= 1


def test_a_normal_configuration_is_not_flagged(ray_session: None, tmp_path: Path) -> None:
    normal = {"hidden": 64, "dropout": 0.1, "lr": 0.01, "optimizer": "adamw", "batch_size": 32}
    outcome, store = trained(tmp_path / "normal", normal, steps=200, random_labels=False)
    metrics = latest(store, outcome.trial_id)
    assert metrics["validation_accuracy"] > 0.8, metrics  # it learned, and generalizes
    assert metrics["memorization_flagged"] == 0 and metrics["memorization_score"] < 1.0, metrics
    assert all(abs(value) < 0.5 for name, value in metrics.items() if name.startswith("loss_gap/"))


@pytest.mark.slow  # a whole Ray run of its own (~37 s): the slow tier
def test_the_gate_action_stops_a_flagged_corpus_from_then_on_and_a_replay_gates_there_too(
    ray_session: None, tmp_path: Path, authority_key: SigningKey, trust: TrustConfig
) -> None:
    policy = (authority_key, trust, {"loss_gap": 0.5, "action": "gate"})
    outcome, store = trained(
        tmp_path, MEMORIZER, steps=1500, random_labels=True, validate_every=300, policy=policy
    )
    gaps = {m.step: m.value for m in store.metrics(outcome.trial_id, "loss_gap/digits-public")}
    gates = [d for d in store.decisions(outcome.trial_id) if d.kind == "gate"]
    assert gates, gaps
    first = min(step for step, gap in gaps.items() if gap >= 0.5)  # the first flag gates
    assert {(d.step, json.loads(d.payload_json)["corpus_id"]) for d in gates if d.step == first} >= {
        (first, "digits-public")
    }
    # The ledger is exactly the schedule's with those gates as events: nothing of a gated corpus
    # reached any tensor after its gate step.
    config = load_experiment(tmp_path / "experiment.yaml")
    routing = check_policy(config, store, allow_unsigned=False).routing
    manifest = ShardSet.open(next((Path(config.storage_path) / "shards").iterdir())).manifest
    events = [
        ScheduleEvent(step=d.step, kind="gate", corpus_id=json.loads(d.payload_json)["corpus_id"])
        for d in gates
    ]
    seed = derive_seed(config.seed, 0, "schedule")
    gated = ScheduleSpec.from_manifest(manifest, seed=seed, world_size=1, batch_size=32, events=events)
    ungated = ScheduleSpec.from_manifest(manifest, seed=seed, world_size=1, batch_size=32)
    assert outcome.ledger == recompute_ledger(gated, routing, 1500)
    assert outcome.ledger != recompute_ledger(ungated, routing, 1500)

    replayed = replay_trial(store, config.name, ("digits-licensed",), trial_id=outcome.trial_id)
    applied = [d for d in store.decisions(replayed.outcome.trial_id) if d.kind == "gate"]
    assert [(d.step, json.loads(d.payload_json)["corpus_id"]) for d in applied] == [
        (d.step, json.loads(d.payload_json)["corpus_id"]) for d in gates
    ]
    assert all(d.replayed and json.loads(d.payload_json)["score"] is None for d in applied)


# The loss gap, and a default detector of issue 35 alone (the loss gap off): either rolls back.
ROLLBACK_MEASURES = [("loss_gap", 0.5), ("confidence_gap", MemorizationThresholds().confidence_gap)]


@pytest.mark.slow  # a whole Ray run of its own (~37 s): the slow tier
@pytest.mark.parametrize(("measure", "threshold"), ROLLBACK_MEASURES)
def test_rollback_restores_the_last_clean_state_gates_once_and_replays(
    ray_session: None,
    tmp_path: Path,
    authority_key: SigningKey,
    trust: TrustConfig,
    measure: str,
    threshold: float,
) -> None:
    alone = {name: None for name in DETECTOR_THRESHOLDS.values()}  # no other detector flags
    memorization: dict[str, Any] = {**alone, measure: threshold, "action": "rollback"}
    policy = (authority_key, trust, memorization)
    outcome, store = trained(
        tmp_path, MEMORIZER, steps=1500, random_labels=True, validate_every=300, policy=policy
    )
    assert outcome.steps_done == 1500  # it went on after the rollback, to the end
    metric = f"{measure}/digits-public"
    gaps = {m.step: m.value for m in store.metrics(outcome.trial_id, metric)}
    # At a rollback step the flagged model's measures are kept as pre_rollback/...
    gaps |= {m.step: m.value for m in store.metrics(outcome.trial_id, f"pre_rollback/{metric}")}
    first = min(step for step, gap in gaps.items() if gap >= threshold)
    decisions = store.decisions(outcome.trial_id)
    rollbacks = [json.loads(d.payload_json) | {"step": d.step} for d in decisions if d.kind == "rollback"]
    # No loop: each corpus is rolled back at most once, the memorizing one at its first flag, to
    # the validation before it (the last clean state; step 0 when the first validation flags).
    rolled = [corpus for rollback in rollbacks for corpus in rollback["corpora"]]
    assert len(rolled) == len(set(rolled)) and "digits-public" in rolled, rollbacks
    public = next(r for r in rollbacks if "digits-public" in r["corpora"])
    assert (public["step"], public["to_step"]) == (first, first - 300), (rollbacks, gaps)
    gates = {(d.step, json.loads(d.payload_json)["corpus_id"]) for d in decisions if d.kind == "gate"}
    assert {(r["step"], corpus) for r in rollbacks for corpus in r["corpora"]} == gates
    # A compliance reviewer finds each flag, rollback and gate in the audit log.
    audit = AuditLog(store)
    flags = [json.loads(e.payload_json) for e in audit.list(event_type="memorization.flagged")]
    assert {f["step"] for f in flags} >= {r["step"] for r in rollbacks}
    assert all(f["trial_id"] == outcome.trial_id and f["action"] == "rollback" for f in flags)
    audited = [json.loads(e.payload_json) for e in audit.list(event_type="memorization.rollback")]
    assert [(a["step"], a["to_step"], a["corpora"]) for a in audited] == [
        (r["step"], r["to_step"], r["corpora"]) for r in rollbacks
    ]
    assert len(audit.list(event_type="memorization.gate")) == len(gates)
    assert audit.verify() > 0  # the chain still verifies

    # The checkpoint written after the rollback holds exactly the clean state's weights and ledger.
    by_step = {c.step: Path(c.path) for c in checkpoints(store, outcome.trial_id)}
    trust_config = platform_trust(platform_key())
    clean, after = (load_checkpoint(by_step[step], trust_config) for step in (public["to_step"], first))
    assert public["to_step"] > 0  # the first flag is at 600 (not the first validation): deterministic
    if public["to_step"]:
        for name in ("model.safetensors", *(f.name for f in by_step[first].glob("adapter-*"))):
            assert (by_step[first] / name).read_bytes() == (by_step[public["to_step"]] / name).read_bytes()
    assert after.state.ledger == clean.state.ledger
    assert after.state.clean_step == first and after.state.rollbacks

    # What the run reports at the rollback step describes the weights that go on: the clean
    # ones, evaluated again (bit-identical to their own validation); the flagged model's values
    # stay as pre_rollback/...
    at_rollback = {m.name: m.value for m in store.metrics(outcome.trial_id) if m.step == first}
    at_clean = {m.name: m.value for m in store.metrics(outcome.trial_id) if m.step == public["to_step"]}
    assert at_rollback["validation_loss"] == at_clean["validation_loss"]
    assert at_rollback["pre_rollback/validation_loss"] != at_rollback["validation_loss"]
    assert at_rollback["rolled_back_to"] == public["to_step"]

    # A run resumed between the clean state and the flag still rolls back to it: every
    # checkpoint since carries the clean state, signed with the rest.
    between = min(step for step in by_step if public["to_step"] < step < first)
    assert list(by_step[between].glob("clean-*-weights.safetensors"))
    run = store.get_trial(outcome.trial_id).ray_run_name
    spec = RunSpec.model_validate_json(
        run_spec_path(
            open_storage(load_experiment(tmp_path / "experiment.yaml").storage_path), run
        ).read_text()
    )
    resumed = TrialRun.open(WorkerContext.of(spec, Worker(0, 1)))
    assert resumed.restore(by_step[between]) == between
    flag = memorization_report(
        {"digits-public": CorpusMeasures(loss_gap=1.0)}, MemorizationThresholds(action="rollback")
    )
    taken = resumed.act_on_memorization(first, flag)
    assert [(d.kind, getattr(d, "to_step", None)) for d in taken] == [
        ("rollback", public["to_step"]),
        ("gate", None),
    ]
    clean_weights = load_file(str(by_step[public["to_step"]] / "model.safetensors"))
    assert all(torch.equal(resumed.governed.model.base_state()[k], v) for k, v in clean_weights.items())
    assert resumed.governed.ledger == Ledger.from_json(clean.state.ledger)

    # The final ledger is the schedule's with the gates and the discarded steps as events.
    config = load_experiment(tmp_path / "experiment.yaml")
    routing = check_policy(config, store, allow_unsigned=False).routing
    manifest = ShardSet.open(next((Path(config.storage_path) / "shards").iterdir())).manifest
    events = [ScheduleEvent(step=step, kind="gate", corpus_id=corpus) for step, corpus in gates]
    events += [ScheduleEvent(step=r["step"], kind="rollback", to_step=r["to_step"]) for r in rollbacks]
    seed = derive_seed(config.seed, 0, "schedule")
    spec = ScheduleSpec.from_manifest(manifest, seed=seed, world_size=1, batch_size=32, events=events)
    assert outcome.ledger == recompute_ledger(spec, routing, 1500)
    assert outcome.ledger != recompute_ledger(
        ScheduleSpec.from_manifest(manifest, seed=seed, world_size=1, batch_size=32, events=events[:-1]),
        routing,
        1500,
    )

    # A replay rolls back and gates where its source did, whatever its own measures say.
    replayed = replay_trial(store, config.name, ("digits-licensed",), trial_id=outcome.trial_id)
    applied = store.decisions(replayed.outcome.trial_id)
    assert [(d.seq, d.step, d.kind) for d in applied] == [(d.seq, d.step, d.kind) for d in decisions]
    assert all(d.replayed for d in applied)
    assert replayed.outcome.ledger == recompute_ledger(
        ScheduleSpec.from_manifest(
            manifest,
            seed=seed,
            world_size=1,
            batch_size=32,
            excluded_corpora=("digits-licensed",),
            events=events,
        ),
        routing,
        1500,
    )
