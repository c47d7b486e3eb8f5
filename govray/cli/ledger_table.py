"""The ledger as a person reads it: one row per corpus, one column per layer, then per adapter.

Example::

    print(format_ledger(outcome.ledger, checked.routing))
"""

from __future__ import annotations

from govray.governance.routing import RoutingTable, layer_label
from govray.train.step.ledger import Ledger


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
