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
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from govray.core.errors import GovrayError, describe_validation_error
from govray.data.schedule import ScheduleSpec, Slot, step_slots
from govray.governance.routing import ADAPTER_PREFIX, RoutingTable, layer_label

LEDGER_VERSION = 1


class LedgerError(GovrayError):
    """A ledger document is malformed, or token counts do not cover a route's rows."""


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
class Ledger:
    """Per ``(corpus_id, tensor name)``: examples, tokens and steps that contributed DIRECTLY.

    Tensor names are base parameter names or adapter tensors ``adapter/NAME/TARGET.lora_A|B``.
    """

    entries: dict[tuple[str, str], LedgerEntry] = field(default_factory=dict)

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
        reached: set[tuple[str, str]] = set()
        for item in slots:
            if item.empty:
                continue
            assert item.route is not None
            examples = Counter(item.corpora)
            token_counts = self._slot_tokens(item, tokens) if tokens is not None else Counter()
            for tensor in table.updated_tensors(item.route):
                for corpus, count in examples.items():
                    entry = self.entries.setdefault((corpus, tensor), LedgerEntry())
                    entry.examples += count
                    entry.tokens += token_counts[corpus]
                    reached.add((corpus, tensor))
        for key in reached:
            self.entries[key].steps += 1

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


def recompute_ledger(
    spec: ScheduleSpec,
    table: RoutingTable,
    steps: int,
    tokens: Mapping[str, Sequence[int]] | None = None,
) -> Ledger:
    """The ledger of global steps ``0..steps-1``, from the schedule and the routing table alone
    (steps a rollback discarded reached nothing)."""
    ledger = Ledger()
    for global_step in range(steps):
        if spec.reverted(global_step):
            continue
        ledger.record_step(step_slots(spec, global_step), table, tokens)
    return ledger


def format_ledger(ledger: Ledger, table: RoutingTable) -> str:
    """A compact table of examples: one row per corpus, one column per layer, then per adapter.

    A cell shows the most examples that reached any tensor of the column, ``*`` after it when the
    corpus reached only some of the column's tensors, and ``-`` when it reached none.
    """
    columns = _columns(table)
    header = ["corpus", *columns]
    lines = [header]
    for corpus in ledger.corpora():
        cells = [corpus]
        for tensors in columns.values():
            counts = [ledger.entries[corpus, t].examples for t in tensors if (corpus, t) in ledger.entries]
            if not counts:
                cells.append("-")
            else:
                cells.append(f"{max(counts)}{'' if len(counts) == len(tensors) else '*'}")
        lines.append(cells)
    widths = [max(len(line[index]) for line in lines) for index in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if index == 0 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )


def _columns(table: RoutingTable) -> dict[str, list[str]]:
    """Column title → tensor names: each layer's parameters (a tied one under every layer holding it),
    then one column per adapter."""
    columns: dict[str, list[str]] = {layer: [] for layer in table.layers}
    for info in table.parameters:
        for layer in dict.fromkeys(info.layers):
            title = layer_label(table.layers[layer] if layer is not None else None)
            columns.setdefault(title, []).append(info.name)
    for route, adapter in table.adapter_names.items():
        tensors = columns.setdefault(layer_label(None, adapter), [])
        tensors.extend(name for name in table.updated_tensors(route) if name not in tensors)
    return columns
