"""The ledger: per (corpus, tensor), what contributed directly to that tensor's updates.

A corpus contributes directly to a tensor at a step when rows of that corpus sit in a non-empty
slot whose route updates the tensor (``RoutingTable.updated_tensors``): their gradients reach its
update. A frozen lower layer is still influenced indirectly through the layers above it; the
ledger does not count that. It counts the training split only, since the schedule reads only
training shards.

The ledger is a deterministic function of the schedule and the routing table, so a verifier
recomputes it without govray's database::

    ledger = recompute_ledger(spec, table, steps=trained_steps)
    assert ledger == Ledger.from_json(state["ledger"])
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govray.core.errors import GovrayError, describe_validation_error
from govray.data.schedule import RouteLayout, ScheduleSpec
from govray.data.slots import Slot
from govray.data.step_rows import StepRows, step_rows
from govray.governance.routing import ADAPTER_PREFIX, RoutingTable

LEDGER_VERSION = 1


class LedgerError(GovrayError):
    """A ledger document is malformed, or token counts do not cover a route's rows."""


class RowCounts(Protocol):
    """What each scheduled position of a route holds: its examples (None: one each) and its
    tokens (None: not counted)."""

    def examples(self, route: str, positions: np.ndarray) -> np.ndarray | None: ...

    def tokens(self, route: str, positions: np.ndarray) -> np.ndarray | None: ...


class TokensPerRow:
    """One example per row, with the tokens a trial's ``tokens`` hook counted for each row."""

    def __init__(self, counts: Mapping[str, Sequence[int] | np.ndarray]) -> None:
        self.counts = {route: np.asarray(values) for route, values in counts.items()}

    def examples(self, route: str, positions: np.ndarray) -> None:
        return None

    def tokens(self, route: str, positions: np.ndarray) -> np.ndarray:
        counts = self.counts.get(route)
        if counts is None:
            raise LedgerError(f"token counts name no route '{route}' (routes: {', '.join(self.counts)})")
        if len(positions) and int(positions.max()) >= len(counts):
            raise LedgerError(
                f"token counts of route '{route}' cover {len(counts)} rows; no row {int(positions.max())}"
            )
        return counts[positions]


@dataclass
class LedgerEntry:
    """Direct contribution of one corpus to one tensor."""

    examples: int = 0  # rows whose gradients reached the tensor's updates (repeats across epochs count)
    tokens: int = 0  # their tokens, when token counts were given
    steps: int = 0  # steps at which at least one such row did


class _LedgerRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: str
    tensor: str
    examples: int = Field(ge=0)
    tokens: int = Field(ge=0)
    steps: int = Field(ge=0)


class _LedgerDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int
    entries: list[_LedgerRow]


@dataclass
class _RouteTally:
    """One route's pending counts, per position in its layout's corpus list."""

    layout: RouteLayout
    examples: np.ndarray
    tokens: np.ndarray
    steps: np.ndarray  # steps that reached the corpus, for corpora no other route holds
    solo: np.ndarray  # bool: the corpus is in this route only
    shared: tuple[int, ...]  # positions of corpora other routes hold too

    @classmethod
    def of(cls, layout: RouteLayout, routes_of: Mapping[str, int]) -> _RouteTally:
        solo = np.array([routes_of[corpus] <= 1 for corpus, _ in layout.corpus_counts], dtype=bool)
        zeros = np.zeros(len(layout.corpus_counts), dtype=np.int64)
        shared = tuple(np.flatnonzero(~solo).tolist())
        return cls(layout, zeros.copy(), zeros.copy(), zeros.copy(), solo, shared)

    def clear(self) -> None:
        self.examples[:] = 0
        self.tokens[:] = 0
        self.steps[:] = 0


class Ledger:
    """Per ``(corpus_id, tensor name)``: examples, tokens and steps that contributed DIRECTLY.

    Tensor names are base parameter names or adapter tensors ``adapter/NAME/TARGET.lora_A|B``.

    A step is recorded per (corpus, route) — O(slots), whatever the number of tensors — and
    expanded to (corpus, tensor) only when ``entries`` is read (a ledger written, compared or
    reported): every tensor a route updates gains that route's examples and tokens; ``steps``
    grows by one per (corpus, tensor) reached at a step, however many of the corpus's routes
    reached it, so the pending step counts are kept per (corpus, set of routes reached).
    """

    def __init__(self, entries: dict[tuple[str, str], LedgerEntry] | None = None) -> None:
        self._entries: dict[tuple[str, str], LedgerEntry] = dict(entries or {})
        self._table: RoutingTable | None = None
        self._examples: Counter[tuple[str, str]] = Counter()  # (corpus, route) → examples
        self._tokens: Counter[tuple[str, str]] = Counter()  # (corpus, route) → tokens
        self._steps: Counter[tuple[str, frozenset[str]]] = Counter()  # (corpus, routes) → steps
        self._layouts: tuple[RouteLayout, ...] = ()
        self._tallies: dict[str, _RouteTally] = {}  # per route, per corpus position (record_rows)

    @property
    def entries(self) -> dict[tuple[str, str], LedgerEntry]:
        """Every (corpus, tensor) entry, with the steps recorded so far expanded."""
        self._expand()
        return self._entries

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ledger) and self.entries == other.entries

    def __repr__(self) -> str:
        return f"Ledger({self.entries!r})"

    def record_step(
        self,
        slots: Sequence[Slot],
        table: RoutingTable,
        tokens: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        """Add one step's slots (one per rank).

        ``tokens`` maps a route to the token count of each of its route-local rows. ``steps``
        grows by one per (corpus, tensor) reached at this step, however many slots reached it.
        """
        examples: Counter[tuple[str, str]] = Counter()
        token_counts: Counter[tuple[str, str]] = Counter()
        for item in slots:
            if item.empty:
                continue
            assert item.route is not None
            examples.update((corpus, item.route) for corpus in item.corpora)
            if tokens is not None:
                for corpus, count in self._slot_tokens(item, tokens).items():
                    token_counts[corpus, item.route] += count
        self._record(examples, token_counts, table)

    def record_rows(self, step: StepRows, table: RoutingTable, counts: RowCounts | None = None) -> None:
        """``record_step`` from a step's rows summed by route (``schedule.step_rows``): the
        same entries, counted in arrays per route (one bincount per route and step) instead of
        a Python loop over every row of every slot. ``counts`` says what each scheduled position
        holds: one example and its tokens (``TokensPerRow``), or a packed window's examples and
        tokens (``govray.data.packed.PackedStore``); None: one example each, no tokens."""
        self._use_table(table)
        tallies = self._tallies_for(step.routes)
        reached: dict[str, set[str]] = {}  # corpora several routes hold: their routes reached
        for layout in step.routes:
            if layout.route not in step.rows:
                continue
            tally = tallies[layout.route]
            rows, positions = step.rows[layout.route], step.corpus[layout.route]
            read = np.bincount(positions, minlength=len(layout.corpus_counts))  # positions per corpus
            present = read > 0
            held = counts.examples(layout.route, rows) if counts is not None else None
            tokens = counts.tokens(layout.route, rows) if counts is not None else None
            # float64 sums of integers are exact below 2**53 examples or tokens per step and corpus
            tally.examples += read if held is None else _weighted(positions, held, len(read))
            if tokens is not None:
                tally.tokens += _weighted(positions, tokens, len(read))
            tally.steps += present & tally.solo
            for position in tally.shared:
                if present[position]:
                    reached.setdefault(layout.corpus_counts[position][0], set()).add(layout.route)
        self._steps.update((corpus, frozenset(routes)) for corpus, routes in reached.items())

    def _use_table(self, table: RoutingTable) -> None:
        if self._table is not None and self._table is not table and self._table != table:
            self._expand()
        self._table = table

    def _tallies_for(self, layouts: tuple[RouteLayout, ...]) -> dict[str, _RouteTally]:
        if self._layouts is not layouts and self._layouts != layouts:
            self._expand()
            routes_of: Counter[str] = Counter(
                corpus for layout in layouts for corpus, rows in layout.corpus_counts if rows
            )
            self._tallies = {layout.route: _RouteTally.of(layout, routes_of) for layout in layouts}
            self._layouts = layouts
        return self._tallies

    def _record(
        self,
        examples: Counter[tuple[str, str]],
        tokens: Counter[tuple[str, str]],
        table: RoutingTable,
    ) -> None:
        self._use_table(table)
        self._examples.update(examples)
        self._tokens.update(tokens)
        reached: dict[str, set[str]] = {}
        for corpus, route in examples:
            reached.setdefault(corpus, set()).add(route)
        self._steps.update((corpus, frozenset(routes)) for corpus, routes in reached.items())

    def _expand(self) -> None:
        """Fold the pending (corpus, route) counts into the (corpus, tensor) entries."""
        table = self._table
        if table is None:
            return
        examples, tokens, steps = self._examples, self._tokens, self._steps
        for route, tally in self._tallies.items():
            for position in np.flatnonzero(tally.examples).tolist():
                corpus = tally.layout.corpus_counts[position][0]
                examples[corpus, route] += int(tally.examples[position])
                tokens[corpus, route] += int(tally.tokens[position])
            for position in np.flatnonzero(tally.steps).tolist():
                steps[tally.layout.corpus_counts[position][0], frozenset({route})] += int(
                    tally.steps[position]
                )
            tally.clear()
        if not (examples or steps):
            return
        updated: dict[str, tuple[str, ...]] = {}
        for (corpus, route), count in examples.items():
            added = tokens[corpus, route]
            if route not in updated:
                updated[route] = table.updated_tensors(route)
            for tensor in updated[route]:
                entry = self._entries.get((corpus, tensor))
                if entry is None:
                    entry = self._entries[corpus, tensor] = LedgerEntry()
                entry.examples += count
                entry.tokens += added
        for (corpus, routes), count in steps.items():
            for tensor in {tensor for route in routes for tensor in table.updated_tensors(route)}:
                self._entries[corpus, tensor].steps += count
        examples.clear()
        tokens.clear()
        steps.clear()

    @staticmethod
    def _slot_tokens(item: Slot, tokens: Mapping[str, Sequence[int]]) -> Counter[str]:
        assert item.route is not None
        if item.route not in tokens:
            raise LedgerError(f"token counts name no route '{item.route}' (routes: {', '.join(tokens)})")
        counts = tokens[item.route]
        total: Counter[str] = Counter()
        for row, corpus in zip(item.rows, item.corpora, strict=True):
            if row >= len(counts):
                raise LedgerError(
                    f"token counts of route '{item.route}' cover {len(counts)} rows; no row {row}"
                )
            total[corpus] += int(counts[row])
        return total

    def merge(self, other: Ledger) -> Ledger:
        """A new ledger holding the sums of both (a PBT clone inherits its donor's ledger)."""
        merged = Ledger()
        for source in (self, other):
            for key, entry in source.entries.items():
                target = merged.entries.setdefault(key, LedgerEntry())
                target.examples += entry.examples
                target.tokens += entry.tokens
                target.steps += entry.steps
        return merged

    def without_adapter(self, adapter: str) -> Ledger:
        """A new ledger without the entries of adapter ``adapter``'s tensors (a model version
        that no longer carries that adapter file)."""
        prefix = f"{ADAPTER_PREFIX}{adapter}/"
        return Ledger(
            {
                key: LedgerEntry(entry.examples, entry.tokens, entry.steps)
                for key, entry in self.entries.items()
                if not key[1].startswith(prefix)
            }
        )

    def rows(self) -> list[tuple[str, str, LedgerEntry]]:
        """``(corpus, tensor, entry)`` sorted by corpus, then tensor."""
        return [(corpus, tensor, self.entries[corpus, tensor]) for corpus, tensor in sorted(self.entries)]

    def corpora(self) -> list[str]:
        return sorted({corpus for corpus, _ in self.entries})

    def tensors(self) -> list[str]:
        return sorted({tensor for _, tensor in self.entries})

    def to_json(self) -> dict[str, Any]:
        """A JSON document, rows sorted; ``from_json`` reads it back exactly."""
        return {
            "version": LEDGER_VERSION,
            "entries": [
                {
                    "corpus": corpus,
                    "tensor": tensor,
                    "examples": entry.examples,
                    "tokens": entry.tokens,
                    "steps": entry.steps,
                }
                for corpus, tensor, entry in self.rows()
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Ledger:
        try:
            document = _LedgerDocument.model_validate(data)
        except ValidationError as error:
            raise LedgerError(f"malformed ledger: {describe_validation_error(error)}") from None
        if document.version != LEDGER_VERSION:
            raise LedgerError(f"ledger version {document.version} is not {LEDGER_VERSION}")
        ledger = cls()
        for row in document.entries:
            key = (row.corpus, row.tensor)
            if key in ledger.entries:
                raise LedgerError(f"ledger lists corpus '{row.corpus}' and tensor '{row.tensor}' twice")
            ledger.entries[key] = LedgerEntry(examples=row.examples, tokens=row.tokens, steps=row.steps)
        return ledger


def _weighted(positions: np.ndarray, weights: np.ndarray, length: int) -> np.ndarray:
    return np.bincount(positions, weights=weights, minlength=length).astype(np.int64)


def recompute_ledger(
    spec: ScheduleSpec,
    table: RoutingTable,
    steps: int,
    tokens: Mapping[str, Sequence[int] | np.ndarray] | RowCounts | None = None,
    start: int = 0,
) -> Ledger:
    """The ledger of global steps ``start..steps-1``, from the schedule and the routing table alone
    (steps a rollback discarded reached nothing); ``tokens``: per route, each row's tokens, or what
    each position holds (``RowCounts``). Ledgers of adjacent ranges under one schedule merge into
    the ledger of both (``Ledger.merge``)."""
    ledger = Ledger()
    counts = TokensPerRow(tokens) if isinstance(tokens, Mapping) else tokens
    for global_step in range(start, steps):
        if spec.reverted(global_step):
            continue
        ledger.record_rows(step_rows(spec, global_step), table, counts)
    return ledger
