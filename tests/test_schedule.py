"""The schedule is a pure function: one epoch reads every training row exactly once, no row is
dropped, and excluding a corpus empties its rows while every other slot stays bit-for-bit the same."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from govray.core.canonical import canonical_json, sha256_hex
from govray.data.schedule import RouteLayout, ScheduleError, ScheduleEvent, ScheduleSpec
from govray.data.shards import CorpusSummary, RouteSummary, ShardManifest
from govray.data.slots import EMPTY, Slot, rank_slots, route_counts, slot, step_slots

REPO = Path(__file__).resolve().parents[1]

ROUTES = (
    RouteLayout("public", (("wiki", 9), ("news", 4))),
    RouteLayout("licensed", (("books", 6),)),
    RouteLayout("empty", ()),
    RouteLayout("pii", (("chats", 3), ("mail", 2))),
)


SPEC = ScheduleSpec(seed=11, world_size=3, batch_size=4, routes=ROUTES)


def spec_of(**changes: Any) -> ScheduleSpec:
    """SPEC with some inputs changed (validated again)."""
    return replace(SPEC, **changes)


def epoch_slots(spec: ScheduleSpec, epoch: int) -> list[tuple[Slot, ...]]:
    start = epoch * spec.steps_per_epoch
    return [step_slots(spec, step) for step in range(start, start + spec.steps_per_epoch)]


def epoch_digest(spec: ScheduleSpec, epoch: int) -> str:
    slots = [[[s.route, list(s.rows), list(s.corpora)] for s in step] for step in epoch_slots(spec, epoch)]
    return sha256_hex(canonical_json(slots))


def reads(slots: list[tuple[Slot, ...]]) -> Counter[tuple[str | None, int]]:
    return Counter((s.route, row) for step in slots for s in step for row in s.rows)


# A route: up to 3 corpora with 0..25 rows each (a route with no rows is allowed).
route_counts_strategy = st.lists(st.integers(min_value=0, max_value=25), min_size=0, max_size=3)
specs = st.builds(
    lambda counts, world, batch, seed: ScheduleSpec(
        seed=seed,
        world_size=world,
        batch_size=batch,
        routes=tuple(
            RouteLayout(f"r{i}", tuple((f"c{i}-{j}", n) for j, n in enumerate(route)))
            for i, route in enumerate(counts)
        ),
    ),
    st.lists(route_counts_strategy, min_size=1, max_size=4).filter(lambda c: sum(map(sum, c)) > 0),
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=1, max_value=7),
    st.integers(min_value=0, max_value=2**40),
)


def test_same_inputs_give_identical_slots() -> None:
    first, second = spec_of(), spec_of()
    assert first == second and first.digest() == second.digest()
    for step in range(3 * first.steps_per_epoch):
        assert step_slots(first, step) == step_slots(second, step)
    assert epoch_digest(spec_of(seed=12), 0) != epoch_digest(first, 0)


def test_a_fresh_process_recomputes_the_same_epoch() -> None:
    spec = spec_of()
    code = (
        "import json, sys\n"
        "from govray.data.schedule import ScheduleSpec\n"
        "from tests.test_schedule import epoch_digest\n"
        "spec = ScheduleSpec.from_json(json.loads(sys.argv[1]))\n"
        "print(spec.digest(), epoch_digest(spec, 0), epoch_digest(spec, 5))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, canonical_json(spec.to_json()).decode()],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == [spec.digest(), epoch_digest(spec, 0), epoch_digest(spec, 5)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs)
def test_one_epoch_reads_every_training_row_exactly_once(spec: ScheduleSpec) -> None:
    slots = epoch_slots(spec, 0)
    expected = Counter((route.route, row) for route in spec.routes for row in range(route.rows))
    assert reads(slots) == expected  # every row once: none dropped, none repeated
    batches = sum(math.ceil(route.rows / spec.batch_size) for route in spec.routes)
    assert spec.steps_per_epoch == math.ceil(batches / spec.world_size)
    flat = [s for step in slots for s in step]
    assert len(flat) == spec.steps_per_epoch * spec.world_size
    # The first B slots in (step, rank) order hold the B batches; only the tail is empty.
    assert all(not s.empty for s in flat[:batches]) and all(s.route is None for s in flat[batches:])
    for s in flat[:batches]:
        assert s.route is not None
        route = spec.route(s.route)
        assert 1 <= len(s.rows) <= spec.batch_size
        assert s.corpora == tuple(route.corpus_of(row) for row in s.rows)
    for step in slots:
        per_route = Counter[str]()
        for s in step:
            if s.route is not None:
                per_route[s.route] += len(s.rows)
        assert route_counts(step) == dict(per_route)


def test_epochs_differ_but_each_is_complete() -> None:
    spec = spec_of()
    orders, batches = [], []
    for epoch in range(3):
        slots = epoch_slots(spec, epoch)
        assert reads(slots) == Counter((r.route, i) for r in spec.routes for i in range(r.rows))
        orders.append([(s.route, s.rows) for step in slots for s in step])
        batches.append({frozenset(s.rows) for step in slots for s in step if s.route == "public"})
    assert orders[0] != orders[1] != orders[2] != orders[0]
    # Each epoch permutes the rows themselves, not only the order of fixed batches.
    assert batches[0] != batches[1] != batches[2] != batches[0]
    # 13 + 6 + 0 + 5 rows in batches of 4: 4 + 2 + 0 + 2 = 8 batches over 3 workers → 3 steps.
    assert spec.batches_per_epoch == 8 and spec.steps_per_epoch == 3
    assert [spec.locate(step) for step in range(7)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
        (2, 0),
    ]
    assert slot(spec, 5, 2) == Slot(route=None, rows=(), corpora=())  # batch 8 of 8: none left
    assert slot(spec, 7, 0) == slot(spec, 7, 0) and slot(spec, 7, 0) != slot(spec, 1, 0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs, st.data())
def test_excluding_a_corpus_empties_exactly_its_rows(spec: ScheduleSpec, data: st.DataObject) -> None:
    corpora = sorted({c for route in spec.routes for c, _ in route.corpus_counts})
    excluded = data.draw(st.sampled_from(corpora))
    counterfactual = replace(spec, excluded_corpora=frozenset({excluded}))
    assert counterfactual.steps_per_epoch == spec.steps_per_epoch
    for step in range(2 * spec.steps_per_epoch):
        for base, without in zip(step_slots(spec, step), step_slots(counterfactual, step), strict=True):
            if excluded not in base.corpora:
                assert without == base
            else:
                kept = [(r, c) for r, c in zip(base.rows, base.corpora, strict=True) if c != excluded]
                assert without == Slot(base.route, tuple(r for r, _ in kept), tuple(c for _, c in kept))


def test_a_gate_at_step_k_affects_only_steps_from_k_on() -> None:
    base = spec_of()
    # A step after the first at which wiki is read, so applying the gate one step late shows.
    gate_step = next(step for step in range(1, 9) if any("wiki" in s.corpora for s in step_slots(base, step)))
    gated = spec_of(events=(ScheduleEvent(step=gate_step, kind="gate", corpus_id="wiki"),))
    excluded = spec_of(excluded_corpora=frozenset({"wiki"}))
    for step in range(3 * base.steps_per_epoch):
        expected = step_slots(base, step) if step < gate_step else step_slots(excluded, step)
        assert step_slots(gated, step) == expected
    # The gate really removes rows: wiki is read before the gate, never from it on.
    assert any("wiki" in s.corpora for step in range(gate_step) for s in step_slots(gated, step))
    assert all("wiki" not in s.corpora for step in range(gate_step, 9) for s in step_slots(gated, step))


def test_a_fully_gated_slot_keeps_its_route_but_is_empty() -> None:
    spec = spec_of(excluded_corpora=frozenset({"books"}))
    licensed = [s for step in epoch_slots(spec, 0) for s in step if s.route == "licensed"]
    assert len(licensed) == 2 and all(s.empty and s.rows == () and s.corpora == () for s in licensed)
    assert all("licensed" not in route_counts(step) for step in epoch_slots(spec, 0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=6), max_size=5))
def test_corpus_of_matches_a_brute_force_expansion(counts: list[int]) -> None:
    route = RouteLayout("r", tuple((f"c{i}", n) for i, n in enumerate(counts)))
    expansion = [f"c{i}" for i, n in enumerate(counts) for _ in range(n)]
    assert route.rows == len(expansion)
    assert [route.corpus_of(index) for index in range(route.rows)] == expansion
    assert list(route.corpora_of(np.arange(route.rows))) == expansion
    for outside in (-1, route.rows):
        with pytest.raises(ScheduleError, match=f"route 'r' has {route.rows} rows; no row {outside}"):
            route.corpus_of(outside)


def manifest() -> ShardManifest:
    def corpus(corpus_id: str, train: int, routes: dict[str, int]) -> CorpusSummary:
        return CorpusSummary(
            corpus_id=corpus_id,
            role="train",
            format="csv",
            fingerprint="0" * 64,
            files=["part.csv"],
            rows=train + 1,
            train_rows=train,
            holdout_rows=1,
            route_counts=routes,
            credential={},
            credential_columns={},
        )

    return ShardManifest(
        key="k",
        policy_name="p",
        policy_version=1,
        policy_digest="0" * 64,
        holdout_fraction=0.1,
        row_hash_version=2,
        # Shard order is the corpora's order here, not alphabetical.
        corpora=[corpus("zeta", 5, {"public": 3, "pii": 2}), corpus("alpha", 4, {"public": 4})],
        routes=[
            RouteSummary(route="public", rows=7, corpus_counts={"alpha": 4, "zeta": 3}, files=[]),
            RouteSummary(route="licensed", rows=0, corpus_counts={}, files=[]),
            RouteSummary(route="pii", rows=2, corpus_counts={"zeta": 2}, files=[]),
        ],
    )


def test_spec_from_manifest_follows_shard_order() -> None:
    # A manifest read back from JSON has its dict keys sorted; the corpus list keeps shard order.
    reread = ShardManifest.model_validate_json(manifest().to_json())
    spec = ScheduleSpec.from_manifest(
        reread, seed=3, world_size=2, batch_size=2, excluded_corpora=["alpha"], events=()
    )
    assert spec.routes == (
        RouteLayout("public", (("zeta", 3), ("alpha", 4))),
        RouteLayout("licensed", ()),
        RouteLayout("pii", (("zeta", 2),)),
    )
    assert spec.route("public").corpus_of(2) == "zeta" and spec.route("public").corpus_of(3) == "alpha"
    assert spec.excluded_corpora == frozenset({"alpha"})
    assert spec.batches_per_epoch == 5 and spec.steps_per_epoch == 3


def test_spec_round_trips_through_json_and_digests_its_inputs() -> None:
    events = (
        ScheduleEvent(step=9, kind="gate", corpus_id="mail"),
        ScheduleEvent(step=2, kind="gate", corpus_id="news"),
    )
    spec = spec_of(events=events, excluded_corpora=frozenset({"books"}))
    assert ScheduleSpec.from_json(spec.to_json()) == spec
    assert ScheduleSpec.from_json(spec.to_json()).digest() == spec.digest()
    assert spec_of(events=events[::-1], excluded_corpora=frozenset({"books"})).digest() == spec.digest()
    digests = {
        spec.digest(),
        spec_of().digest(),
        spec_of(world_size=2).digest(),
        spec_of(batch_size=5).digest(),
        spec_of(excluded_corpora=frozenset({"books"})).digest(),
    }
    assert len(digests) == 5
    with pytest.raises(ScheduleError, match=r"schedule version 3 is not the one this govray computes \(2\)"):
        ScheduleSpec.from_json({**spec.to_json(), "version": 3})


def test_route_counts_sum_the_examples_of_each_route() -> None:
    slots = (
        Slot("public", (1, 2, 3), ("wiki",) * 3),
        Slot("pii", (0,), ("chats",)),
        Slot("public", (7,), ("news",)),
        Slot("licensed", (), ()),
        Slot(None, (), ()),
    )
    assert route_counts(slots) == {"public": 4, "pii": 1}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"world_size": 0}, "world size must be at least 1, not 0"),
        ({"batch_size": 0}, "batch size must be at least 1, not 0"),
        (
            {"routes": (RouteLayout("a", ()), RouteLayout("b", (("x", 0),)))},
            r"no training rows in any route \(a, b\)",
        ),
        (
            {"routes": (RouteLayout("a", (("x", 1),)), RouteLayout("a", (("y", 1),)))},
            "routes repeat a name: a, a",
        ),
        ({"excluded_corpora": frozenset({"nope"})}, "excluded corpus 'nope' has no training rows"),
        (
            {"events": (ScheduleEvent(step=3, kind="gate", corpus_id="nope"),)},
            "gate at step 3 names corpus 'nope', which has no training rows",
        ),
        (
            {"events": (ScheduleEvent(step=-1, kind="gate", corpus_id="wiki"),)},
            "gate of corpus 'wiki' at negative step -1",
        ),
    ],
)
def test_inconsistent_inputs_are_refused_naming_the_problem(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        spec_of(**changes)


def test_a_rank_or_step_outside_the_schedule_is_refused() -> None:
    spec = spec_of()
    with pytest.raises(ScheduleError, match="slot 3 is outside the 3 slots of a step"):
        slot(spec, 0, 3)
    with pytest.raises(ScheduleError, match="rank 2 is outside the world of 2 workers"):
        rank_slots(spec, 0, 2, 2)
    with pytest.raises(ScheduleError, match="global step must be non-negative, not -1"):
        slot(spec, -1, 0)
    with pytest.raises(ScheduleError, match="route 'r' lists a corpus twice"):
        RouteLayout("r", (("x", 1), ("x", 2)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_any_world_size_runs_every_slot_of_a_step_exactly_once(world: int) -> None:
    """S = 3 slots per step on W workers: every rank runs ceil(S / W) rounds, together every slot
    exactly once (the rest empty stand-ins); with W = S slot r is rank r's, as before."""
    spec = spec_of()
    for step in range(spec.steps_per_epoch + 1):
        runs = [rank_slots(spec, step, rank, world) for rank in range(world)]
        assert {len(rounds) for rounds in runs} == {-(-spec.world_size // world)}
        indices = sorted(index for rounds in runs for index, _ in rounds if index < spec.world_size)
        assert indices == list(range(spec.world_size))
        for rounds in runs:
            for index, held in rounds:
                assert held == (slot(spec, step, index) if index < spec.world_size else EMPTY)
        if world == spec.world_size:
            assert runs == [[(rank, slot(spec, step, rank))] for rank in range(world)]


def test_rollback_events_round_trip_change_no_slot_and_leave_gate_documents_as_they_were() -> None:
    gate = ScheduleEvent(step=4, kind="gate", corpus_id="wiki")
    rollback = ScheduleEvent(step=6, kind="rollback", to_step=2)
    spec = spec_of(events=(gate, rollback))
    assert ScheduleSpec.from_json(spec.to_json()) == spec
    # A gate's JSON is what it was before rollbacks existed, so recorded digests still match.
    assert gate.to_json() == {"step": 4, "kind": "gate", "corpus_id": "wiki"}
    assert rollback.to_json() == {"step": 6, "kind": "rollback", "corpus_id": "", "to_step": 2}
    gated = spec_of(events=(gate,))
    assert gated.digest() != spec.digest()
    assert [step_slots(spec, step) for step in range(9)] == [step_slots(gated, step) for step in range(9)]
    assert [spec.reverted(step) for step in range(8)] == [False, False, True, True, True, True, False, False]


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (ScheduleEvent(step=3, kind="rollback", to_step=3), "must go back to an earlier step"),
        (ScheduleEvent(step=3, kind="rollback"), "must go back to an earlier step"),
        (ScheduleEvent(step=3, kind="rollback", to_step=1, corpus_id="wiki"), "name no corpus"),
        (ScheduleEvent(step=3, kind="gate", corpus_id="wiki", to_step=1), "has a to_step"),
    ],
)
def test_malformed_rollback_events_are_refused(event: ScheduleEvent, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        spec_of(events=(event,))
