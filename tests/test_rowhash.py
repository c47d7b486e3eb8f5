"""Row hashes a table at a time are the row hash of each row: ``row_hashes`` (Arrow kernels and
numpy, the compiled digest kernel) equals ``row_hash`` (the definition: sha256 of the row's
canonical binary encoding) on tables of every column type, with nulls, extreme floats, escapes
and nested values; the holdout split from the hashes' first 64 bits equals ``in_holdout``; and
``annotate``'s credentials, resolved once per distinct combination, are each row's own."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from govray.config.data import CorpusRole, CorpusSpec
from govray.core.canonical import canonical_json
from govray.core.errors import IngestError
from govray.data.rowhash import (
    ROW_HASH_VERSION,
    check_version,
    holdout_mask,
    in_holdout,
    row_digests,
    row_hash,
    row_hashes,
)
from govray.data.units import DICTIONARY_COLUMNS, HOLDOUT, Annotated, RowRefusal, annotate
from govray.governance.credentials import build_credential
from govray.governance.policy import DepthPolicy

ROOT = Path(__file__).resolve().parents[1]

floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True) | st.sampled_from(
    [0.0, -0.0, 1.0, 1e-4, 9.999999999999999e-05, 1e10, 9999999999.999998, 1e16, 1e-7, 2.5, -1.0]
)
texts = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12
) | st.sampled_from(['a"b', "back\\slash", "line\nbreak\r\t\b\f", "\x00\x01\x1f\x7f", "\u2028é漢🙂", ""])
# Per column type: a value strategy (None is added for nulls) and the Arrow type.
COLUMN_TYPES: dict[str, tuple[Any, pa.DataType]] = {
    "int64": (st.integers(-(2**63), 2**63 - 1), pa.int64()),
    "uint8": (st.integers(0, 255), pa.uint8()),
    "uint64": (st.integers(0, 2**64 - 1), pa.uint64()),
    "float64": (floats, pa.float64()),
    "float32": (st.floats(width=32, allow_nan=True, allow_infinity=True), pa.float32()),
    "bool": (st.booleans(), pa.bool_()),
    "string": (texts, pa.string()),
    "large_string": (texts, pa.large_string()),
    "binary": (st.binary(max_size=6), pa.binary()),
    "date": (st.dates(dt.date(1900, 1, 1), dt.date(2100, 1, 1)), pa.date32()),
    "list": (st.lists(st.integers(-5, 5), max_size=3), pa.list_(pa.int64())),
    "struct": (
        st.fixed_dictionaries({"z": st.integers(0, 9), "a": texts}),
        pa.struct({"z": pa.int64(), "a": pa.string()}),
    ),
}


@st.composite
def tables(draw: Any) -> pa.Table:
    rows = draw(st.integers(0, 25))
    names = draw(st.lists(texts, min_size=0, max_size=5, unique=True))
    columns = {}
    for name in names:
        values, kind = COLUMN_TYPES[draw(st.sampled_from(sorted(COLUMN_TYPES)))]
        columns[name] = pa.array(draw(st.lists(st.none() | values, min_size=rows, max_size=rows)), type=kind)
    if not columns:
        return pa.table({"only": pa.array([None] * rows, type=pa.null())})
    return pa.table(columns)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=tables())
def test_row_hashes_are_the_row_hash_of_every_row(table: pa.Table) -> None:
    hashes, prefixes = row_hashes(table)
    expected = [row_hash(row) for row in table.to_pylist()]
    assert hashes.to_pylist() == expected
    assert prefixes.tolist() == [int(digest[:16], 16) for digest in expected]
    raw, raw_prefixes = row_digests(table)  # what shards store
    assert raw.type == pa.binary(32) and [digest.hex() for digest in raw.to_pylist()] == expected
    assert raw_prefixes.tolist() == prefixes.tolist()


def test_any_row_hash_version_but_this_ones_is_refused() -> None:
    assert check_version(ROW_HASH_VERSION) == ROW_HASH_VERSION == 2
    for version in (1, 3, "2", None, True):  # 1: the pre-release canonical-JSON hash
        with pytest.raises(IngestError, match=f"row hash version {version!r} is not the one this govray"):
            check_version(version)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.1, 0.25, 0.5, 1e-12, 1 - 1e-12, 0.3333333333333333])
def test_holdout_mask_is_in_holdout(fraction: float) -> None:
    table = pa.table({"i": np.arange(2000)})
    hashes, prefixes = row_hashes(table)
    # boundary prefixes around the exact threshold, too
    bound = math.ceil(fraction * 2**64)
    edges = [p for p in (bound - 1, bound, bound + 1, 0, 2**64 - 1) if 0 <= p < 2**64]
    all_prefixes = np.concatenate([prefixes, np.array(edges, dtype=np.uint64)])
    digests = hashes.to_pylist() + [f"{p:016x}" + "0" * 48 for p in edges]
    assert holdout_mask(all_prefixes, fraction).tolist() == [in_holdout(d, fraction) for d in digests]


def _writers_spec() -> tuple[CorpusSpec, DepthPolicy]:
    experiment = yaml.safe_load((ROOT / "jobs/examples/digits/experiment.yaml").read_text())
    writers = next(corpus for corpus in experiment["data"]["corpora"] if corpus["id"] == "digits-writers")
    policy = DepthPolicy.model_validate(yaml.safe_load((ROOT / "policies/digits.policy.yaml").read_text()))
    return CorpusSpec.model_validate({**writers, "path": "unused"}), policy


def test_annotate_gives_each_row_its_own_credential_and_route() -> None:
    """Combinations first occur out of sorted order; every row's credential and route are built
    from its own values (the reference: build the credential row by row)."""
    spec, policy = _writers_spec()
    countries = ["US", "DE", "US", "GB", "DE", "GB", "US", "DE"] * 40
    table = pa.table(
        {
            "pixel": np.arange(len(countries)),
            "writer_country": countries,
            "sensitivity": ["pii"] * len(countries),
        }
    )
    routed = annotate(table, 500, spec, policy, 0.2)
    assert isinstance(routed, Annotated)
    annotated = routed.whole()
    assert annotated["_row"].to_pylist() == list(range(500, 500 + len(countries)))
    for row, country in enumerate(countries):
        credential = build_credential(
            {**spec.base_credential(), "jurisdiction": country, "sensitivity": "pii"}, where="test"
        )
        assert (
            annotated["_credential"][row].as_py()
            == canonical_json(credential.model_dump(mode="json")).decode()
        )
        held_out = in_holdout(annotated["_row_hash"][row].as_py().hex(), 0.2)
        route = HOLDOUT if held_out else policy.route_key_for(credential, where="")
        assert annotated["_route"][row].as_py() == route
    assert HOLDOUT in annotated["_route"].to_pylist() and len(set(annotated["_route"].to_pylist())) == 2


def _decoded(table: pa.Table) -> pa.Table:
    """``table`` with its dictionary columns as the values they encode."""
    return pa.table(
        [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c for c in table.columns],
        names=table.column_names,
    )


def test_each_routes_rows_are_the_whole_annotated_table_filtered_by_route() -> None:
    """What a unit writes per route (columns built after the split) equals the fully annotated
    table filtered by ``_route``: the same columns in the same order, types and rows; the routes
    in the order of their first row; an all-holdout corpus (not a training one) has one route.
    ``_corpus``, ``_route`` and ``_credential`` are dictionary columns (shard format 4), each
    holding only the values of the route's rows."""
    import pyarrow.compute as pc

    spec, policy = _writers_spec()
    countries = ["US", "DE", "US", "GB", "DE", "GB", "US", "DE"] * 40
    table = pa.table({"pixel": np.arange(320), "writer_country": countries, "sensitivity": ["pii"] * 320})
    for role, fraction in [(CorpusRole.TRAIN, 0.2), (CorpusRole.VALIDATION, 0.2), (CorpusRole.TRAIN, 0.0)]:
        annotated = annotate(table, 7, spec.model_copy(update={"role": role}), policy, fraction)
        assert isinstance(annotated, Annotated)
        whole = annotated.whole()
        assert annotated.routes() == pc.unique(whole["_route"]).to_pylist()
        for route in annotated.routes():
            expected = whole.filter(pc.equal(whole["_route"], route)).combine_chunks()
            rows = annotated.of_route(route)
            assert rows.schema.equals(expected.schema, check_metadata=True)
            assert _decoded(rows).equals(_decoded(expected))
            for column in DICTIONARY_COLUMNS:  # each holds only the values its rows use
                assert pa.types.is_dictionary(rows.schema.field(column).type)
                assert len(rows[column].chunk(0).dictionary) == len(pc.unique(_decoded(rows)[column]))
        if role == CorpusRole.VALIDATION:
            assert annotated.routes() == [HOLDOUT]
        if fraction == 0.0:
            assert HOLDOUT not in annotated.routes()


@pytest.mark.parametrize(
    ("countries", "sensitivity", "row", "field"),
    [
        (["US", "DE", None, "US", None], ["pii"] * 5, 2, "jurisdiction"),
        (["US", "DE", "US", "US", None], ["pii", "pii", "pii", None, "pii"], 3, "sensitivity"),
    ],
)
def test_annotate_refuses_the_first_row_of_a_bad_combination(
    countries: list[str | None], sensitivity: list[str | None], row: int, field: str
) -> None:
    spec, policy = _writers_spec()
    table = pa.table({"writer_country": countries, "sensitivity": sensitivity})
    refusal = annotate(table, 100, spec, policy, 0.1)
    assert isinstance(refusal, RowRefusal) and refusal.row == 100 + row and refusal.kind == "credential"
    assert f"row {100 + row}: credential field '{field}'" in refusal.message
