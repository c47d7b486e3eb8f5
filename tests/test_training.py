"""Governed training on real Ray Train workers: the applied update is the masked per-example mean,
a corpus routed to an adapter never touches the base, the ledger is exact and recomputable, and
everything lands in the tracking store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from govray.core.keys import platform_key, platform_trust
from govray.data.schedule import ScheduleSpec, derive_seed
from govray.data.shard_reader import ShardReader
from govray.data.shards import ShardSet
from govray.data.slots import step_slots
from govray.governance.adapters import GovernedModel
from govray.governance.allreduce import parameters_by_name
from govray.governance.routing import resolve_routes
from govray.provenance.locations import run_spec_of
from govray.tracking.lineage import ledger_rows
from govray.train.checkpoints.files import checkpoint_step, find_checkpoints, verify_checkpoint
from govray.train.parallel.worker import RouteRows
from govray.train.step.governed import allowed_route_sets
from govray.train.step.ledger import recompute_ledger
from govray.train.trial import load_trial_class
from jobs.examples.digits.golden import GOLDEN_HPARAMS, GOLDEN_REPORT_EVERY, GOLDEN_STEPS
from tests.helpers.golden import GoldenRun

REPORT_STEPS = list(range(GOLDEN_REPORT_EVERY, GOLDEN_STEPS + 1, GOLDEN_REPORT_EVERY))


def snapshot(run: GoldenRun, step: int, name: str = "model.safetensors") -> Path:
    """A file of the run's checkpoint at ``step`` (verified: signature and digests)."""
    (directory,) = [path for path in find_checkpoints(run.outcome.run_dir) if checkpoint_step(path) == step]
    verify_checkpoint(directory, platform_trust(platform_key()))
    return directory / name


def schedule_of(run: GoldenRun, workers: int, excluded: tuple[str, ...] = ()) -> ScheduleSpec:
    return ScheduleSpec.from_manifest(
        ShardSet.open(run.shard_root).manifest,
        seed=derive_seed(run.config.seed, 0, "schedule"),
        world_size=workers,
        batch_size=GOLDEN_HPARAMS["batch_size"],
        excluded_corpora=excluded,
    )


def reference_weights(
    run: GoldenRun, steps: int, clipped: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """One process, no DDP: each slot's per-example gradient sum, masked mean per tensor, each
    route group (tensors updated by the same routes) clipped on its own norm, SGD. ``clipped``
    collects the steps where some group's norm was over the limit."""
    config = run.config
    trial = load_trial_class(config.trial)(GOLDEN_HPARAMS)
    torch.manual_seed(derive_seed(config.seed, 0, "init"))
    base = trial.build_model()
    policy = run.checked.policy.policy
    table = resolve_routes(policy, base, trial.layers(base))
    model = GovernedModel(base, table, policy.adapters, seed=derive_seed(config.seed, "adapters"))
    allowed = allowed_route_sets(model, table)
    named = parameters_by_name(model)
    rows = RouteRows(ShardReader(ShardSet.open(run.shard_root)))
    schedule = schedule_of(run, workers=2)
    for step in range(steps):
        slots = step_slots(schedule, step)
        slot_grads: list[dict[str, torch.Tensor]] = []
        for rank, slot in enumerate(slots):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(derive_seed(config.seed, 0, step, rank))
            adapter = None if slot.empty or slot.route is None else table.adapter_names.get(slot.route)
            model.train()
            with model.active(adapter):
                trial.loss(model, trial.collate(rows.take(slot))).sum().backward()
            slot_grads.append(
                {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in named}
            )
        with torch.no_grad():
            update: dict[str, torch.Tensor] = {}
            for index, (name, _) in enumerate(named):
                members = [r for r, s in enumerate(slots) if not s.empty and s.route in allowed[index]]
                count = sum(len(slots[r].rows) for r in members)
                if count:
                    update[name] = sum(slot_grads[r][name] for r in members) / count
            for group in {allowed[index] for index in range(len(named))}:
                names = [name for index, (name, _) in enumerate(named) if allowed[index] == group]
                grads = [update[name] for name in names if name in update]
                if not grads:
                    continue
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                limit = GOLDEN_HPARAMS["max_grad_norm"]
                if norm > limit:
                    if clipped is not None:
                        clipped.append(step)
                    for grad in grads:
                        grad.mul_(limit / (norm + 1e-6))
            for name, parameter in named:
                if name in update:
                    parameter -= GOLDEN_HPARAMS["lr"] * update[name]
    weights = dict(model.base_state())
    for adapter in model.adapter_names():
        weights.update(model.adapter_tensors(adapter))
    return weights


def test_two_worker_update_equals_single_process_masked_mean(golden_run: GoldenRun) -> None:
    step = REPORT_STEPS[0]
    clipped: list[int] = []
    expected = reference_weights(golden_run, step, clipped)
    assert clipped, "per-route-group clipping was never in play"
    got = load_file(snapshot(golden_run, step))
    got.update(load_file(snapshot(golden_run, step, "adapter-pii-lora.safetensors")))
    assert set(got) == set(expected)
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=f"tensor {name}")


def test_adapter_removal_equals_counterfactual_replay(
    golden_run: GoldenRun, golden_run_without_writers: GoldenRun
) -> None:
    """The PII corpus trains only the adapter: at every snapshot the base file is byte-identical to
    the run in which its slots were left empty."""
    for step in REPORT_STEPS:
        with_corpus, without = snapshot(golden_run, step), snapshot(golden_run_without_writers, step)
        assert with_corpus.read_bytes() == without.read_bytes(), f"base differs at step {step}"
        adapter = snapshot(golden_run, step, "adapter-pii-lora.safetensors")
        untouched = snapshot(golden_run_without_writers, step, "adapter-pii-lora.safetensors")
        assert adapter.read_bytes() != untouched.read_bytes(), "the adapter did learn from its corpus"
    first = snapshot(golden_run, REPORT_STEPS[0])
    assert first.read_bytes() != snapshot(golden_run, REPORT_STEPS[-1]).read_bytes(), "the base trained"


def test_ledger_is_exact_and_recomputable(
    golden_run: GoldenRun, golden_run_without_writers: GoldenRun
) -> None:
    routing = golden_run.checked.routing
    assert golden_run.outcome.ledger == recompute_ledger(schedule_of(golden_run, 2), routing, GOLDEN_STEPS)
    replay = golden_run_without_writers.outcome.ledger
    assert replay == recompute_ledger(schedule_of(golden_run, 2, ("digits-writers",)), routing, GOLDEN_STEPS)
    assert "digits-writers" not in replay.corpora()
    assert {
        k: v for k, v in golden_run.outcome.ledger.entries.items() if k[0] != "digits-writers"
    } == replay.entries
    # Direct contribution follows the policy: licensed digits never reach the embed layer, and the
    # writers' corpus reaches only its adapter.
    tensors = golden_run.outcome.ledger.tensors()
    assert ("digits-licensed", "embed.weight") not in golden_run.outcome.ledger.entries
    assert {t for c, t in golden_run.outcome.ledger.entries if c == "digits-writers"} == {
        t for t in tensors if t.startswith("adapter/pii-lora/")
    }


def test_one_epoch_ledger_counts_every_training_row_once(golden_local_epoch: GoldenRun) -> None:
    """One worker, in-process (Train V2 local mode): after one epoch, every tensor a corpus may
    reach has seen exactly that corpus's training-split rows."""
    manifest = ShardSet.open(golden_local_epoch.shard_root).manifest
    ledger = golden_local_epoch.outcome.ledger
    routing = golden_local_epoch.checked.routing
    for corpus in manifest.corpora:
        (route,) = corpus.route_counts
        for tensor in routing.updated_tensors(route):
            assert ledger.entries[(corpus.corpus_id, tensor)].examples == corpus.train_rows
        reached = {tensor for c, tensor in ledger.entries if c == corpus.corpus_id}
        assert reached == set(routing.updated_tensors(route))
    assert ledger == recompute_ledger(
        schedule_of(golden_local_epoch, 1), routing, golden_local_epoch.outcome.max_steps
    )
    assert golden_local_epoch.outcome.metrics["validation_accuracy"] > 0.7  # it learns (chance: 0.1)


def test_run_is_in_the_tracking_store(golden_run: GoldenRun) -> None:
    store, outcome = golden_run.store, golden_run.outcome
    trial = store.get_trial(outcome.trial_id)
    assert trial.state == "completed" and trial.ray_run_name == outcome.run_name
    assert [m.step for m in store.metrics(outcome.trial_id, "training_loss")] == REPORT_STEPS
    # Validation every 10 steps (min_validation_period), each with a checkpoint.
    assert [m.step for m in store.metrics(outcome.trial_id, "validation_loss")] == [10, 20, GOLDEN_STEPS]
    rows = ledger_rows(store, outcome.trial_id)
    assert {(r.corpus_id, r.parameter, r.examples, r.steps) for r in rows} == {
        (c, t, e.examples, e.steps) for c, t, e in outcome.ledger.rows()
    }
    layers: dict[str, Any] = {r.parameter: r.layer_index for r in rows}
    assert layers["embed.weight"] == 0 and layers["head.bias"] == 2
    assert layers["adapter/pii-lora/hidden.lora_A"] == 1
    hparams = json.loads(trial.hparams_json)
    assert hparams == GOLDEN_HPARAMS


def test_weights_are_safetensors_without_pickle(
    golden_run: GoldenRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    assert "head.weight" in load_file(snapshot(golden_run, GOLDEN_STEPS))


def test_gc_runs_as_the_run_goes(golden_local_epoch: GoldenRun) -> None:
    """Default policy (trial best 1, latest 1): the final checkpoint (also the only one with a
    validation metric) survives, every earlier one is deleted, each deletion audited."""
    from govray.tracking.audit import AuditEventType, AuditLog
    from govray.tracking.lineage import checkpoints

    store, outcome = golden_local_epoch.store, golden_local_epoch.outcome
    records = checkpoints(store, outcome.trial_id)
    assert len(records) == -(-outcome.max_steps // GOLDEN_REPORT_EVERY)  # every period, and the end
    active = [r for r in records if r.state == "active"]
    assert [r.step for r in active] == [outcome.max_steps]
    assert [path.name for path in find_checkpoints(outcome.run_dir)] == [Path(active[0].path).name]
    deleted = AuditLog(store).list(event_type=AuditEventType.GC_DELETED)
    assert sorted(event.payload_json for event in deleted) == sorted(
        event.payload_json
        for event in deleted
        if json.loads(event.payload_json)["trial_id"] == outcome.trial_id
    )
    assert len(deleted) == len(records) - 1
    assert AuditLog(store).verify() > len(deleted)


def test_reproducibility_record_is_in_the_store_and_every_checkpoint(golden_run: GoldenRun) -> None:
    import ray

    trial = golden_run.store.get_trial(golden_run.outcome.trial_id)
    record = json.loads(trial.reproducibility_json or "{}")
    assert (
        record["environment"]["torch"] == torch.__version__
        and record["environment"]["ray"] == ray.__version__
    )
    manifest = ShardSet.open(golden_run.shard_root).manifest
    assert {c["corpus_id"]: c["fingerprint"] for c in record["corpora"]} == {
        c.corpus_id: c.fingerprint for c in manifest.corpora
    }
    assert record["code"]["module"] == "jobs.examples.digits.trial"
    state = json.loads(snapshot(golden_run, GOLDEN_STEPS, "state.json").read_text())
    assert state["reproducibility"] == record


def test_resolved_training_settings_reach_every_worker(
    golden_run: GoldenRun, golden_local_epoch: GoldenRun
) -> None:
    """The driver resolves the experiment's training settings with the trial's hyperparameters
    (``optimizer``, ``lr``, ``batch_size``, ``max_grad_norm``) once, and the run spec carries them
    to the workers, whose optimizer is built from them: SGD with its own defaults on 2 Ray Train
    workers, AdamW with its own weight decay in-process."""
    for run, optimizer, defaults in (
        (golden_run, "sgd", {"momentum": 0, "weight_decay": 0}),
        (golden_local_epoch, "adamw", {"weight_decay": 0.01, "betas": [0.9, 0.999]}),
    ):
        final = max(find_checkpoints(run.outcome.run_dir), key=checkpoint_step)
        spec = run_spec_of(final)
        assert spec.settings == run.config.training.with_hyperparameters(spec.hparams)
        assert spec.settings is not None and spec.settings.optimizer.name == optimizer
        assert (spec.settings.batch_size, spec.settings.max_grad_norm) == (16, 0.25)
        assert spec.settings.optimizer.lr == spec.hparams["lr"]
        (group,) = json.loads((final / "optimizer.json").read_text())["param_groups"]
        assert group["initial_lr"] == spec.hparams["lr"]
        assert {name: group[name] for name in defaults} == defaults
