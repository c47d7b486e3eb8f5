"""The ledger counts, per corpus and tensor, exactly the training rows whose gradients reached that
tensor's updates, and a verifier recomputes it from the schedule and the routing table alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from govray.cli.ledger_table import format_ledger
from govray.data.schedule import RouteLayout, ScheduleEvent, ScheduleSpec
from govray.data.slots import step_slots
from govray.governance.routing import RoutingTable
from govray.train.step.ledger import Ledger, LedgerEntry, LedgerError, recompute_ledger
from tests.helpers.routing import TABLE, routing

BASE = ("l0.weight", "l0.bias", "l1.weight", "l1.bias", "l2.weight", "l2.bias")
ADAPTER = ("adapter/a/l1.lora_A", "adapter/a/l1.lora_B")


# wiki's rows fall under two routes (per-row credentials); "empty" has no rows.
SPEC = ScheduleSpec(
    seed=5,
    world_size=3,
    batch_size=4,
    routes=(
        RouteLayout("public", (("wiki", 9), ("news", 4))),
        RouteLayout("licensed", (("wiki", 2), ("books", 6))),
        RouteLayout("pii", (("chats", 3), ("mail", 2))),
    ),
)


def expected_examples(spec: ScheduleSpec, table: RoutingTable, epochs: int) -> dict[tuple[str, str], int]:
    """Independent statement: every training row of a route reaches every tensor it updates, once
    per epoch."""
    expected: Counter[tuple[str, str]] = Counter()
    for route in spec.routes:
        for corpus, rows in route.corpus_counts:
            if corpus in spec.excluded_corpora:
                continue
            for tensor in table.updated_tensors(route.route):
                expected[corpus, tensor] += rows * epochs
    return dict(expected)


def examples(ledger: Ledger) -> dict[tuple[str, str], int]:
    return {(corpus, tensor): entry.examples for corpus, tensor, entry in ledger.rows()}


@pytest.mark.parametrize(("world_size", "batch_size"), [(1, 1), (2, 3), (3, 4), (4, 7)])
def test_one_epoch_counts_every_training_row_for_exactly_the_tensors_its_route_updates(
    world_size: int, batch_size: int
) -> None:
    spec = replace(SPEC, world_size=world_size, batch_size=batch_size)
    ledger = recompute_ledger(spec, TABLE, steps=spec.steps_per_epoch)
    assert examples(ledger) == expected_examples(spec, TABLE, epochs=1)
    # Spelled out: wiki reaches l0 through 'public' only, l2 through both of its routes.
    assert ledger.entries["wiki", "l0.weight"].examples == 9
    assert ledger.entries["wiki", "l2.weight"].examples == 11
    assert ("books", "l0.weight") not in ledger.entries and ("books", "l2.bias") in ledger.entries
    assert {t for c, t in ledger.entries if c == "chats"} == set(ADAPTER)
    assert ledger.corpora() == ["books", "chats", "mail", "news", "wiki"]
    assert ledger.tensors() == sorted(BASE + ADAPTER)


def test_steps_count_once_per_step_and_stop_at_a_gate() -> None:
    # 4 public rows and 2 pii rows in batches of 2 over 3 workers: 3 batches, one step per epoch.
    # alpha's 3 rows are split over both public slots of a step; b is gated from step 1 on.
    spec = ScheduleSpec(
        seed=0,
        world_size=3,
        batch_size=2,
        routes=(RouteLayout("public", (("alpha", 3), ("b", 1))), RouteLayout("pii", (("c", 2),))),
        events=(ScheduleEvent(step=1, kind="gate", corpus_id="b"),),
    )
    assert spec.steps_per_epoch == 1
    assert sum(1 for s in step_slots(spec, 0) if "alpha" in s.corpora) == 2
    tokens = {"public": [10, 20, 30, 5], "pii": [7, 8]}
    ledger = recompute_ledger(spec, TABLE, steps=2, tokens=tokens)
    expected = {
        **{("alpha", t): LedgerEntry(examples=6, tokens=120, steps=2) for t in BASE},
        **{("b", t): LedgerEntry(examples=1, tokens=5, steps=1) for t in BASE},
        **{("c", t): LedgerEntry(examples=4, tokens=30, steps=2) for t in ADAPTER},
    }
    assert ledger.entries == expected


def test_recorded_ledger_resumed_from_json_equals_the_recomputed_one() -> None:
    spec = replace(SPEC, events=(ScheduleEvent(step=4, kind="gate", corpus_id="news"),))
    steps = 3 * spec.steps_per_epoch + 1
    recorded = Ledger()
    for step in range(steps):
        if step == 5:  # a checkpoint and a resume in the middle
            recorded = Ledger.from_json(recorded.to_json())
        recorded.record_step(step_slots(spec, step), TABLE)
    recomputed = recompute_ledger(spec, TABLE, steps)
    assert recorded == recomputed
    assert recomputed != recompute_ledger(spec, TABLE, steps - 1)

    # news is gated at step 4: nothing of it is counted after step 3.
    def news(ledger: Ledger) -> dict[tuple[str, str], LedgerEntry]:
        return {key: entry for key, entry in ledger.entries.items() if key[0] == "news"}

    assert news(recomputed) == news(recompute_ledger(spec, TABLE, 4)) != {}


def test_json_round_trip_is_exact_and_ordered() -> None:
    ledger = recompute_ledger(
        SPEC, TABLE, steps=5, tokens={"public": [3] * 13, "licensed": [2] * 8, "pii": [1] * 5}
    )
    document = ledger.to_json()
    assert Ledger.from_json(document) == ledger
    assert Ledger.from_json(document).to_json() == document
    keys = [(row["corpus"], row["tensor"]) for row in document["entries"]]
    assert keys == sorted(keys) and len(keys) == len(ledger.entries)
    reversed_insertion = Ledger(dict(reversed(list(ledger.entries.items()))))
    assert reversed_insertion.to_json() == document
    with pytest.raises(LedgerError, match=r"malformed ledger: entries\.0\.examples"):
        Ledger.from_json({"version": 1, "entries": [{**document["entries"][0], "examples": -1}]})
    with pytest.raises(LedgerError, match="lists corpus 'books' and tensor 'l2.bias' twice"):
        Ledger.from_json({"version": 1, "entries": [document["entries"][0]] * 2})


def test_merge_adds_entries_and_leaves_its_inputs_alone() -> None:
    total = recompute_ledger(SPEC, TABLE, steps=6)
    first = recompute_ledger(SPEC, TABLE, steps=2)
    second = Ledger()
    for step in range(2, 6):
        second.record_step(step_slots(SPEC, step), TABLE)
    before = first.to_json()
    assert first.merge(second) == total
    assert first.to_json() == before
    assert first.merge(Ledger()) == first
    doubled = total.merge(total)
    assert all(
        doubled.entries[key] == LedgerEntry(2 * e.examples, 2 * e.tokens, 2 * e.steps)
        for key, e in total.entries.items()
    )


def test_an_excluded_corpus_has_no_entries_and_others_are_unchanged() -> None:
    full = recompute_ledger(SPEC, TABLE, steps=2 * SPEC.steps_per_epoch)
    without = recompute_ledger(
        replace(SPEC, excluded_corpora=frozenset({"wiki"})), TABLE, steps=2 * SPEC.steps_per_epoch
    )
    assert "wiki" not in without.corpora()
    assert without.entries == {key: entry for key, entry in full.entries.items() if key[0] != "wiki"}


def test_token_counts_must_cover_the_routes_read() -> None:
    with pytest.raises(LedgerError, match="token counts name no route"):
        recompute_ledger(SPEC, TABLE, steps=SPEC.steps_per_epoch, tokens={"public": [1] * 13})
    with pytest.raises(LedgerError, match="token counts of route 'public' cover 2 rows"):
        recompute_ledger(
            SPEC,
            TABLE,
            steps=SPEC.steps_per_epoch,
            tokens={"public": [1, 1], "licensed": [1] * 8, "pii": [1] * 5},
        )


def test_format_shows_examples_per_corpus_and_layer() -> None:
    table = routing(public="all", biases={"params": ["*.bias"]}, pii={"adapter": "a"})
    spec = ScheduleSpec(
        seed=1,
        world_size=2,
        batch_size=3,
        routes=(
            RouteLayout("public", (("wiki", 12),)),
            RouteLayout("biases", (("news", 5),)),
            RouteLayout("pii", (("chats", 3),)),
        ),
    )
    ledger = recompute_ledger(spec, table, steps=spec.steps_per_epoch)
    assert format_ledger(ledger, table) == "\n".join(
        [
            "corpus  l0  l1  l2  adapter:a",
            "chats    -   -   -          3",
            "news    5*  5*  5*          -",
            "wiki    12  12  12          -",
        ]
    )


def test_discarded_steps_reach_nothing_and_two_rollbacks_compose() -> None:
    """A rollback after step 6 to the clean state of step 2, and one after step 9 to step 7: the
    ledger is the one of steps 0-1, 6 and 9-11 trained in sequence, step by step."""
    events = (
        ScheduleEvent(step=6, kind="rollback", to_step=2),
        ScheduleEvent(step=9, kind="rollback", to_step=7),
    )
    spec = replace(SPEC, events=events)
    kept = [0, 1, 6, 9, 10, 11]
    assert [step for step in range(12) if not spec.reverted(step)] == kept
    expected = Ledger()
    for step in kept:
        expected.record_step(step_slots(SPEC, step), TABLE)  # the slots themselves are unchanged
    assert recompute_ledger(spec, TABLE, steps=12) == expected
    assert recompute_ledger(spec, TABLE, steps=12) != recompute_ledger(SPEC, TABLE, steps=12)


def test_a_ledger_extended_under_an_agreeing_schedule_is_the_one_recomputed_from_step_0() -> None:
    """The signer keeps the ledger of the last steps it checked and recomputes only the later ones
    when the new schedule agrees on the earlier steps (``ScheduleSpec.agrees_before``). Extended
    that way, the ledger is the one recomputed from step 0; where the schedules disagree on an
    earlier step — a rollback reaching back before it, a gate before it, other inputs — the
    extended ledger would be wrong, and ``agrees_before`` says so."""
    gated = replace(SPEC, events=(ScheduleEvent(step=7, kind="gate", corpus_id="news"),))
    rolled = replace(gated, events=(*gated.events, ScheduleEvent(step=11, kind="rollback", to_step=9)))

    def extended(old: ScheduleSpec, before: int, new: ScheduleSpec, steps: int) -> Ledger:
        return recompute_ledger(old, TABLE, before).merge(recompute_ledger(new, TABLE, steps, start=before))

    agreeing = [(SPEC, 4, SPEC, 9), (SPEC, 7, gated, 12), (gated, 9, rolled, 14), (rolled, 14, rolled, 14)]
    for old, before, new, steps in agreeing:
        assert old.agrees_before(new, before)
        assert extended(old, before, new, steps) == recompute_ledger(new, TABLE, steps)
    disagreeing = [
        (SPEC, 8, gated, 12),  # the gate took effect at step 7, before 8
        (gated, 10, rolled, 14),  # the rollback discarded step 9
        (SPEC, 4, replace(SPEC, seed=6), 9),
        (SPEC, 4, replace(SPEC, excluded_corpora=frozenset({"news"})), 9),
    ]
    for old, before, new, steps in disagreeing:
        assert not old.agrees_before(new, before)
        assert extended(old, before, new, steps) != recompute_ledger(new, TABLE, steps)
