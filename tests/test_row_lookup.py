"""Row-level lineage: row questions are answered from the schedule.

The fast path finds a row's step per epoch from its permuted position; every test here checks it
against a brute-force scan of ``govray.data.slots.slot`` over every step and rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from govray.cli import main
from govray.data.schedule import SCHEDULE_VERSION, RouteLayout, ScheduleEvent, ScheduleSpec
from govray.data.shards import ShardSet
from govray.data.slots import slot
from govray.governance.routing import resolve_routes
from govray.provenance.row_reach import LineageError, TrialReach, in_weights, row_reach, row_steps
from govray.tracking.lineage import checkpoints
from govray.train.checkpoints.files import STATE_FILE, CheckpointError, CheckpointState
from govray.train.runspec import RunSpec
from govray.train.step.ledger import Ledger
from govray.train.trial import load_trial_class
from tests.helpers.golden import GoldenRun
from tests.helpers.rows import WRITERS, corpus_rows


def scan(spec: ScheduleSpec, steps: int) -> dict[tuple[str, int], tuple[list[int], list[int]]]:
    """Brute force: (route, position) → (reached steps, reverted steps), from every slot."""
    found: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for step in range(steps):
        for rank in range(spec.world_size):
            held = slot(spec, step, rank)
            for position in held.rows:
                assert held.route is not None
                reached, reverted = found.setdefault((held.route, position), ([], []))
                (reverted if spec.reverted(step) else reached).append(step)
    return found


def assert_fast_path_matches_scan(spec: ScheduleSpec, steps: int) -> int:
    expected = scan(spec, steps)
    for route in spec.routes:
        for position in range(route.rows):
            assert row_steps(spec, route.route, position, steps) == expected.get(
                (route.route, position), ([], [])
            ), (route.route, position)
    return len(expected)


def test_row_steps_equal_a_scan_of_every_slot_across_epochs_exclusions_gates_and_rollbacks() -> None:
    spec = ScheduleSpec(
        seed=11,
        world_size=3,
        batch_size=4,
        routes=(
            RouteLayout("open", (("a", 13), ("b", 6))),
            RouteLayout("adapter", (("c", 9),)),
            RouteLayout("empty", ()),
        ),
        excluded_corpora=frozenset({"b"}),
        events=(
            ScheduleEvent(step=9, kind="gate", corpus_id="c"),
            ScheduleEvent(step=7, kind="rollback", to_step=4),
        ),
    )
    steps = 4 * spec.steps_per_epoch + 1  # several epochs and one step into the next
    assert assert_fast_path_matches_scan(spec, steps) > 0
    assert row_steps(spec, "open", 13, steps) == ([], [])  # corpus b: excluded, in no list
    reverted = [
        step
        for route in spec.routes
        for p in range(route.rows)
        for step in row_steps(spec, route.route, p, steps)[1]
    ]
    assert reverted and all(4 <= step < 7 for step in reverted)


def test_a_rolled_back_step_is_in_no_checkpoint_saved_after_the_rollback() -> None:
    spec = ScheduleSpec(
        seed=1,
        world_size=1,
        batch_size=2,
        routes=(RouteLayout("all", (("a", 8),)),),
        events=(ScheduleEvent(step=6, kind="rollback", to_step=3),),
    )
    assert in_weights(spec, 4, 5)  # saved before the rollback: it holds step 4
    assert not in_weights(spec, 4, 6) and not in_weights(spec, 4, 10)
    assert in_weights(spec, 2, 10) and not in_weights(spec, 5, 5)


# --- the golden run: 2 Ray Train workers, 30 steps of the digits example ------------------------


def run_spec(golden: GoldenRun) -> RunSpec:
    path = Path(golden.config.storage_path) / "runs" / f"{golden.outcome.run_name}.json"
    return RunSpec.model_validate_json(path.read_text())


def final_state(golden: GoldenRun) -> CheckpointState:
    last = checkpoints(golden.store, golden.outcome.trial_id)[-1]
    return CheckpointState.model_validate_json((Path(last.path) / STATE_FILE).read_text())


def trial_of(reach_trials: list[TrialReach], trial_id: int) -> TrialReach:
    (found,) = [trial for trial in reach_trials if trial.trial_id == trial_id]
    return found


def test_every_training_row_of_the_golden_run_reaches_exactly_the_steps_a_scan_finds(
    golden_run: GoldenRun,
) -> None:
    state = final_state(golden_run)
    spec = ScheduleSpec.from_json(state.schedule)
    assert spec.version == SCHEDULE_VERSION
    assert state.step == 30 < spec.steps_per_epoch  # each row trained at most once
    ledger = Ledger.from_json(state.ledger)
    examples = sum(max(e.examples for c, _, e in ledger.rows() if c == corpus) for corpus in ledger.corpora())
    assert assert_fast_path_matches_scan(spec, state.step) == examples


def test_row_lookup_of_a_pii_row_names_exactly_the_adapter_tensors_of_the_run_where_it_was_routed_to_the_adapter_and_no_base_tensor(  # noqa: E501
    golden_run: GoldenRun,
) -> None:
    state = final_state(golden_run)
    spec = ScheduleSpec.from_json(state.schedule)
    scanned = scan(spec, state.step)
    positions = corpus_rows(golden_run, "pii")
    reached_rows = sorted(row for row, position in positions.items() if ("pii", position) in scanned)
    assert reached_rows and len(reached_rows) < len(positions)  # 30 steps: less than an epoch
    unreached = next(row for row, position in positions.items() if ("pii", position) not in scanned)
    model_spec = run_spec(golden_run)
    trial = load_trial_class(model_spec.trial)(model_spec.hparams)
    model = trial.build_model()
    routing = resolve_routes(model_spec.policy, model, trial.layers(model))
    base = {name for name, _ in model.named_parameters()}
    recorded = checkpoints(golden_run.store, golden_run.outcome.trial_id)

    for row in [*reached_rows[:: max(1, len(reached_rows) // 8)], unreached]:
        found = trial_of(row_reach(golden_run.store, WRITERS, row).trials, golden_run.outcome.trial_id)
        assert found.placement is not None and found.placement.split == "train"
        assert (found.placement.route, found.placement.position) == ("pii", positions[row])
        expected, _ = scanned.get(("pii", positions[row]), ([], []))
        assert found.steps == expected and found.step_count == len(expected)
        assert found.trained_steps == 30 and found.reverted_steps == []
        if not expected:
            assert found.tensors == [] and found.checkpoints == [] and "after the 30 steps" in found.note
            continue
        assert set(found.tensors) == set(routing.updated_tensors("pii"))
        assert found.tensors and all(t.startswith("adapter/pii-lora/hidden.") for t in found.tensors)
        assert not set(found.tensors) & base
        assert found.layers == ["adapter:pii-lora"]
        assert [c.step for c in found.checkpoints] == [c.step for c in recorded if c.step > expected[0]]


def test_a_holdout_row_reaches_no_training_step(golden_run: GoldenRun) -> None:
    held = ShardSet.open(golden_run.shard_root).holdout_table(WRITERS, ["_row"])
    row = held.column("_row")[0].as_py()
    found = trial_of(row_reach(golden_run.store, WRITERS, row).trials, golden_run.outcome.trial_id)
    assert found.placement is not None and found.placement.split == "holdout"
    assert (found.steps, found.step_count, found.reverted_steps) == ([], 0, [])
    assert (found.checkpoints, found.tensors) == ([], [])
    assert "holdout" in found.note and not found.reached


def test_the_run_without_writers_lists_no_step_for_a_pii_row_the_golden_run_trained_on(
    golden_run: GoldenRun, golden_run_without_writers: GoldenRun
) -> None:
    state = final_state(golden_run)
    scanned = scan(ScheduleSpec.from_json(state.schedule), state.step)
    positions = corpus_rows(golden_run, "pii")
    row = min(row for row, position in positions.items() if ("pii", position) in scanned)
    trials = row_reach(golden_run.store, WRITERS, row).trials
    assert trial_of(trials, golden_run.outcome.trial_id).step_count > 0
    without = trial_of(trials, golden_run_without_writers.outcome.trial_id)
    assert without.placement == trial_of(trials, golden_run.outcome.trial_id).placement
    assert (without.steps, without.step_count, without.checkpoints, without.tensors) == ([], 0, [], [])
    assert without.trained_steps == 30 and "excluded" in without.note


def test_the_cli_answers_in_json_and_as_a_table(
    golden_run: GoldenRun, capsys: pytest.CaptureFixture[str]
) -> None:
    url = golden_run.config.database_url
    positions = corpus_rows(golden_run, "pii")
    row = min(positions)
    assert main(["lineage", "row", WRITERS, str(row), "--database", url, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document == row_reach(golden_run.store, WRITERS, row).model_dump(mode="json")
    assert main(["lineage", "row", WRITERS, str(row), "--database", url]) == 0
    assert f"row {row} of corpus '{WRITERS}' reached" in capsys.readouterr().out


def test_an_unknown_corpus_or_a_row_out_of_range_is_refused_with_exit_code_18(
    golden_run: GoldenRun, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(LineageError, match=r"ingested corpus 'no-such-corpus' \(corpora: digits-licensed"):
        row_reach(golden_run.store, "no-such-corpus", 0)
    experiment = golden_run.store.get_trial(golden_run.outcome.trial_id).experiment_id
    (record,) = [c for c in golden_run.store.list_corpora(experiment) if c.corpus_id == WRITERS]
    last = record.rows - 1
    with pytest.raises(
        LineageError, match=rf"'{WRITERS}' has {record.rows} rows \(0..{last}\); there is no row {last + 1}"
    ):
        row_reach(golden_run.store, WRITERS, record.rows)
    url = golden_run.config.database_url
    assert main(["lineage", "row", "no-such-corpus", "0", "--database", url]) == 18
    assert "LineageError" in capsys.readouterr().err
    assert main(["lineage", "row", "--database", url, WRITERS, "--", "-1"]) == 18
    assert f"corpus '{WRITERS}': row '-1': expected a number from 0 to" in capsys.readouterr().err
    assert main(["lineage", "row", "--database", url, WRITERS, str(record.rows)]) == 18
    assert f"there is no row {record.rows}" in capsys.readouterr().err


def test_a_tampered_checkpoint_state_is_refused_not_answered_from(
    golden_run: GoldenRun, capsys: pytest.CaptureFixture[str]
) -> None:
    """Row lookup reads the schedule from the trial's latest checkpoint: a state.json changed since
    (an erased gate, or only a space) no longer matches the manifest the store recorded, and the
    answer is refused."""
    state = Path(checkpoints(golden_run.store, golden_run.outcome.trial_id)[-1].path) / STATE_FILE
    original = state.read_bytes()
    try:
        state.write_bytes(original.replace(b'"step"', b'"step" ', 1))  # same state, other bytes
        with pytest.raises(CheckpointError, match=r"state.json: sha256 does not match its manifest"):
            row_reach(golden_run.store, WRITERS, 0)
        url = golden_run.config.database_url
        assert main(["lineage", "row", WRITERS, "0", "--database", url]) == CheckpointError.exit_code
        assert "tampered" in capsys.readouterr().err
    finally:
        state.write_bytes(original)
    assert row_reach(golden_run.store, WRITERS, 0).trials
