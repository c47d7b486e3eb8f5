"""Counterfactual replay: `govray replay --exclude-corpus X` reruns the recorded trial with X's slots
empty under a fresh run name, and its influence report separates direct from indirect influence."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from govray.cli import main
from govray.core.errors import GovrayError
from govray.core.storage import open_storage
from govray.platform.rerun.replay import InfluenceReport, Replay, ReplayError, final_checkpoint, replay_trial
from govray.platform.rerun.world_history import WorldSegment
from govray.tracking.lineage import ledger_rows
from govray.tracking.store import TrackingStore
from govray.tracking.tables import TrialKind
from govray.train.reproduce.record import ReproducibilityRecord
from govray.train.reproduce.snapshots import ReproducibilityError
from tests.helpers.golden import GoldenRun
from tests.helpers.processes import govray_elsewhere

WEIGHT_FILES = ("model.safetensors", "adapter-pii-lora.safetensors")


@dataclass(frozen=True)
class ReplayOfAReplay:
    """What `govray replay` printed and reported replaying the golden run's replay without the PII
    corpus (``golden_replay_without_writers``) again without the licensed corpus."""

    out: str  # the CLI's output, whitespace collapsed
    first: int  # the replay it replayed
    report: InfluenceReport
    report_path: Path


def replay_cli(golden_run: GoldenRun, *options: str) -> list[str]:
    """`govray replay` of the golden run's experiment, by id (later experiments share its name)."""
    experiment_id = golden_run.store.get_trial(golden_run.outcome.trial_id).experiment_id
    return ["replay", str(experiment_id), "--database", golden_run.config.database_url, *options]


@pytest.fixture(scope="module")
def replay_of_a_replay(golden_run: GoldenRun, golden_replay_without_writers: Replay) -> ReplayOfAReplay:
    """One Ray Train run for this module's replays: the shared replay without the PII corpus
    (an adapter's) is replayed through the CLI without the licensed corpus (the upper two layers)."""
    first = golden_replay_without_writers.outcome.trial_id
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(replay_cli(golden_run, "--exclude-corpus", "digits-licensed", "--trial", str(first)))
    out = " ".join(printed.getvalue().split())
    assert code == 0, out
    report_path = Path(out.split("influence report: ")[1].split()[0])
    report = InfluenceReport.model_validate_json(report_path.read_text())
    return ReplayOfAReplay(out, first, report, report_path)


def test_upper_layer_corpus_has_no_direct_but_indirect_influence_below(
    golden_run: GoldenRun, replay_of_a_replay: ReplayOfAReplay
) -> None:
    report = replay_of_a_replay.report
    assert report.excluded_corpora == ["digits-licensed"]
    store = golden_run.store
    others = store.list_trials(store.get_trial(golden_run.outcome.trial_id).experiment_id)
    assert report.replay_run not in {t.ray_run_name for t in others if t.id != report.replay_trial}  # fresh
    rows = {row.tensor: row for row in report.tensors}
    for tensor in ("embed.weight", "embed.bias"):  # layer 0: outside the licensed route
        assert rows[tensor].direct_examples == 0
        assert rows[tensor].kind == "indirect" and rows[tensor].distance > 0
    for tensor in ("hidden.weight", "head.weight"):
        assert rows[tensor].kind == "direct" and rows[tensor].direct_examples > 0
    # Ledger of the replay: the excluded corpora are gone, nothing else is.
    corpora = {row.corpus_id for row in ledger_rows(golden_run.store, report.replay_trial)}
    assert corpora == {"digits-public"}, corpora
    assert replay_of_a_replay.report_path.exists()


def decision_record(store: TrackingStore, trial_id: int) -> list[tuple[int, int, str, float]]:
    return [
        (row.seq, row.step, row.kind, json.loads(row.payload_json)["scale"])
        for row in store.decisions(trial_id)
    ]


def test_the_replay_applies_the_recorded_lr_cuts_although_its_own_metrics_differ(
    golden_run: GoldenRun, replay_of_a_replay: ReplayOfAReplay
) -> None:
    """The golden run's plateau rule cut the LR at steps 20 and 30. Without the licensed corpus
    the validation losses differ, yet the replay cuts at exactly those steps, by the record."""
    store = golden_run.store
    original = decision_record(store, golden_run.outcome.trial_id)
    assert original == [(0, 20, "lr_scale", 0.5), (1, 30, "lr_scale", 0.25)]
    for replayed_trial in (replay_of_a_replay.first, replay_of_a_replay.report.replay_trial):
        assert decision_record(store, replayed_trial) == original
        assert all(row.replayed for row in store.decisions(replayed_trial))
    replayed_trial = replay_of_a_replay.report.replay_trial
    assert not any(row.replayed for row in store.decisions(golden_run.outcome.trial_id))

    def losses(trial_id: int) -> dict[int, float]:
        return {m.step: m.value for m in store.metrics(trial_id, "validation_loss")}

    assert set(losses(replayed_trial)) == {10, 20, 30}
    assert all(losses(replayed_trial)[step] != losses(golden_run.outcome.trial_id)[step] for step in (20, 30))


def test_replay_without_the_adapter_corpus_matches_the_base_bit_for_bit(
    golden_run: GoldenRun, golden_replay_without_writers: Replay
) -> None:
    """The product's strongest promise: the PII corpus trains only its adapter, so the replay
    without it (``govray replay``'s function; the CLI is this module's replay of a replay) has a
    byte-identical base model under a fresh run name — with a metric-driven LR schedule cutting
    the LR twice (applied from the record) and per-route-group gradient clipping active
    (GOLDEN_HPARAMS' max_grad_norm)."""
    report = golden_replay_without_writers.report
    assert report.original_trial == golden_run.outcome.trial_id
    # A run of one world size is replayed as one run on it (``platform.world_history``).
    assert golden_replay_without_writers.segments == (WorldSegment(0, 30, 2),)
    assert report.excluded_corpora == ["digits-writers"]
    assert report.replay_run != golden_run.outcome.run_name  # a fresh Ray Train run
    base = [row for row in report.tensors if row.file == "model.safetensors"]
    assert base and all(row.distance == 0.0 and row.kind == "none" for row in base)
    adapter = [row for row in report.tensors if row.file.startswith("adapter-")]
    assert adapter and all(row.kind == "direct" for row in adapter)
    replayed = final_checkpoint(golden_replay_without_writers.outcome.run_dir, golden_run.checked.trust)
    original = final_checkpoint(golden_run.outcome.run_dir, golden_run.checked.trust)
    assert (replayed / "model.safetensors").read_bytes() == (original / "model.safetensors").read_bytes()


def test_replay_refuses_an_unknown_corpus(golden_run: GoldenRun) -> None:
    with pytest.raises(GovrayError, match="has no corpus nope"):
        replay_trial(golden_run.store, golden_run.config.name, ("nope",))


# -- replays are marked, and a replay is never mistaken for the original ----------------------


def test_replaying_a_replay_needs_its_id_and_says_what_it_replays(
    golden_run: GoldenRun, replay_of_a_replay: ReplayOfAReplay
) -> None:
    first, report = replay_of_a_replay.first, replay_of_a_replay.report
    assert (
        f"trial {first} is itself a replay of trial {golden_run.outcome.trial_id} without digits-writers"
        in replay_of_a_replay.out
    )
    segments = "replay segments (the replayed trial's world sizes): 2 workers for steps 1-30"
    assert segments in replay_of_a_replay.out
    assert (report.original_trial, report.original_replay_of) == (first, golden_run.outcome.trial_id)
    assert (report.excluded_corpora, report.already_excluded) == (["digits-licensed"], ["digits-writers"])
    replayed = golden_run.store.get_trial(report.replay_trial)
    assert (replayed.kind, replayed.replay_of) == ("replay", first)
    corpora = {row.corpus_id for row in ledger_rows(golden_run.store, report.replay_trial)}
    assert corpora and not corpora & {"digits-licensed", "digits-writers"}  # both left out


# -- a replay runs the recorded code ----------------------------------------------------------


@pytest.fixture(scope="module")
def replay_without_licensed(golden_run: GoldenRun) -> Replay:
    """The golden run replayed without the licensed corpus, in the project (the slow test's reference)."""
    return replay_trial(
        golden_run.store, golden_run.config.name, ("digits-licensed",), trial_id=golden_run.outcome.trial_id
    )


@pytest.mark.slow  # two whole replays, one in a process of its own: the slow tier
def test_replay_without_trial_from_another_directory_replays_the_original_as_recorded(
    golden_run: GoldenRun, replay_without_licensed: Replay, tmp_path: Path
) -> None:
    """After a replay, `govray replay` without --trial replays the latest original again, never
    that replay (compared with itself, a replay without the licensed corpus would mark every tensor
    'none'). It runs from a directory where a plain import finds an edited trial (losses doubled),
    yet its weights are byte for byte those of a replay of that original done in the project: the recorded
    code ran, in the driver and in both Ray Train workers."""
    store = golden_run.store
    experiment_id = store.get_trial(golden_run.outcome.trial_id).experiment_id
    govray_elsewhere(tmp_path / "elsewhere", *replay_cli(golden_run, "--exclude-corpus", "digits-licensed"))

    trials = store.list_trials(experiment_id)
    second = trials[-1]
    # A rerun of the golden trial (resumed, perhaps on another world) may be the latest original.
    originals = [t for t in trials if t.kind == TrialKind.ORIGINAL and t.state == "completed"]
    assert (second.kind, second.replay_of, second.state) == ("replay", originals[-1].id, "completed")
    first = store.get_trial(replay_without_licensed.outcome.trial_id)
    assert (first.kind, first.replay_of) == ("replay", golden_run.outcome.trial_id)
    assert store.get_trial(golden_run.outcome.trial_id).kind == "original"
    storage = open_storage(golden_run.config.storage_path).root
    report = InfluenceReport.model_validate_json(
        (storage / "reports" / f"influence-trial{second.replay_of}-replay{second.id}.json").read_text()
    )
    assert report.original_replay_of is None
    kinds = {row.tensor: row.kind for row in report.tensors}
    assert kinds["hidden.weight"] == "direct" and kinds["embed.weight"] == "indirect"
    assert second.ray_run_name is not None
    latest = originals[-1].id
    assert latest is not None
    if latest == golden_run.outcome.trial_id:
        in_project = replay_without_licensed
    else:  # an earlier test's resumed rerun, on another world size: its replay follows its worlds
        in_project = replay_trial(store, golden_run.config.name, ("digits-licensed",), trial_id=latest)
    before = final_checkpoint(in_project.outcome.run_dir, golden_run.checked.trust)
    after = final_checkpoint(storage / "ray" / second.ray_run_name, golden_run.checked.trust)
    for name in WEIGHT_FILES:
        assert (before / name).read_bytes() == (after / name).read_bytes(), name


def test_a_tampered_code_snapshot_is_refused_naming_the_file(golden_run: GoldenRun) -> None:
    store, trial_id = golden_run.store, golden_run.outcome.trial_id
    code = ReproducibilityRecord.model_validate_json(
        store.get_trial(trial_id).reproducibility_json or ""
    ).code
    storage = open_storage(golden_run.config.storage_path).root
    tampered = storage / "code" / code.digest / "jobs" / "examples" / "digits" / "trial.py"
    recorded = tampered.read_bytes()
    experiment_id = store.get_trial(trial_id).experiment_id
    trials_before = len(store.list_trials(experiment_id))
    try:
        tampered.write_bytes(recorded.replace(b"F.cross_entropy(model(", b"2.0 * F.cross_entropy(model("))
        # Refused as a replay (exit 11), the code's own error named as its cause.
        with pytest.raises(ReplayError, match=f"{tampered} changed since it was recorded") as refused:
            replay_trial(store, str(experiment_id), ("digits-licensed",), trial_id=trial_id)
        assert isinstance(refused.value.__cause__, ReproducibilityError) and refused.value.exit_code == 11
    finally:
        tampered.write_bytes(recorded)
    assert len(store.list_trials(experiment_id)) == trials_before  # refused before anything ran
