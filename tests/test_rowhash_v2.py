"""Row hash version 2: the same rows hash equally whatever the batch split and the file format they
were read from; the encoding is unambiguous (its definition spelled out once); and an ingest made
with version 1 stays readable, named as such, and its rows are still found and verified."""

from __future__ import annotations

import hashlib
import itertools
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq
import pytest

from govray.core.keys import SigningKey
from govray.data.ingest import ingest
from govray.data.rowcode import BLOCK, header
from govray.data.rowhash import ROW_HASH_VERSION, row_hash, row_hashes
from govray.data.shards import ShardSet
from tests.helpers.builders import write_corpus
from tests.helpers.ingest import build, corpus_spec, verified


def mixed_rows(count: int) -> list[dict[str, Any]]:
    """Rows of every kind a corpus file holds: floats, integers, strings with escapes, nulls, empty
    strings (no null string: CSV writes it as an empty one)."""
    return [
        {
            "x": None if i % 11 == 3 else float(i) / 7.0 - 3.0,
            "y": i % 5 - 2,
            "text": "" if i % 13 == 5 else f'row "{i}"\n\té',
            "flag": i % 3 == 0,
        }
        for i in range(count)
    ]


def test_same_rows_hash_equally_whatever_the_batch_split() -> None:
    table = pa.Table.from_pylist(mixed_rows(500))
    expected = row_hashes(table)[0].to_pylist()
    rng = np.random.default_rng(3)
    for _ in range(5):
        cuts = sorted(rng.choice(np.arange(1, 500), size=rng.integers(1, 20), replace=False).tolist())
        pieces = [
            table.slice(start, stop - start) for start, stop in zip([0, *cuts], [*cuts, 500], strict=True)
        ]
        assert [h for piece in pieces for h in row_hashes(piece)[0].to_pylist()] == expected
        assert row_hashes(pa.concat_tables(pieces))[0].to_pylist() == expected  # chunked columns
    batches = table.to_batches(max_chunksize=7)
    assert [
        h for batch in batches for h in row_hashes(pa.Table.from_batches([batch]))[0].to_pylist()
    ] == expected
    assert expected == [row_hash(row) for row in table.to_pylist()]


def test_same_rows_hash_equally_from_csv_jsonl_and_parquet(tmp_path: Path) -> None:
    """Arrow reads each format with its own types (int32 and dictionary strings from this parquet
    file, int64 and plain strings from CSV and JSONL, columns in another order): the hashes agree."""
    rows = mixed_rows(200)
    write_corpus(tmp_path / "rows.csv", rows)
    write_corpus(tmp_path / "rows.jsonl", rows)
    narrow = pa.Table.from_pylist([dict(reversed(row.items())) for row in rows]).cast(
        pa.schema(
            [
                ("flag", pa.bool_()),
                ("text", pa.dictionary(pa.int16(), pa.string())),
                ("y", pa.int32()),
                ("x", pa.float64()),
            ]
        )
    )
    pq.write_table(narrow, tmp_path / "rows.parquet")
    tables = {
        "csv": pcsv.read_csv(tmp_path / "rows.csv"),
        "jsonl": pjson.read_json(tmp_path / "rows.jsonl"),
        "parquet": pq.read_table(tmp_path / "rows.parquet"),
    }
    assert tables["parquet"].schema.field("y").type == pa.int32()
    hashes = {name: row_hashes(table)[0].to_pylist() for name, table in tables.items()}
    assert hashes["csv"] == hashes["jsonl"] == hashes["parquet"] == [row_hash(row) for row in rows]


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ({"a": "bc"}, {"ab": "c"}),  # where the name ends
        ({"a": "x", "b": ""}, {"a": "", "b": "x"}),  # where a value ends
        ({"a": None}, {"a": ""}),  # null is not the empty string
        ({"a": "n"}, {"a": None}),  # nor the tag's letter
        ({"a": 1}, {"a": 1.0}),  # integer, float, boolean and text stay apart
        ({"a": 1}, {"a": True}),
        ({"a": 1}, {"a": "1"}),
        ({"a": b"x"}, {"a": "x"}),  # binary is not text
        ({"a": 2**63}, {"a": -(2**63)}),  # the same eight bytes, unsigned and signed
        ({"a": 0.0}, {"a": -0.0}),
        ({"a": 1}, {"a": 1, "b": None}),  # a null column still counts
    ],
)
def test_distinct_rows_encode_distinctly(one: dict[str, Any], other: dict[str, Any]) -> None:
    assert row_hash(one) != row_hash(other)


def test_the_version_2_definition_spelled_out() -> None:
    row = {"name": "Zoë", "count": 3, "score": float("nan"), "note": None}
    names = sorted(row)  # count, name, note, score
    head = b"govray-row-v2\n" + struct.pack("<I", 4)
    head += b"".join(struct.pack("<I", len(n.encode())) + n.encode() for n in names)
    head += b"\0" * (-len(head) % 64)
    values = b"i" + struct.pack("<q", 3)
    values += b"s" + struct.pack("<Q", len("Zoë".encode())) + "Zoë".encode()
    values += b"n"
    values += b"f" + bytes.fromhex("000000000000f87f")  # the one NaN, little-endian
    assert header(list(row)) == head and len(head) % BLOCK == 0
    assert row_hash(row) == hashlib.sha256(head + values).hexdigest()
    assert row_hashes(pa.Table.from_pylist([row]))[0].to_pylist() == [row_hash(row)]


# --- the compiled kernel ------------------------------------------------------------------------


def test_the_compiled_kernel_is_built_and_uses_this_cpus_sha_extensions_where_it_has_them() -> None:
    """The install compiles ``govray/data/_rowdigest.c`` (pyproject's ext-modules, optional): on a
    machine with a C compiler it must be there, else ingest silently hashes 5x slower."""
    from govray.data import _rowdigest

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert _rowdigest.uses_sha_extensions() == (" sha_ni" in flags)


@pytest.mark.parametrize("native", [True, False])
def test_the_kernel_digests_equal_hashlibs_for_every_length_and_header(native: bool) -> None:
    """Every row length across the one-block / two-block padding edges (55, 56, 63, 64, 119, 120
    bytes...), headers of 0-3 blocks, empty rows, offsets not starting at 0; both compression
    functions (the CPU's SHA extensions and portable C)."""
    from govray.data import _rowdigest

    rng = np.random.default_rng(7)
    lengths = np.array([*range(0, 200), *rng.integers(0, 5000, 50)], dtype=np.int64)
    rng.shuffle(lengths)
    offsets = np.concatenate([[13], 13 + np.cumsum(lengths)]).astype(np.int64)
    data = rng.integers(0, 256, int(offsets[-1]) + 5, dtype=np.uint8).tobytes()
    for blocks in range(4):
        start = rng.integers(0, 256, 64 * blocks, dtype=np.uint8).tobytes()
        expected = b"".join(
            hashlib.sha256(start + data[a:b]).digest() for a, b in itertools.pairwise(offsets.tolist())
        )
        assert _rowdigest.sha256_rows(start, offsets, data, native=native) == expected
    assert _rowdigest.sha256_rows(b"", np.zeros(1, dtype=np.int64), b"") == b""


@pytest.mark.parametrize(
    ("start", "offsets", "message"),
    [
        (b"x" * 63, [0, 1], "64-byte blocks"),
        (b"", [0, 5, 3], "offsets must rise"),
        (b"", [-1, 2], "offsets must rise"),
        (b"", [0, 11], "end within data"),
        (b"", [], "one more than the rows"),
    ],
)
def test_the_kernel_refuses_offsets_outside_its_data(start: bytes, offsets: list[int], message: str) -> None:
    from govray.data import _rowdigest

    with pytest.raises(ValueError, match=message):
        _rowdigest.sha256_rows(start, np.array(offsets, dtype=np.int64), b"0123456789")


def test_row_hashes_through_the_kernel_equal_the_hashlib_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``row_hashes`` of mixed rows (strings, nulls, floats: variable widths) and of fixed-width
    rows, with and without the kernel."""
    from govray.data import rowcode

    tables = [
        pa.Table.from_pylist(mixed_rows(300)),
        pa.table({"a": np.arange(1000, dtype=np.float32), "b": np.arange(1000) % 7}),
    ]
    assert rowcode._rowdigest is not None
    with_kernel = [row_hashes(table)[0].to_pylist() for table in tables]
    monkeypatch.setattr(rowcode, "_rowdigest", None)
    assert [row_hashes(table)[0].to_pylist() for table in tables] == with_kernel
    assert with_kernel[0] == [row_hash(row) for row in tables[0].to_pylist()]


# --- through ingest (Ray Data reads each format) -------------------------------------------------


def exact_rows(count: int = 90) -> list[dict[str, Any]]:
    """Rows whose floats every reader parses exactly: Ray Data reads JSONL through pandas, whose
    float parser rounds (``0.14285714285714285`` comes back ``0.14285714285714202``), so rows of
    arbitrary floats are not the same rows once read from JSONL."""
    return [{"x": i / 8 - 3.25, "y": i % 3, "text": f"row {i}"} for i in range(count)]


def same_rows_three_ways(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> Path:
    rows = exact_rows()
    write_corpus(tmp_path / "pq" / "a.parquet", rows[:40])  # two files: another block split
    write_corpus(tmp_path / "pq" / "b.parquet", rows[40:])
    write_corpus(tmp_path / "same.jsonl", rows)
    write_corpus(tmp_path / "same.csv", rows)
    corpora = [
        corpus_spec("as-parquet", "pq", format="parquet"),
        corpus_spec("as-jsonl", "same.jsonl"),
        corpus_spec("as-csv", "same.csv"),
    ]
    return build(tmp_path, authority_key, trust_file, corpora)


def hashes_by_row(shards: ShardSet, corpus: str) -> dict[int, tuple[str, bool]]:
    """Every row of ``corpus`` in the shards: its hash, and whether it was held out."""
    found = {}
    for route in shards.manifest.routes:
        for file in route.files:
            for row in pq.read_table(shards.root / file.path).to_pylist():
                if row["_corpus"] == corpus:
                    found[row["_row"]] = (row["_row_hash"].hex(), False)  # raw bytes in format 4
    for file in shards.manifest.holdout.get(corpus, []):
        for row in pq.read_table(shards.root / file.path).to_pylist():
            found[row["_row"]] = (row["_row_hash"].hex(), True)
    return found


@pytest.mark.usefixtures("ray_session")
def test_ingest_hashes_the_same_rows_equally_from_every_format(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    config, policy = verified(same_rows_three_ways(tmp_path, authority_key, trust_file))
    result = ingest(config, policy)
    assert result.manifest.row_hash_version == ROW_HASH_VERSION == 2
    shards = ShardSet.open(result.root, verify=True)
    placed = {corpus: hashes_by_row(shards, corpus) for corpus in ("as-parquet", "as-jsonl", "as-csv")}
    assert placed["as-parquet"] == placed["as-jsonl"] == placed["as-csv"]
    expected = [row_hash(row) for row in exact_rows()]
    assert [placed["as-csv"][row][0] for row in range(90)] == expected
    held = [held for _, held in placed["as-csv"].values()]
    assert held.count(True) == result.manifest.corpus("as-csv").holdout_rows
