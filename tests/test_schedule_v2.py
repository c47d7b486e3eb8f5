"""The schedule's keyed bijections (version 2, the one version). Each permutation is a true
permutation with an exact inverse, every row is read once per epoch, a row's steps are found
through the inverses, a step of a billion-row route costs milliseconds and no memory, and a
schedule of any other version is refused."""

from __future__ import annotations

import time
import tracemalloc
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from govray.data.permutation import MAX_DOMAIN, KeyedPermutation
from govray.data.schedule import SCHEDULE_VERSION, RouteLayout, ScheduleError, ScheduleEvent, ScheduleSpec
from govray.data.slots import Slot, row_slots, slot
from govray.data.step_rows import step_rows

SPECIAL_SIZES = sorted(
    {1, 2, 3, 5, 7, 11, 13, 97, 101, 65_521, 99_991}
    | {n + d for n in (4, 8, 16, 64, 256, 1024, 4096, 65_536) for d in (-1, 0, 1)}
)
sizes = st.one_of(st.sampled_from(SPECIAL_SIZES), st.integers(min_value=1, max_value=100_000))
keys = st.integers(min_value=0, max_value=2**64 - 1)
HUGE_SIZES = [2**31 - 1, 2**31, 2**32 + 5, 2**61 + 3, MAX_DOMAIN]


@settings(max_examples=120, deadline=None)
@given(keys, sizes)
def test_the_keyed_bijection_is_a_permutation_of_0_to_n_with_an_exact_inverse(key: int, n: int) -> None:
    order = KeyedPermutation(key, n)
    everything = np.arange(n, dtype=np.int64)
    image = order.forward(everything)
    assert image.dtype == np.int64 and image.shape == (n,)
    assert np.array_equal(np.unique(image), everything)  # onto [0, n): hence one-to-one
    assert np.array_equal(order.inverse(image), everything)
    assert np.array_equal(order.forward(order.inverse(everything)), everything)


@pytest.mark.parametrize("n", [2**40 - 1, 2**40, 2**40 + 1, 10**18, MAX_DOMAIN - 1, MAX_DOMAIN])
def test_the_bijection_inverts_exactly_on_huge_domains(n: int) -> None:
    order = KeyedPermutation(12345, n)
    indexes = np.unique(np.random.default_rng(n % 1000).integers(0, n, 20_000, dtype=np.int64))
    image = order.forward(indexes)
    assert image.min() >= 0 and image.max() < n
    assert len(np.unique(image)) == len(indexes)
    assert np.array_equal(order.inverse(image), indexes)
    assert int(order.forward(np.array([n - 1]))[0]) < n


def test_different_keys_give_different_permutations_and_the_same_key_the_same() -> None:
    everything = np.arange(1000)
    orders = {tuple(KeyedPermutation(key, 1000).forward(everything).tolist()) for key in range(20)}
    assert len(orders) == 20
    again = KeyedPermutation(3, 1000).forward(everything)
    assert np.array_equal(again, KeyedPermutation(3, 1000).forward(everything))
    # A permutation is not close to the identity: few fixed points.
    assert np.count_nonzero(again == everything) < 10


def test_indexes_outside_the_domain_and_empty_domains_are_refused() -> None:
    with pytest.raises(Exception, match=r"index outside \[0, 10\)"):
        KeyedPermutation(1, 10).forward(np.array([10]))
    with pytest.raises(Exception, match="needs 1 <= n <= 2\\*\\*62, not 0"):
        KeyedPermutation(1, 0)
    assert KeyedPermutation(1, 1).forward(np.array([0])).tolist() == [0]


# --- the compiled kernel (govray/data/_feistel.c) -------------------------------------------------


def test_the_compiled_feistel_kernel_is_built() -> None:
    """The install compiles ``govray/data/_feistel.c`` (pyproject's ext-modules, optional): on a
    machine with a C compiler it must be there, else every step's schedule costs ~3x more."""
    from govray.data import permutation

    assert permutation._feistel is not None


@settings(max_examples=200, deadline=None)
@given(keys, st.one_of(sizes, st.sampled_from(HUGE_SIZES)), st.data())
def test_the_kernel_gives_numpys_images_and_preimages_value_for_value(
    key: int, n: int, data: st.DataObject
) -> None:
    """numpy's rounds are the definition; the kernel walks each cycle in C. Indexes of any shape
    (2-D, a strided view) and domains up to 2**62, forward and inverse."""
    order = KeyedPermutation(key, n)
    seed = data.draw(st.integers(0, 2**32 - 1))
    indexes = np.random.default_rng(seed).integers(0, n, size=(2, 301), dtype=np.int64)[:, ::3]
    for inverse in (False, True):
        compiled = order._walk(indexes, inverse=inverse)
        assert compiled.shape == indexes.shape and compiled.dtype == np.int64
        assert np.array_equal(compiled, order._walk(indexes, inverse=inverse, compiled=False))


def test_the_kernel_refuses_what_its_caller_would_never_give_it() -> None:
    from govray.data import _feistel

    values, out = np.array([0, 9, 10]), np.empty(3, dtype=np.int64)
    round_keys = (1, 2, 3, 4, 5, 6)
    with pytest.raises(ValueError, match=r"value 2 lies outside \[0, 10\)"):
        _feistel.walk(values, out, round_keys, 2, 10, False)
    with pytest.raises(ValueError, match="6 round keys"):
        _feistel.walk(values, out, round_keys[:5], 2, 10, False)
    with pytest.raises(ValueError, match="half must be"):
        _feistel.walk(values, out, round_keys, 1, 10, False)  # 2 bits cannot hold 10 values
    with pytest.raises(ValueError, match="one length"):
        _feistel.walk(values, out[:2], round_keys, 2, 10, False)


# --- the schedule on version 2 --------------------------------------------------------------------

ROUTES = (
    RouteLayout("a", (("x", 4), ("y", 3))),
    RouteLayout("b", (("z", 5),)),
    RouteLayout("e", ()),
)


def test_schedule_version_2_is_pinned() -> None:
    """Runs record version 2 from now on: these values are its definition; a change breaks
    every recorded run's resume, replay and verification."""
    assert KeyedPermutation(5, 10).forward(np.arange(10)).tolist() == [4, 3, 0, 8, 1, 2, 6, 9, 7, 5]
    spec = ScheduleSpec(seed=1, world_size=2, batch_size=3, routes=ROUTES)
    assert spec.version == SCHEDULE_VERSION == 2
    slots = [[(s.route, s.rows) for s in (slot(spec, step, 0), slot(spec, step, 1))] for step in range(3)]
    assert slots == [
        [("a", (2,)), ("b", (1, 3, 4))],
        [("b", (2, 0)), ("a", (6, 0, 3))],
        [("a", (1, 4, 5)), (None, ())],
    ]


def spec_strategy() -> st.SearchStrategy[ScheduleSpec]:
    routes = st.lists(st.lists(st.integers(0, 20), max_size=3), min_size=1, max_size=4)
    return st.builds(
        lambda counts, world, batch, seed: ScheduleSpec(
            seed=seed,
            world_size=world,
            batch_size=batch,
            routes=tuple(
                RouteLayout(f"r{i}", tuple((f"c{i}-{j}", n) for j, n in enumerate(route)))
                for i, route in enumerate(counts)
            ),
        ),
        routes.filter(lambda c: sum(map(sum, c)) > 0),
        st.integers(1, 8),
        st.integers(1, 9),
        st.integers(0, 2**40),
    )


def epoch_reads(spec: ScheduleSpec, epoch: int) -> Counter[tuple[str | None, int]]:
    first = epoch * spec.steps_per_epoch
    return Counter(
        (held.route, row)
        for step in range(first, first + spec.steps_per_epoch)
        for rank in range(spec.world_size)
        for held in [slot(spec, step, rank)]
        for row in held.rows
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_strategy(), st.integers(0, 10**6))
def test_a_version_2_epoch_reads_every_row_of_every_route_exactly_once(
    spec: ScheduleSpec, epoch: int
) -> None:
    expected = Counter((route.route, row) for route in spec.routes for row in range(route.rows))
    assert epoch_reads(spec, epoch) == expected


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_strategy(), st.data())
def test_step_rows_sum_exactly_the_slots_of_every_rank(spec: ScheduleSpec, data: st.DataObject) -> None:
    corpora = sorted({c for route in spec.routes for c, _ in route.corpus_counts})
    excluded = data.draw(st.sets(st.sampled_from(corpora), max_size=1))
    spec = replace(spec, excluded_corpora=frozenset(excluded))
    for step in range(2 * spec.steps_per_epoch):
        every = step_rows(spec, step)
        slots = [slot(spec, step, rank) for rank in range(spec.world_size)]
        for route in spec.routes:
            held = [row for s in slots if s.route == route.route for row in s.rows]
            assert every.rows.get(route.route, np.array([], dtype=np.int64)).tolist() == held
            names = [route.corpus_counts[i][0] for i in every.corpus.get(route.route, [])]
            assert names == [c for s in slots if s.route == route.route for c in s.corpora]


def scan(spec: ScheduleSpec, epochs: int) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """Brute force: (route, row) → every (global step, rank) whose slot holds it."""
    found: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for step in range(epochs * spec.steps_per_epoch):
        for rank in range(spec.world_size):
            held = slot(spec, step, rank)
            for row in held.rows:
                assert held.route is not None
                found.setdefault((held.route, row), []).append((step, rank))
    return found


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_strategy(), st.data())
def test_row_slots_are_exactly_what_a_scan_of_every_slot_finds(
    spec: ScheduleSpec, data: st.DataObject
) -> None:
    corpora = sorted({c for route in spec.routes for c, _ in route.corpus_counts})
    steps = 3 * spec.steps_per_epoch
    gates = data.draw(st.lists(st.tuples(st.sampled_from(corpora), st.integers(0, steps)), max_size=2))
    events = [ScheduleEvent(step=step, kind="gate", corpus_id=corpus) for corpus, step in gates]
    if steps > 1:
        events.append(ScheduleEvent(step=steps - 1, kind="rollback", to_step=steps // 2))
    excluded = data.draw(st.sets(st.sampled_from(corpora), max_size=1))
    spec = replace(spec, excluded_corpora=frozenset(excluded), events=tuple(events))
    expected = scan(spec, 3)
    for route in spec.routes:
        for row in range(route.rows):
            assert row_slots(spec, route.route, row, 3) == expected.get((route.route, row), [])


def test_excluding_a_corpus_on_version_2_leaves_every_other_slot_identical() -> None:
    spec = ScheduleSpec(seed=3, world_size=3, batch_size=2, routes=ROUTES)
    without = ScheduleSpec(
        seed=3, world_size=3, batch_size=2, routes=ROUTES, excluded_corpora=frozenset({"y"})
    )
    for step in range(4 * spec.steps_per_epoch):
        for rank in range(3):
            base, other = slot(spec, step, rank), slot(without, step, rank)
            kept = [(r, c) for r, c in zip(base.rows, base.corpora, strict=True) if c != "y"]
            assert other == Slot(base.route, tuple(r for r, _ in kept), tuple(c for _, c in kept))


def test_a_step_of_a_billion_row_route_at_epoch_a_million_costs_milliseconds_and_no_memory() -> None:
    big = RouteLayout("big", (("web", 10**9 - 5), ("forum", 5)))
    spec = ScheduleSpec(
        seed=7, world_size=8, batch_size=32, routes=(big, RouteLayout("small", (("c", 999),)))
    )
    global_step = 10**6 * spec.steps_per_epoch + 12_345
    slot(spec, global_step, 0)  # warm: numpy's first calls
    tracemalloc.start()
    started = time.perf_counter()
    slots = [slot(spec, global_step, rank) for rank in range(spec.world_size)]
    every = step_rows(spec, global_step)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2_000_000, peak  # ranking 10^9 outputs (the pre-release schedule) would take ≥ 16 GB
    assert elapsed < 1.0, elapsed  # ~10 ms on a busy 2-core machine
    assert sum(every.route_counts().values()) == sum(len(s.rows) for s in slots) == 8 * 32
    row = slots[3].rows[0]
    [(first_step, rank)] = [hit for hit in row_slots(spec, "big", row, 1)]
    assert row in slot(spec, first_step, rank).rows


# --- the one version ---------------------------------------------------------------------------

SPEC = ScheduleSpec(
    seed=11,
    world_size=3,
    batch_size=4,
    routes=(
        RouteLayout("public", (("wiki", 9), ("news", 4))),
        RouteLayout("licensed", (("books", 6),)),
        RouteLayout("empty", ()),
        RouteLayout("pii", (("chats", 3), ("mail", 2))),
    ),
    excluded_corpora=frozenset({"mail"}),
    events=(ScheduleEvent(step=5, kind="gate", corpus_id="news"),),
)


def test_the_version_is_recorded_read_back_and_any_other_refused_with_a_clear_message() -> None:
    assert SPEC.version == SCHEDULE_VERSION == 2
    assert SPEC.to_json()["version"] == 2
    assert ScheduleSpec.from_json(SPEC.to_json()) == SPEC
    for version in (1, 0, 3, "2", None):  # 1: the pre-release PCG64 schedule, never recomputed
        with pytest.raises(ScheduleError, match=f"schedule version {version!r} is not the one this govray"):
            ScheduleSpec.from_json({**SPEC.to_json(), "version": version})
    with pytest.raises(ScheduleError, match=r"schedule version 1 is not the one this govray computes \(2\)"):
        replace(SPEC, version=1)
