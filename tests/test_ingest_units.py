"""Ingest at scale: one task per unit of consecutive rows, files independent of how Ray Data cut the
blocks, a manifest that says which rows each file spans, and a row index that finds a row's route
and position by reading one row group."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.data

from govray.core.errors import IngestError, PolicyError
from govray.core.keys import SigningKey
from govray.data.ingest import IngestResult, ingest
from govray.data.shards import MANIFEST, ShardManifest, ShardSet
from govray.data.units import ROW_GROUP_ROWS, ROWS_PER_UNIT, unit_pieces
from tests.helpers.builders import table_rows, write_corpus
from tests.helpers.ingest import LICENSES, build, corpus_spec, verified

pytestmark = pytest.mark.usefixtures("ray_session")

FIRST_FILES = (80_000, 50_000)  # parquet: by default blocks larger than a unit
SECOND_ROWS = 70_000  # jsonl: the last unit holds 70,000 - 65,536 rows
COLUMNS = {"license_class": "lic", "sensitivity": "sens"}


def rows(count: int, start: int = 0) -> list[dict[str, Any]]:
    """Small rows over three routes: public-domain → public, licensed → licensed, proprietary
    (always pii) → the adapter route pii."""
    licenses = [LICENSES[(i * 7) % 3] for i in range(start, start + count)]
    sensitivity = ["pii" if lic == "proprietary" else "public" for lic in licenses]
    return table_rows(count, start=start, lic=licenses, sens=sensitivity)


def write_corpora(directory: Path, second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    start = 0
    for number, count in enumerate(FIRST_FILES):
        write_corpus(directory / "first" / f"part-{number}.parquet", rows(count, start))
        start += count
    write_corpus(directory / "second.jsonl", second)
    return [
        corpus_spec("first", "first", format="parquet", credential_columns=COLUMNS),
        corpus_spec("second", "second.jsonl", credential_columns=COLUMNS),
    ]


@dataclass
class TwoSplits:
    default: IngestResult  # Ray Data's own blocks
    small: IngestResult  # blocks of at most 64 KiB (thousands of rows each, many per unit), one read task


@pytest.fixture(scope="module")
def two_splits(tmp_path_factory: pytest.TempPathFactory, authority_key: SigningKey) -> Iterator[TwoSplits]:
    from govray.core.keys import TrustConfig, save_trust

    directory = tmp_path_factory.mktemp("units")
    trust_file = directory / "trust.yaml"
    save_trust(TrustConfig(keys=[authority_key.public_key]), trust_file)
    corpora = write_corpora(directory, rows(SECOND_ROWS, start=500_000))
    config, policy = verified(build(directory, authority_key, trust_file, corpora))
    default = ingest(config, policy)
    context = ray.data.DataContext.get_current()
    target, tasks = context.target_max_block_size, context.read_op_min_num_blocks
    # Small blocks, and the two parquet files read by one task (as more files than Ray Data's
    # minimum of read tasks would be).
    context.target_max_block_size, context.read_op_min_num_blocks = 64 * 1024, 1
    try:
        small = ingest(config.model_copy(update={"storage_path": str(directory / "small")}), policy)
    finally:
        context.target_max_block_size, context.read_op_min_num_blocks = target, tasks
    yield TwoSplits(default, small)


def digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_shards_are_byte_identical_whatever_the_block_split(two_splits: TwoSplits) -> None:
    default, small = two_splits.default, two_splits.small
    assert default.load.blocks < 10 < small.load.blocks  # really another split
    assert digests(default.root) == digests(small.root)
    assert default.manifest == small.manifest
    first, second = default.manifest.corpora
    assert (first.rows, second.rows) == (sum(FIRST_FILES), SECOND_ROWS)
    assert default.load.units == small.load.units == 2 + 2  # 130,000 and 70,000 rows


def test_each_file_is_read_by_one_task_and_ray_datas_reader_setting_is_left_as_it_was(
    two_splits: TwoSplits,
) -> None:
    from ray.data.context import DEFAULT_USE_DATASOURCE_V2

    # Ray Data's own blocks: one per file (two parquet files, one JSONL file, all under its
    # block size), not the 200 it cuts after a read by default.
    assert two_splits.default.load.blocks == len(FIRST_FILES) + 1
    # Parquet is read with Ray Data's first reader; the process-wide choice is restored.
    assert ray.data.DataContext.get_current().use_datasource_v2 is DEFAULT_USE_DATASOURCE_V2


def test_parquet_is_read_as_ray_datas_default_reader_reads_it(tmp_path: Path) -> None:
    """The ingest reads Parquet through Ray Data's first reader (faster: BENCHMARKS.md); every block
    it yields, schema metadata dropped as the units drop it, has the schema Ray's default reader
    (DataSourceV2) gives the corpus, and the rows are the same: a pandas index column, a column
    missing from some files (null), an integer column that another file holds as floats
    (promoted), a field id, dictionary and time-zone types."""
    import datetime

    import pandas as pd

    from govray.config.data import CorpusSpec
    from govray.data.ingest import _read

    directory = tmp_path / "mixed"
    directory.mkdir()
    pd.DataFrame({"x": [1, 2], "lic": ["a", "b"]}, index=[10, 20]).to_parquet(directory / "a.parquet")
    pq.write_table(
        pa.table({"x": [1.5, 2.5], "lic": ["a", None], "extra": ["p", None]}), directory / "b.parquet"
    )
    since = datetime.datetime(2020, 1, 1)
    fields = [
        pa.field("x", pa.int64(), metadata={"PARQUET:field_id": "7"}),
        pa.field("lic", pa.string()),
        pa.field("d", pa.dictionary(pa.int32(), pa.string())),
        pa.field("t", pa.timestamp("ms", tz="Europe/Paris")),
    ]
    columns = [pa.array([3]), pa.array(["c"]), pa.array(["q"]).dictionary_encode(), pa.array([since])]
    pq.write_table(pa.table(columns, schema=pa.schema(fields)), directory / "c.parquet")
    files = sorted(directory.glob("*.parquet"))
    spec = CorpusSpec.model_validate(corpus_spec("mixed", str(directory)))

    blocks = [ray.get(block).replace_schema_metadata(None) for block in _read(spec, files).to_arrow_refs()]
    context = ray.data.DataContext.get_current()
    assert context.use_datasource_v2  # Ray's default, as the ingest left it
    default = ray.data.read_parquet([str(file) for file in files], partitioning=None, file_extensions=None)
    expected = pa.concat_tables([ray.get(block) for block in default.to_arrow_refs()])
    assert len(blocks) == len(files)
    for block in blocks:
        assert block.schema.equals(expected.schema, check_metadata=True)
    assert pa.concat_tables(blocks).equals(expected)
    assert expected.column_names == ["x", "lic", "__index_level_0__", "extra", "d", "t"]
    assert expected["x"].type == pa.float64() and expected["extra"].to_pylist() == [
        None,
        None,
        "p",
        None,
        None,
    ]


def test_no_task_holds_more_than_one_block_or_one_unit(two_splits: TwoSplits) -> None:
    default, small = two_splits.default.load, two_splits.small.load
    # Ray Data's own blocks straddle units: one task cuts each, the unit tasks get their rows only.
    assert default.largest_block_rows > ROWS_PER_UNIT == default.largest_unit_rows
    # Small blocks: a unit task receives its own rows, never a whole route or corpus.
    assert small.largest_block_rows < ROWS_PER_UNIT == small.largest_unit_rows


def test_manifest_lists_each_routes_files_by_corpus_then_row_with_their_row_spans(
    two_splits: TwoSplits,
) -> None:
    result = two_splits.default
    manifest, shards = result.manifest, ShardSet.open(result.root, verify=True)
    order = [corpus.corpus_id for corpus in manifest.corpora]
    seen: set[tuple[str, int]] = set()
    groups = [(route.files, route.rows) for route in manifest.routes if route.rows]
    groups += [(files, manifest.corpus(corpus).holdout_rows) for corpus, files in manifest.holdout.items()]
    for files, expected_rows in groups:
        assert files == sorted(files, key=lambda f: (order.index(f.corpus or ""), f.first_row))
        assert sum(file.rows for file in files) == expected_rows
        for file in files:
            table = pq.read_table(result.root / file.path, columns=["_corpus", "_row"])
            numbers = table.column("_row").to_pylist()
            assert set(table.column("_corpus").to_pylist()) == {file.corpus}
            assert numbers == sorted(numbers) and len(numbers) == file.rows
            assert (numbers[0], numbers[-1]) == (file.first_row, file.last_row)
            assert numbers[0] // ROWS_PER_UNIT == numbers[-1] // ROWS_PER_UNIT  # one unit per file
            assert pq.ParquetFile(result.root / file.path).metadata.row_group(0).num_rows <= ROW_GROUP_ROWS
            seen.update((file.corpus or "", number) for number in numbers)
    assert len(seen) == sum(corpus.rows for corpus in manifest.corpora)  # every row exactly once
    for route in manifest.routes:  # route_table still reads a route whole, in shard order
        if route.rows:
            table = shards.route_table(route.route, ["_corpus", "_row"])
            assert table.num_rows == route.rows
            corpora = table.column("_corpus").to_pylist()
            assert {c: corpora.count(c) for c in order if c in corpora} == route.corpus_counts


def test_files_are_snappy_but_the_row_hashes_and_their_digests_are_the_bytes_on_disk(
    two_splits: TwoSplits,
) -> None:
    """Each file's column chunks: ``_row_hash`` stored uncompressed (raw digests: uniform bytes), every
    other column snappy; the manifest's sha256 of each file is that of the bytes on disk."""
    manifest, root = two_splits.default.manifest, two_splits.default.root
    files = [file for route in manifest.routes for file in route.files]
    files += [file for group in manifest.holdout.values() for file in group]
    for file in files:
        assert file.sha256 == hashlib.sha256((root / file.path).read_bytes()).hexdigest()
        metadata = pq.ParquetFile(root / file.path).metadata
        for group in range(metadata.num_row_groups):
            chunks = [metadata.row_group(group).column(c) for c in range(metadata.num_columns)]
            codecs = {chunk.path_in_schema: chunk.compression for chunk in chunks}
            assert codecs.pop("_row_hash") == "UNCOMPRESSED"
            assert set(codecs.values()) == {"SNAPPY"}


def brute_force(shards: ShardSet) -> dict[tuple[str, int], tuple[str, str | None, int]]:
    """(corpus, row) → (split, route, position), from every row of every route and holdout."""
    found: dict[tuple[str, int], tuple[str, str | None, int]] = {}
    for route in shards.manifest.routes:
        if route.rows:
            table = shards.route_table(route.route, ["_corpus", "_row"])
            keys = zip(table["_corpus"].to_pylist(), table["_row"].to_pylist(), strict=True)
            for position, key in enumerate(keys):
                found[key] = ("train", route.route, position)
    for corpus in shards.manifest.holdout:
        for position, row in enumerate(shards.holdout_table(corpus, ["_row"])["_row"].to_pylist()):
            found[corpus, row] = ("holdout", None, position)
    return found


def sample_rows(manifest: ShardManifest) -> list[tuple[str, int]]:
    """First and last rows of every file, unit boundaries, ends of corpora, and random rows."""
    files = [file for route in manifest.routes for file in route.files]
    files += [file for group in manifest.holdout.values() for file in group]
    chosen = {
        (file.corpus or "", row)
        for file in files
        for row in (file.first_row, file.last_row)
        if row is not None
    }
    generator = random.Random(0)
    for corpus in manifest.corpora:
        ends = [0, ROWS_PER_UNIT - 1, ROWS_PER_UNIT, corpus.rows - 1]
        chosen.update((corpus.corpus_id, row) for row in ends + generator.sample(range(corpus.rows), 150))
    return sorted(chosen)


def test_locate_finds_every_sampled_row_where_a_scan_of_every_file_does(two_splits: TwoSplits) -> None:
    shards = ShardSet.open(two_splits.small.root)
    expected = brute_force(shards)
    sampled = sample_rows(shards.manifest)
    splits = set()
    for corpus, row in sampled:
        found = shards.locate(corpus, row)
        assert (found.split, found.route, found.position) == expected[corpus, row], (corpus, row)
        held = pq.read_table(shards.root / found.file.path, columns=["_row"])["_row"][found.index].as_py()
        assert held == row and found.file.corpus == corpus
        splits.add((found.split, found.route))
    assert {("holdout", None), ("train", "public"), ("train", "licensed"), ("train", "pii")} <= splits


def test_locate_refuses_a_row_out_of_range_or_an_unknown_corpus(two_splits: TwoSplits) -> None:
    shards = ShardSet.open(two_splits.default.root)
    with pytest.raises(IngestError, match=rf"corpus 'second' has {SECOND_ROWS} rows \(0..69999\) in shards"):
        shards.locate("second", SECOND_ROWS)
    with pytest.raises(IngestError, match=r"there is no row -1"):
        shards.locate("first", -1)
    with pytest.raises(IngestError, match=r"have no corpus 'third'"):
        shards.locate("third", 0)


def test_shards_store_repeated_columns_as_dictionaries_and_hashes_as_raw_bytes(two_splits: TwoSplits) -> None:
    """``_corpus``, ``_route`` and ``_credential`` are dictionary columns (each dictionary the values
    of the file's rows), ``_row_hash`` 32 raw bytes."""
    shards = ShardSet.open(two_splits.default.root)
    files = [file for route in shards.manifest.routes for file in route.files]
    files += [file for group in shards.manifest.holdout.values() for file in group]
    assert files
    for file in files:
        table = pq.read_table(shards.root / file.path)
        assert table.schema.field("_row_hash").type == pa.binary(32)
        for column in ("_corpus", "_route", "_credential"):
            assert pa.types.is_dictionary(table.schema.field(column).type)
            chunks = table[column].chunks
            assert all(len(chunk.dictionary) == len(set(chunk.to_pylist())) for chunk in chunks), column


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"format_version": 3},
            r"shard format 3 is not the one this govray reads \(4\): ingest the corpora again",
        ),
        ({"format_version": 1}, r"shard format 1 is not the one this govray reads \(4\)"),
        ({"row_hash_version": 1}, r"row hash version 1: this govray computes row hash version 2"),
        (
            {"row_hash_version": None},
            r"no row hash version \(shards from before govray 1.0\): this govray computes",
        ),
    ],
)
def test_a_manifest_of_another_format_or_row_hash_is_refused_with_both_versions_named(
    two_splits: TwoSplits, tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    """One data format at release: the pre-release shard formats and row hash are refused, never
    read another way."""
    root = tmp_path / "shards"
    shutil.copytree(two_splits.default.root, root)
    manifest = json.loads((root / MANIFEST).read_text())
    assert (manifest["format_version"], manifest["row_hash_version"]) == (4, 2)
    manifest.update(edit)
    manifest = {name: value for name, value in manifest.items() if value is not None}
    (root / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(IngestError, match=f"shard manifest {root / MANIFEST}: .*{message}"):
        ShardSet.open(root)


def test_a_bad_row_in_the_last_unit_of_the_second_corpus_is_refused_and_leaves_nothing(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    second = rows(SECOND_ROWS)
    second[-1] = {**second[-1], "lic": "copyleft", "sens": "public"}  # matches no rule
    write_corpus(tmp_path / "first.csv", rows(1000))
    corpora = [
        corpus_spec("first", "first.csv", credential_columns=COLUMNS),
        corpus_spec("second", "second.jsonl", credential_columns=COLUMNS),
    ]
    write_corpus(tmp_path / "second.jsonl", second)
    config, policy = verified(build(tmp_path, authority_key, trust_file, corpora))
    last = SECOND_ROWS - 1
    with pytest.raises(PolicyError, match=rf"corpus 'second' \(row {last}\) matches no rule") as refused:
        ingest(config, policy)
    assert str(refused.value).endswith(f"(at {tmp_path / 'second.jsonl'} row {last} (line {last + 1}))")
    assert not list((Path(config.storage_path) / "shards").rglob("*")), "a refused ingest leaves no files"


def test_unit_pieces_cover_each_unit_exactly_with_the_blocks_that_hold_it() -> None:
    generator = random.Random(1)
    for _ in range(200):
        sizes = [generator.choice([0, 1, 3, 7, 10, 25]) for _ in range(generator.randint(1, 12))]
        units = unit_pieces(sizes, unit_rows=8)
        starts = [sum(sizes[:block]) for block in range(len(sizes))]
        covered = [
            [starts[b] + r for b, start, stop in pieces for r in range(start, stop)] for pieces in units
        ]
        assert covered == [list(range(u * 8, min((u + 1) * 8, sum(sizes)))) for u in range(len(units))]
        assert all(start < stop for pieces in units for _, start, stop in pieces)
