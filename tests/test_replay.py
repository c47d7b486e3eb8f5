"""Counterfactual replay: `govray replay --exclude-corpus X` reruns the recorded trial with X's slots
empty under a fresh run name, and its influence report separates direct from indirect influence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from govray.cli import main
from govray.errors import GovrayError
from govray.replay import Replay, replay_trial
from govray.tracking.store import TrackingStore
from tests.conftest import GoldenRun


@pytest.fixture(scope="module")
def replay_without_licensed(golden_run: GoldenRun) -> Replay:
    """The golden run replayed without the licensed corpus (routed to the upper two layers)."""
    return replay_trial(
        golden_run.store, golden_run.config.name, ("digits-licensed",), trial_id=golden_run.outcome.trial_id
    )


def test_upper_layer_corpus_has_no_direct_but_indirect_influence_below(
    golden_run: GoldenRun, replay_without_licensed: Replay
) -> None:
    report = replay_without_licensed.report
    assert report.replay_run != golden_run.outcome.run_name  # a fresh Ray Train run
    rows = {row.tensor: row for row in report.tensors}
    for tensor in ("embed.weight", "embed.bias"):  # layer 0: outside the licensed route
        assert rows[tensor].direct_examples == 0
        assert rows[tensor].kind == "indirect" and rows[tensor].distance > 0
    for tensor in ("hidden.weight", "head.weight"):
        assert rows[tensor].kind == "direct" and rows[tensor].direct_examples > 0
    # Ledger of the replay: the excluded corpus is gone, nothing else is.
    ledger = replay_without_licensed.outcome.ledger
    assert ledger is not None and "digits-licensed" not in ledger.corpora()
    assert replay_without_licensed.report_path.exists()


def decision_record(store: TrackingStore, trial_id: int) -> list[tuple[int, int, str, float]]:
    return [
        (row.seq, row.step, row.kind, json.loads(row.payload_json)["scale"])
        for row in store.decisions(trial_id)
    ]


def test_the_replay_applies_the_recorded_lr_cuts_although_its_own_metrics_differ(
    golden_run: GoldenRun, replay_without_licensed: Replay
) -> None:
    """The golden run's plateau rule cut the LR at steps 20 and 30. Without the licensed corpus
    the validation losses differ, yet the replay cuts at exactly those steps, by the record."""
    store = golden_run.store
    original = decision_record(store, golden_run.outcome.trial_id)
    assert original == [(0, 20, "lr_scale", 0.5), (1, 30, "lr_scale", 0.25)]
    replayed_trial = replay_without_licensed.outcome.trial_id
    assert decision_record(store, replayed_trial) == original
    assert all(row.replayed for row in store.decisions(replayed_trial))
    assert not any(row.replayed for row in store.decisions(golden_run.outcome.trial_id))

    def losses(trial_id: int) -> dict[int, float]:
        return {m.step: m.value for m in store.metrics(trial_id, "validation_loss")}

    assert set(losses(replayed_trial)) == {10, 20, 30}
    assert all(losses(replayed_trial)[step] != losses(golden_run.outcome.trial_id)[step] for step in (20, 30))


def test_replay_without_the_adapter_corpus_matches_the_base_bit_for_bit(
    golden_run: GoldenRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The product's strongest promise, through the CLI: the PII corpus trains only its adapter,
    so the replay without it has a byte-identical base model (and a fresh run name) — with a
    metric-driven LR schedule cutting the LR twice (applied from the record) and per-route-group
    gradient clipping active (GOLDEN_HPARAMS' max_grad_norm)."""
    code = main(
        [
            "replay",
            golden_run.config.name,
            "--exclude-corpus",
            "digits-writers",
            "--database",
            golden_run.config.database_url,
            "--trial",
            str(golden_run.outcome.trial_id),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "influence report:" in out
    report_path = Path(out.strip().splitlines()[-1].split("influence report: ")[1])
    from govray.replay import InfluenceReport

    report = InfluenceReport.model_validate_json(report_path.read_text())
    base = [row for row in report.tensors if row.file == "model.safetensors"]
    assert base and all(row.distance == 0.0 and row.kind == "none" for row in base)
    adapter = [row for row in report.tensors if row.file.startswith("adapter-")]
    assert adapter and all(row.kind == "direct" for row in adapter)


def test_replay_refuses_an_unknown_corpus(golden_run: GoldenRun) -> None:
    with pytest.raises(GovrayError, match="has no corpus nope"):
        replay_trial(golden_run.store, golden_run.config.name, ("nope",))
