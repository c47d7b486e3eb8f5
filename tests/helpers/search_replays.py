"""Replaying the trials of a search (the tests' shared builder): `govray replay --trial N` of a
search trial without the PII corpus, and what "removal = replay" then demands of it — the base
bit for bit, the adapter changed, the ledger the original's minus the corpus."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from govray.cli import main
from govray.core.keys import TrustConfig
from govray.platform.rerun.replay import InfluenceReport
from govray.tracking.lineage import final_checkpoint_record, ledger_rows
from govray.tracking.store import TrackingStore
from govray.train.checkpoints.files import STATE_FILE, CheckpointState, checkpoint_step
from govray.train.checkpoints.whole_file import base_tensors, file_tensors

WRITERS = "digits-writers"  # the PII corpus: routed to the pii-lora adapter only
ADAPTER_FILE = "adapter-pii-lora.safetensors"


@dataclass(frozen=True)
class Cli:
    code: int
    out: str  # whitespace collapsed
    err: str  # whitespace collapsed
    first_error_line: str  # of stderr, as printed


def govray(*argv: str) -> Cli:
    """The `govray` CLI in this process, its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    printed = err.getvalue()
    first = printed.splitlines()[0] if printed.strip() else ""
    return Cli(code, " ".join(out.getvalue().split()), " ".join(printed.split()), first)


def replay_cli(store: TrackingStore, trial_id: int, *exclude: str) -> Cli:
    """`govray replay EXPERIMENT --trial N --exclude-corpus ...` of a trial of ``store``."""
    experiment = store.get_trial(trial_id).experiment_id
    options = [part for corpus in exclude for part in ("--exclude-corpus", corpus)]
    return govray("replay", str(experiment), "--trial", str(trial_id), *options, "--database", store.url)


def replayed_without_writers(store: TrackingStore, trial_id: int) -> InfluenceReport:
    """The influence report of trial ``trial_id`` replayed through the CLI without the PII corpus."""
    done = replay_cli(store, trial_id, WRITERS)
    assert done.code == 0, (done.out, done.err)
    return InfluenceReport.model_validate_json(
        Path(done.out.split("influence report: ")[1].split()[0]).read_text()
    )


def final_folder(store: TrackingStore, trial_id: int) -> Path:
    record = final_checkpoint_record(store, trial_id)
    assert record is not None, f"trial {trial_id} kept no checkpoint"
    return Path(record.path)


def ledger_of(store: TrackingStore, trial_id: int) -> dict[tuple[str, str], tuple[int, int, int]]:
    return {(r.corpus_id, r.parameter): (r.examples, r.tokens, r.steps) for r in ledger_rows(store, trial_id)}


def assert_removal_equals_replay(
    store: TrackingStore, trust: TrustConfig, report: InfluenceReport, stopped_at: int
) -> None:
    """The replay of a search trial without the PII corpus ends at the step the trial ended at
    (an ASHA stop's too), with a base model bit-identical to the trial's, an adapter that differs,
    and the trial's ledger less every entry of the corpus."""
    original, replay = report.original_trial, report.replay_trial
    assert report.excluded_corpora == [WRITERS] and report.step == stopped_at
    before, after = final_folder(store, original), final_folder(store, replay)
    assert checkpoint_step(before) == checkpoint_step(after) == stopped_at
    base = list(zip(base_tensors(before, trust), base_tensors(after, trust), strict=True))
    assert base
    for (name, a), (other, b) in base:
        assert (
            name == other and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        ), name
    adapter = list(zip(file_tensors(before / ADAPTER_FILE), file_tensors(after / ADAPTER_FILE), strict=True))
    assert any(not torch.equal(a, b) for (_, a), (_, b) in adapter), (
        "the adapter is the same without its corpus"
    )
    ledger = ledger_of(store, original)
    assert any(corpus == WRITERS for corpus, _ in ledger), "the trial never trained on the PII corpus"
    assert ledger_of(store, replay) == {key: entry for key, entry in ledger.items() if key[0] != WRITERS}
    assert {row.file for row in report.tensors if row.kind == "direct" and row.distance > 0} == {ADAPTER_FILE}


def hparams_history(store: TrackingStore, trial_id: int) -> list[tuple[int, str, dict[str, Any]]]:
    """(from step, run, hyperparameters) of the trial's final checkpoint's state."""
    state = CheckpointState.model_validate_json((final_folder(store, trial_id) / STATE_FILE).read_text())
    return [(entry.from_step, entry.run, entry.hparams) for entry in state.hparams_history]
