"""A packed text run (``data.packing``): slots read windows of one route, each route group's summed
gradient is divided by its tokens from the schedule, and the ledger counts exactly the rows and
tokens of the windows it trained on."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from govray.data.packed import PackedStore
from govray.data.slots import slot
from govray.data.step_rows import step_rows
from govray.platform.run.runner import run_trial
from govray.provenance.row_reach import row_reach
from govray.train.checkpoints.files import find_checkpoints
from govray.train.context import WorkerContext
from govray.train.parallel.worker import Worker
from govray.train.runspec import RunSpec
from govray.train.step.governed import GovernedStep
from govray.train.step.ledger import recompute_ledger
from govray.train.trial import make_trial
from jobs.examples.digits.golden import opened
from tests.helpers.builders import governed_step, text_experiment
from tests.helpers.golden import GoldenRun
from tests.helpers.routing import routes_updating

SEQ_LEN = 128  # the text model's context
STEPS = 12


@pytest.fixture(scope="module")
def packed_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> GoldenRun:
    root = tmp_path_factory.mktemp("packed-run")
    raw = text_experiment(root)
    raw["data"]["packing"] = {"seq_len": SEQ_LEN}
    raw["searcher"]["max_length"] = {"batches": STEPS}
    raw["hyperparameters"]["d_model"] = 32
    raw["min_validation_period"] = STEPS
    (root / "experiment.yaml").write_text(yaml.safe_dump(raw))
    config, store, checked, experiment, ingested = opened(root / "experiment.yaml")
    outcome = run_trial(config, checked, experiment, ingested.root, store, report_every=STEPS)
    return GoldenRun(config, checked, ingested.root, store, outcome)


def last_spec(run: GoldenRun) -> RunSpec:
    return RunSpec.model_validate_json((find_checkpoints(run.outcome.run_dir)[-1] / "run.json").read_text())


def test_a_packed_run_counts_exactly_the_rows_and_tokens_of_the_windows_it_trained(
    packed_run: GoldenRun,
) -> None:
    spec = last_spec(packed_run)
    store = PackedStore.open(Path(spec.packed_root), verify=True)
    governed = governed_step(spec, Worker(0, 1))
    schedule = governed.schedule
    assert [layout.rows for layout in schedule.routes] == [layout.rows for layout in store.layouts()]
    expected: dict[tuple[str, str], list[int]] = {}  # (corpus, route) → [rows starting, tokens]
    for step in range(STEPS):
        mine = slot(schedule, step, 0)
        assert mine.route is not None
        windows = store.take(mine.route, np.asarray(mine.rows))
        assert set(windows.column("_route").to_pylist()) == {mine.route}  # one route per slot
        for corpus, rows, tokens in zip(
            *(windows.column(c).to_pylist() for c in ("_corpus", "_rows", "tokens")), strict=True
        ):
            counted = expected.setdefault((corpus, mine.route), [0, 0])
            counted[0] += rows
            counted[1] += tokens
    ledger = packed_run.outcome.ledger
    assert ledger == recompute_ledger(schedule, governed.routing, STEPS, store)
    for (corpus, tensor), entry in ledger.entries.items():
        routes = {
            route for c, route in expected if c == corpus and route in routes_updating(governed, tensor)
        }
        assert [entry.examples, entry.tokens] == [sum(expected[corpus, r][i] for r in routes) for i in (0, 1)]
    assert sum(tokens for _, tokens in expected.values()) > sum(rows for rows, _ in expected.values()) > 0


def test_each_route_groups_gradient_is_divided_by_its_tokens_from_the_schedule(packed_run: GoldenRun) -> None:
    spec = last_spec(packed_run)
    assert spec.settings is not None
    settings = spec.settings.model_copy(update={"max_grad_norm": None}).with_hyperparameters(
        {"optimizer": "sgd", "lr": 0.5, "momentum": 0.0, "weight_decay": 0.0}
    )
    trial = make_trial(spec.trial, spec.hparams, settings)
    governed = GovernedStep(WorkerContext.of(spec, Worker(0, 1)), trial)
    store = governed.packed
    assert store is not None
    step = next(
        s for s in range(STEPS) if slot(governed.schedule, s, 0).route not in governed.routing.adapter_names
    )
    for earlier in range(step):
        governed.step(earlier)
    mine = slot(governed.schedule, step, 0)
    assert mine.route is not None
    tokens = int(store.tokens(mine.route, np.asarray(mine.rows)).sum())
    assert governed._divisors(step_rows(governed.schedule, step)) == {mine.route: tokens}
    # By hand: the slot's summed per-token losses over its tokens, one plain SGD step.
    model = copy.deepcopy(governed.model)
    batch = trial.collate(store.take(mine.route, np.asarray(mine.rows), pad_id=trial.pad_id))
    torch.manual_seed(0)
    (trial.loss(model, batch).sum() / tokens).backward()
    governed.step(step)
    allowed = set(governed.routing.allowed(mine.route))
    updated = dict(governed.model.base_named_parameters())
    for name, parameter in model.base_named_parameters():
        if name in allowed:
            assert parameter.grad is not None
            expected = parameter.detach() - 0.5 * parameter.grad
            torch.testing.assert_close(updated[name].detach(), expected, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(updated[name].detach(), parameter.detach()), name
    assert allowed <= set(updated)


def test_an_erasure_lookup_in_a_packed_run_finds_the_steps_of_the_windows_holding_the_row(
    packed_run: GoldenRun,
) -> None:
    spec = last_spec(packed_run)
    store = PackedStore.open(Path(spec.packed_root))
    schedule = governed_step(spec, Worker(0, 1)).schedule
    first = slot(schedule, 0, 0)
    assert first.route is not None
    window = store.take(first.route, np.asarray(first.rows[:1]))
    corpus, row = window.column("_corpus")[0].as_py(), window.column("_row")[0].as_py()
    held = store.locate(corpus, row)
    expected = sorted(
        {
            s
            for s in range(STEPS)
            for route, position in held
            if slot(schedule, s, 0).route == route and position in slot(schedule, s, 0).rows
        }
    )
    assert 0 in expected
    (reach,) = row_reach(packed_run.store, corpus, row).trials
    assert reach.placement is not None and reach.placement.windows == [position for _, position in held]
    assert reach.steps == expected and reach.step_count == len(expected)
