"""Checkpoints: a killed worker resumes bit-identically; a tampered checkpoint is refused."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from govray.core.keys import KeyRole, SigningKey, platform_key, platform_trust
from govray.core.runtime import train_worker_pids
from govray.tracking.lineage import checkpoints
from govray.train.checkpoints.files import (
    MANIFEST_FILE,
    MODEL_FILE,
    SIGNATURE_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointState,
    find_checkpoints,
    load_checkpoint,
    seal_checkpoint,
    verify_checkpoint,
)
from govray.train.checkpoints.manifest import TrainedUnder
from govray.train.checkpoints.signer import KeySigner
from jobs.examples.digits.golden import GOLDEN_REPORT_EVERY, GOLDEN_STEPS
from tests.helpers.golden import GoldenRun, final_checkpoint
from tests.helpers.killed_run import run_killing_a_worker
from tests.helpers.processes import govray_elsewhere, kill_driver_when


@pytest.fixture(scope="module")
def killed_run(golden_run: GoldenRun, golden_example: Path) -> GoldenRun:
    """The golden configuration again, with one Ray Train worker SIGKILLed as soon as the first
    checkpoint (step 10) verifies on storage: Ray Train restarts the worker group, which resumes.
    (Waiting for the driver to record it, up to Ray Train's 2-s report poll later, let the 30-step
    run end first once steps got faster.)"""
    run, _ = run_killing_a_worker(golden_run, golden_example, seed=0)
    return run


@pytest.mark.slow  # a kill and a whole resumed Ray run: the slow tier (store_completeness seed 0 stays)
def test_killed_worker_resumes_bit_identically(golden_run: GoldenRun, killed_run: GoldenRun) -> None:
    original, resumed = (
        final_checkpoint(golden_run.outcome.run_dir),
        final_checkpoint(killed_run.outcome.run_dir),
    )
    for name in (
        "model.safetensors",
        "adapter-pii-lora.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
    ):
        assert (original / name).read_bytes() == (resumed / name).read_bytes(), name
    ledger = [json.loads((d / STATE_FILE).read_text())["ledger"] for d in (original, resumed)]
    assert ledger[0] == ledger[1]
    assert killed_run.outcome.ledger == golden_run.outcome.ledger
    # The restarted group re-ran the steps after the checkpoint; metrics are stored once per step.
    steps = [m.step for m in killed_run.store.metrics(killed_run.outcome.trial_id, "training_loss")]
    assert steps == sorted(set(steps))


@pytest.fixture
def checkpoint_copy(golden_run: GoldenRun, tmp_path: Path) -> Path:
    copy = tmp_path / "checkpoint"
    shutil.copytree(final_checkpoint(golden_run.outcome.run_dir), copy)
    return copy


def trust() -> Any:
    return platform_trust(platform_key())


def test_checkpoint_round_trips(checkpoint_copy: Path) -> None:
    loaded = load_checkpoint(checkpoint_copy, trust())
    assert loaded.state.step == GOLDEN_STEPS and loaded.state.adapters == ["pii-lora"]
    assert loaded.signer == platform_key().keyid


@pytest.mark.parametrize(
    ("written", "refused"),
    [
        (
            {"format": "govray-checkpoint-v2"},
            "format 'govray-checkpoint-v2'; this govray reads 'govray-checkpoint-v1'",
        ),
        ({"memorization_baselines": {}}, "memorization_baselines"),  # a retired pre-release field
    ],
)
def test_a_signed_checkpoint_of_another_format_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: dict[str, object], refused: str
) -> None:
    """One format at release: a ``state.json`` of another format (a newer govray's) or with a
    field this one does not know is refused, signature valid or not, naming what it found; never
    read by guessing."""
    key = SigningKey.generate(KeyRole.PLATFORM)
    save_file({"weight": torch.zeros(2)}, str(tmp_path / MODEL_FILE))
    state = CheckpointState(
        step=3,
        epoch=0,
        seed=7,
        trial_seed=0,
        schedule={},
        schedule_digest="s",
        policy_digest="p",
        config_digest="c",
        ledger={},
        world_history=[(0, 1)],
        hparams_history=[TrainedUnder(from_step=0, run="run", hparams={})],
    )
    dump = CheckpointState.model_dump
    with monkeypatch.context() as other_format:
        other_format.setattr(
            CheckpointState, "model_dump", lambda self, **kw: {**dump(self, **kw), **written}
        )
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        seal_checkpoint(tmp_path, optimizer.state_dict(), state, KeySigner(key))
    with pytest.raises(CheckpointError, match=re.escape(refused)):
        load_checkpoint(tmp_path, platform_trust(key))


@pytest.mark.parametrize(
    "name",
    [
        "model.safetensors",
        "adapter-pii-lora.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "state.json",
        MANIFEST_FILE,
    ],
)
def test_any_flipped_byte_is_refused_naming_the_file(checkpoint_copy: Path, name: str) -> None:
    path = checkpoint_copy / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{name}"):
        verify_checkpoint(checkpoint_copy, trust())


def test_rewritten_manifest_needs_the_platform_key(checkpoint_copy: Path) -> None:
    """A tamperer who edits a file and rewrites the manifest (and even re-signs it with another
    key) is still refused."""
    from govray.core.canonical import file_sha256
    from govray.core.dsse import sign_envelope
    from govray.train.checkpoints.manifest import MANIFEST_TYPE, Manifest

    (checkpoint_copy / STATE_FILE).write_text(
        (checkpoint_copy / STATE_FILE).read_text().replace('"step": 30', '"step": 31')
    )
    manifest = Manifest.model_validate_json((checkpoint_copy / MANIFEST_FILE).read_text())
    files = {**manifest.files, STATE_FILE: file_sha256(checkpoint_copy / STATE_FILE)}
    forged = manifest.model_copy(update={"files": files}).to_bytes()
    (checkpoint_copy / MANIFEST_FILE).write_bytes(forged)
    with pytest.raises(CheckpointError, match="differs from the manifest its signature covers"):
        verify_checkpoint(checkpoint_copy, trust())
    stranger = SigningKey.generate(KeyRole.PLATFORM)
    (checkpoint_copy / SIGNATURE_FILE).write_text(sign_envelope(forged, MANIFEST_TYPE, stranger).to_json())
    with pytest.raises(CheckpointError, match=f"key {stranger.keyid} is not trusted"):
        verify_checkpoint(checkpoint_copy, trust())


def test_missing_signature_and_extra_files_are_refused(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "extra.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="extra.bin: not listed in the signed manifest"):
        verify_checkpoint(checkpoint_copy, trust())
    (checkpoint_copy / "extra.bin").unlink()
    (checkpoint_copy / SIGNATURE_FILE).unlink()
    with pytest.raises(CheckpointError, match="unsigned checkpoint is refused"):
        verify_checkpoint(checkpoint_copy, trust())


def driver_killed_after_first_checkpoint(
    golden_run: GoldenRun, golden_example: Path, with_workers: bool = False
) -> int:
    """The golden configuration's ``jobs/train.py`` SIGKILLed after its first checkpoint (and,
    ``with_workers``, its Ray Train workers at once: a machine lost, not only its driver — the
    workers of a killed driver otherwise train on for a moment, up to the run's end): the
    interrupted trial's id."""
    store = golden_run.store
    known = {trial.id for trial in store.list_trials(1)}
    found: list[int] = []
    first = f"checkpoint_{GOLDEN_REPORT_EVERY:08d}"
    runs = Path(golden_run.config.storage_path) / "ray"
    sealed_before = set(runs.glob(f"*/{first}/{SIGNATURE_FILE}"))

    def first_checkpoint_written() -> bool:
        new = [t for t in store.list_trials(1) if t.id not in known]
        if not new:
            return False
        if with_workers:  # the moment rank 0 signs it: the driver records it later, the workers race on
            ready = bool(set(runs.glob(f"*/{first}/{SIGNATURE_FILE}")) - sealed_before)
        else:
            ready = any(c.step == GOLDEN_REPORT_EVERY for c in checkpoints(store, new[0].id))  # type: ignore[arg-type]
        if ready:
            found.append(new[0].id)  # type: ignore[arg-type]
            for pid in train_worker_pids() if with_workers else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return bool(found)

    kill_driver_when("train.py", golden_example, first_checkpoint_written)
    assert store.get_trial(found[0]).state == "active"  # nobody marked it done: the driver died
    time.sleep(3)  # the job's Ray Train controller and workers die with their driver
    return found[0]


@pytest.fixture(scope="module", params=["govray resume elsewhere", "jobs/train.py"])
def resumed_after_driver_kill(
    request: pytest.FixtureRequest,
    golden_run: GoldenRun,
    golden_example: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    """`jobs/train.py` (what `ray job submit` runs) in its own process on the session's Ray,
    SIGKILLed after its first checkpoint; then `govray resume EXPERIMENT`, run from a directory
    where a plain import finds an edited trial (so only the recorded code snapshot resumes it as
    it ran), or, in this process, the same `jobs/train.py` call (a resubmitted job continues the
    interrupted trial)."""

    from govray.cli import main

    store = golden_run.store
    known = {trial.id for trial in store.list_trials(1)}
    trial_id = driver_killed_after_first_checkpoint(golden_run, golden_example)
    if request.param == "govray resume elsewhere":
        elsewhere = tmp_path_factory.mktemp("resume") / "elsewhere"
        govray_elsewhere(
            elsewhere, "resume", golden_run.config.name, "--database", golden_run.config.database_url
        )
    else:
        from jobs.train import parse

        assert main(parse(["--config", str(golden_example)])) == 0
    assert len(store.list_trials(1)) == len(known) + 1  # continued, not started anew
    return store.get_trial(trial_id)


@pytest.mark.slow  # a kill and a whole resumed Ray run: the slow tier (store_completeness seed 0 stays)
def test_killed_driver_resumes_bit_identically(golden_run: GoldenRun, resumed_after_driver_kill: Any) -> None:
    trial = resumed_after_driver_kill
    assert trial.state == "completed"
    # Step 10 was reported before the kill and never again: the resume started from checkpoint 10.
    steps = [m.step for m in golden_run.store.metrics(trial.id, "training_loss")]
    assert steps == [10, 20, 30]
    run_dir = golden_run.config.storage_path
    resumed = final_checkpoint(Path(run_dir) / "ray" / trial.ray_run_name)
    original = final_checkpoint(golden_run.outcome.run_dir)
    for name in ("model.safetensors", "adapter-pii-lora.safetensors", "optimizer.safetensors"):
        assert (original / name).read_bytes() == (resumed / name).read_bytes(), name
    assert (
        json.loads((original / STATE_FILE).read_text())["ledger"]
        == json.loads((resumed / STATE_FILE).read_text())["ledger"]
    )


@pytest.mark.slow  # a kill and a whole resumed Ray run: the slow tier
def test_a_killed_driver_resumes_on_another_world_size_continuing_its_schedule(
    golden_run: GoldenRun, golden_example: Path, tmp_path: Path
) -> None:
    """``govray resume EXPERIMENT --workers 1`` after the 2-worker golden run's driver died past
    its first checkpoint: the run completes on one worker running both slots of each step, its ledger is the
    2-worker run's exactly (it counts the schedule's slots), its weights are within the fp32
    summation order of it, and its final checkpoint records the world sizes it trained on."""
    store = golden_run.store
    trial_id = driver_killed_after_first_checkpoint(golden_run, golden_example, with_workers=True)
    # The newest checkpoint the killed run left (10, or 20 where the workers outran the kill):
    # the resume continues from it on the new world.
    interrupted = Path(golden_run.config.storage_path) / "ray" / str(store.get_trial(trial_id).ray_run_name)
    sealed = [folder for folder in find_checkpoints(interrupted) if (folder / STATE_FILE).exists()]
    left = int(json.loads((sealed[-1] / STATE_FILE).read_text())["step"])
    assert left in (GOLDEN_REPORT_EVERY, 2 * GOLDEN_REPORT_EVERY), left
    printed = govray_elsewhere(
        tmp_path / "elsewhere",
        "resume",
        golden_run.config.name,
        "--database",
        golden_run.config.database_url,
        "--workers",
        "1",
    )
    assert "on 1 worker (configured: 2; each step keeps its run's slots" in printed, printed
    trial = store.get_trial(trial_id)
    assert trial.state == "completed"
    resumed = final_checkpoint(Path(golden_run.config.storage_path) / "ray" / str(trial.ray_run_name))
    original = final_checkpoint(golden_run.outcome.run_dir)
    states = [json.loads((folder / STATE_FILE).read_text()) for folder in (original, resumed)]
    assert states[0]["ledger"] == states[1]["ledger"]
    assert states[1]["world_history"] == [[0, 2], [left, 1]]
    assert states[1]["schedule_digest"] == states[0]["schedule_digest"]
    for name in ("model.safetensors", "adapter-pii-lora.safetensors"):
        expected, found = load_file(str(original / name)), load_file(str(resumed / name))
        assert expected.keys() == found.keys()
        for tensor in expected:
            torch.testing.assert_close(found[tensor], expected[tensor], rtol=1e-4, atol=1e-5, msg=tensor)
