"""SQL functions over ledger tensor names, one compilation per dialect (SQLite, PostgreSQL): the
query layer groups ledger rows by adapter or by base layer inside the database.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import Integer, String

from govray.governance.routing import ADAPTER_PREFIX


class adapter_of(FunctionElement[str]):
    """SQL: the adapter name of a ledger tensor (``adapter/NAME/...`` → NAME), NULL for a base one."""

    type = String()
    inherit_cache = True


class base_layer_of(FunctionElement[int]):
    """SQL: the layer index of a base tensor, NULL for an adapter tensor (grouped by adapter)."""

    type = Integer()
    inherit_cache = True


def _is_adapter(tensor: str) -> str:
    return f"substr({tensor}, 1, {len(ADAPTER_PREFIX)}) = '{ADAPTER_PREFIX}'"


@compiles(adapter_of)
def _adapter_of_sqlite(element: adapter_of, compiler: SQLCompiler, **kw: Any) -> str:
    tensor = compiler.process(element.clauses, **kw)
    rest = f"substr({tensor}, {len(ADAPTER_PREFIX) + 1})"
    return f"CASE WHEN {_is_adapter(tensor)} THEN substr({rest}, 1, instr({rest}, '/') - 1) END"


@compiles(adapter_of, "postgresql")
def _adapter_of_postgresql(element: adapter_of, compiler: SQLCompiler, **kw: Any) -> str:
    tensor = compiler.process(element.clauses, **kw)
    return f"CASE WHEN {_is_adapter(tensor)} THEN split_part({tensor}, '/', 2) END"


@compiles(base_layer_of)
def _base_layer_of(element: base_layer_of, compiler: SQLCompiler, **kw: Any) -> str:
    tensor, layer = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"CASE WHEN {_is_adapter(tensor)} THEN NULL ELSE {layer} END"
