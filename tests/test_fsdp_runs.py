"""Whole governed FSDP runs on 2 Ray Train workers (gloo): removing the adapter's corpus is the
replay without it, bit for bit in every shard (and in the registry's version without the
adapter); a worker SIGKILLed after the first checkpoint resumes from the sharded checkpoint and
ends bit-identical to the uninterrupted run; a memorizing run rolls back from storage while GC
deletes old checkpoints."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from govray.core.canonical import file_sha256
from govray.core.keys import SigningKey, TrustConfig, platform_key, platform_trust
from govray.core.runtime import train_worker_pids
from govray.governance.adapter_files import save_base_tensors
from govray.platform.registry.register import register, remove_adapter
from govray.platform.rerun.replay import Replay, replay_trial
from govray.signer.attesting import attest
from govray.tracking.lineage import attestations, checkpoints
from govray.train.checkpoints.files import (
    MODEL_FILE,
    checkpoint_step,
    find_checkpoints,
    shard_owner,
    verify_checkpoint,
)
from govray.train.checkpoints.whole_file import whole_model_sha256
from jobs.examples.digits.golden import GOLDEN_HPARAMS, GOLDEN_REPORT_EVERY, MEMORIZER
from jobs.examples.digits.golden import golden_example as golden_example_at
from tests.helpers.golden import GoldenRun, golden_run_at
from tests.helpers.memorization import trained
from tests.helpers.sharded_reference import consolidated

pytestmark = pytest.mark.cluster  # 3 whole 2-worker runs (~3 min): the second tier

STEPS = 30
ADAPTER_CORPUS = "digits-writers"
HPARAMS = {**GOLDEN_HPARAMS, "optimizer": "adamw", "lr": 0.01, "weight_decay": 0.1}


@dataclass
class FsdpRuns:
    path: Path  # the experiment
    original: GoldenRun
    replay: Replay  # ``govray replay --exclude-corpus digits-writers`` of the original


@pytest.fixture(scope="module")
def fsdp_runs(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> FsdpRuns:
    path = golden_example_at(
        tmp_path_factory.mktemp("fsdp"),
        workers=2,
        max_length={"batches": STEPS},
        hparams=HPARAMS,
        lr_schedule=False,
        resources={"workers": 2, "cpus_per_worker": 1, "strategy": "fsdp"},
    )
    original = golden_run_at(path)
    replay = replay_trial(
        original.store, original.config.name, (ADAPTER_CORPUS,), trial_id=original.outcome.trial_id
    )
    return FsdpRuns(path, original, replay)


def final(run_dir: Path) -> Path:
    found = find_checkpoints(run_dir)
    assert found and checkpoint_step(found[-1]) == STEPS
    return found[-1]


def shard_files(folder: Path) -> dict[str, Path]:
    return {path.name: path for path in folder.iterdir() if shard_owner(path.name) is not None}


def test_the_run_is_sharded_and_no_checkpoint_holds_the_whole_model(
    fsdp_runs: FsdpRuns, tmp_path: Path
) -> None:
    """Each rank wrote its shards into every checkpoint and none holds ``model.safetensors``: an
    attestation (the trial end's, or of any checkpoint) names the file its verified shards put
    together would be, byte for byte the file the shards put together in memory give."""
    found = find_checkpoints(fsdp_runs.original.outcome.run_dir)
    assert [checkpoint_step(folder) for folder in found] == [10, 20, 30]
    for folder in found:
        assert {shard_owner(name) for name in shard_files(folder)} == {0, 1}
        assert not (folder / MODEL_FILE).exists()
    trust = platform_trust(platform_key())
    verify_checkpoint(found[-1], trust)  # every file, every rank's shards
    in_memory = save_base_tensors(consolidated(found[-1], 2), tmp_path / MODEL_FILE)
    assert whole_model_sha256(found[-1], trust) == in_memory
    first = attest(found[0], destination=tmp_path / "first")
    assert first.subjects[MODEL_FILE] == save_base_tensors(consolidated(found[0], 2), tmp_path / "first.st")
    store = fsdp_runs.original.store
    last = checkpoints(store, fsdp_runs.original.outcome.trial_id)[-1]
    recorded = attestations(store, last.id)  # type: ignore[arg-type]
    assert recorded, "the trial's end attested its last checkpoint"
    assert {record.subject_digest for record in recorded} == {in_memory}


def test_the_fsdp_replay_lists_each_tensor_once(fsdp_runs: FsdpRuns) -> None:
    """The influence table has one row per base tensor (under ``model.safetensors``, not once
    more per shard file) and per adapter tensor."""
    rows = fsdp_runs.replay.report.tensors
    original = final(fsdp_runs.original.outcome.run_dir)
    base = consolidated(original, 2)
    adapter = load_file(str(original / "adapter-pii-lora.safetensors"))
    assert sorted((row.file, row.tensor) for row in rows) == sorted(
        [
            *((MODEL_FILE, name) for name in base),
            *(("adapter-pii-lora.safetensors", name) for name in adapter),
        ]
    )


def test_removing_the_adapter_is_the_replay_without_its_corpus_in_every_shard(fsdp_runs: FsdpRuns) -> None:
    original = final(fsdp_runs.original.outcome.run_dir)
    replay = final(fsdp_runs.replay.outcome.run_dir)
    shards = shard_files(original)
    assert shards.keys() == shard_files(replay).keys()
    for name in shards:
        if name.startswith("model-"):
            assert (original / name).read_bytes() == (replay / name).read_bytes(), name
    adapter = load_file(str(original / "adapter-pii-lora.safetensors"))
    assert any(name.endswith("lora_B") and bool(t.any()) for name, t in adapter.items()), (
        "the adapter learned"
    )
    ledger, replayed = fsdp_runs.original.outcome.ledger, fsdp_runs.replay.outcome.ledger
    assert ledger is not None and replayed is not None
    assert {k: v for k, v in ledger.entries.items() if k[0] != ADAPTER_CORPUS} == replayed.entries


def test_a_killed_worker_resumes_from_the_sharded_checkpoint_bit_identically(fsdp_runs: FsdpRuns) -> None:
    """The same experiment again, one Ray Train worker SIGKILLed once the checkpoint of step 10 is
    recorded: Ray Train restarts the group, both ranks resume from their shards."""
    store = fsdp_runs.original.store
    known = {trial.id for trial in store.list_trials(1)}
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(run=golden_run_at(fsdp_runs.path)), daemon=True)
    thread.start()
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and thread.is_alive():
        new = [t for t in store.list_trials(1) if t.id not in known]
        if new and any(c.step == GOLDEN_REPORT_EVERY for c in checkpoints(store, new[0].id)):
            pids = train_worker_pids()
            if pids:
                killed = pids[-1]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    thread.join(timeout=600)
    assert killed is not None, "never saw the first checkpoint of the run to kill"
    assert "run" in result, "the killed run did not finish"
    resumed = final(result["run"].outcome.run_dir)
    original = final(fsdp_runs.original.outcome.run_dir)
    for name in [*shard_files(original), "adapter-pii-lora.safetensors", "optimizer.json"]:
        assert (original / name).read_bytes() == (resumed / name).read_bytes(), name
    assert result["run"].outcome.ledger == fsdp_runs.original.outcome.ledger


def test_the_registry_removes_the_adapter_of_a_sharded_run_as_the_replay_without_its_corpus(
    fsdp_runs: FsdpRuns,
) -> None:
    """Register the FSDP run's last checkpoint, derive the version without the PII adapter: its
    ``model.safetensors`` (the shards put together, streaming) is the replay's, byte for byte."""
    store = fsdp_runs.original.store
    registered = register(store, "digits-fsdp", final(fsdp_runs.original.outcome.run_dir))
    without = remove_adapter(store, registered.ref, "pii-lora")
    assert not list(without.directory.glob("adapter-*.safetensors"))
    replay = final(fsdp_runs.replay.outcome.run_dir)  # (shards only: compared as put together)
    replayed = whole_model_sha256(replay, platform_trust(platform_key()))
    assert file_sha256(without.directory / MODEL_FILE) == replayed
    assert ADAPTER_CORPUS in without.excluded_corpora


def test_an_fsdp_run_rolls_back_from_storage_while_gc_deletes_old_checkpoints(
    ray_session: None, tmp_path: Path, authority_key: SigningKey, trust: TrustConfig
) -> None:
    """A memorizing 2-worker FSDP run under a rollback policy, GC keeping one latest checkpoint as
    it goes: each rollback reads the clean state from storage (the checkpoint that carries it;
    none in memory), and the weights that go on are the clean ones bit for bit: evaluated again
    at the rollback step they give the clean step's validation loss exactly."""
    policy = (authority_key, trust, {"loss_gap": 0.5, "action": "rollback"})
    outcome, store = trained(
        tmp_path,
        MEMORIZER,
        steps=1500,
        random_labels=True,
        validate_every=300,
        policy=policy,
        resources={"workers": 2, "cpus_per_worker": 1, "strategy": "fsdp"},
        keep_latest=1,
    )
    assert outcome.steps_done == 1500  # it went on after the rollbacks, to the end
    decisions = store.decisions(outcome.trial_id)
    rollbacks = [json.loads(d.payload_json) | {"step": d.step} for d in decisions if d.kind == "rollback"]
    assert rollbacks, "the memorizing corpus was flagged and rolled back"
    assert any(rollback["to_step"] for rollback in rollbacks), rollbacks  # one read a clean checkpoint
    for rollback in rollbacks:
        at = {m.name: m.value for m in store.metrics(outcome.trial_id) if m.step == rollback["step"]}
        clean = {m.name: m.value for m in store.metrics(outcome.trial_id) if m.step == rollback["to_step"]}
        assert at["rolled_back_to"] == rollback["to_step"]
        if rollback["to_step"]:
            assert at["validation_loss"] == clean["validation_loss"], (rollback, at, clean)
    live = [c for c in checkpoints(store, outcome.trial_id) if c.state == "active"]
    assert len(live) < len(checkpoints(store, outcome.trial_id)), "GC deleted checkpoints as it went"
