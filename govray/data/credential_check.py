"""Every credential an experiment's training data carries, matched against its policy before Ray
starts (``govray policy check``): ingest would refuse the first row no rule matches, after Ray
started and read the data; this names every one at once.

A corpus without ``credential_columns`` has one credential; a corpus with them has one per distinct
combination of those columns' values, read here with pyarrow (only those columns). Each credential
must be valid and matched by a rule (or the policy's default route); what is not is said with the
rows it covers and the closest rule (``DepthPolicy.closest_rule``). Validation and probe corpora
are never routed, so only their credentials' validity is checked.

Example::

    problems = unmatched_credentials(config.data.corpora, verified.policy)
    # ["corpus 'writers' rows with jurisdiction 'NL', sensitivity 'pii' (132 rows): matches no rule ..."]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from govray.config.data import CorpusRole, CorpusSpec
from govray.core.errors import CredentialError, IngestError, PolicyError
from govray.data.fingerprint import corpus_files
from govray.governance.credentials import build_credential
from govray.governance.policy import DepthPolicy

__all__ = ["unmatched_credentials"]


def unmatched_credentials(corpora: Sequence[CorpusSpec], policy: DepthPolicy) -> list[str]:
    """What no rule of ``policy`` takes, or is no valid credential, in every corpus: one line each
    (empty: every row of every corpus has a route)."""
    problems = []
    for spec in corpora:
        try:
            combinations = _combinations(spec)
        except IngestError as error:
            problems.append(str(error))
            continue
        for values, rows in combinations:
            overrides = dict(zip(spec.credential_columns, values, strict=True))
            where = _rows(spec, overrides, rows)
            empty = [name for name, value in overrides.items() if value is None]
            if empty:
                problems.append(f"corpus '{spec.id}'{where}: credential field(s) {', '.join(empty)} empty")
                continue
            try:
                credential = build_credential(
                    {**spec.base_credential(), **overrides}, where=f"corpus '{spec.id}'"
                )
                if spec.role == CorpusRole.TRAIN:
                    policy.route_key_for(credential, where=where)
            except (CredentialError, PolicyError) as error:
                problems.append(str(error))
    return problems


def _rows(spec: CorpusSpec, overrides: dict[str, Any], rows: int | None) -> str:
    if not overrides:
        return ""
    said = ", ".join(f"{name} {value!r}" for name, value in overrides.items())
    return f" (rows with {said}: {rows} rows)"


def _combinations(spec: CorpusSpec) -> list[tuple[tuple[Any, ...], int | None]]:
    """The distinct values of the corpus's credential columns, with how many rows hold each, in
    the columns' sorted order (one empty combination for a corpus without such columns)."""
    columns = list(spec.credential_columns.values())
    if not columns:
        return [((), None)]
    format_name = spec.resolved_format.value
    tables = [
        _read(path, format_name, columns, spec.id)
        for _, path in corpus_files(spec.path, format_name, corpus_id=spec.id)
    ]
    table = pa.concat_tables(tables, promote_options="permissive")
    counted = table.group_by(columns, use_threads=False).aggregate([([], "count_all")])
    found = [(tuple(row[column] for column in columns), int(row["count_all"])) for row in counted.to_pylist()]
    return sorted(found, key=lambda item: tuple("" if value is None else str(value) for value in item[0]))


def _read(path: Any, format_name: str, columns: list[str], corpus_id: str) -> pa.Table:
    """``columns`` of one corpus file, as ingest's reader would type them (strings stay strings)."""
    try:
        if format_name == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, columns=columns)
        if format_name == "jsonl":
            import pyarrow.json as pj

            table = pj.read_json(path)
        else:
            import pyarrow.csv as pc

            table = pc.read_csv(path, convert_options=pc.ConvertOptions(include_columns=columns))
    except (pa.ArrowInvalid, KeyError, OSError) as error:
        raise IngestError(
            f"corpus '{corpus_id}': cannot read its credential columns from {path}: {error}"
        ) from None
    missing = [column for column in columns if column not in table.column_names]
    if missing:
        raise IngestError(
            f"corpus '{corpus_id}': credential column(s) {', '.join(missing)} not in {path} "
            f"(its columns: {', '.join(table.column_names)})"
        )
    return table.select(columns)
