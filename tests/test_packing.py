"""The packed token store: windows of one route and one corpus, exact example and token counts,
every row kept in order, long rows cut into chunks, byte-identical rebuilds, digests checked,
random access without memory that grows with the corpus, and row lookup by binary search."""

from __future__ import annotations

import json
import random
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from govray.config.experiment import load_experiment
from govray.core.canonical import file_sha256
from govray.core.errors import ConfigError, IngestError
from govray.core.keys import load_trust
from govray.data.ingest import ingest
from govray.data.packed import PackedStore
from govray.data.packing import pack_shards
from govray.data.schedule import ScheduleSpec
from govray.data.shards import MANIFEST, ShardFile, ShardSet
from govray.data.slots import slot
from govray.governance.policy import load_verified_policy
from govray.platform.run.preflight import config_digest
from govray.train.trial import defines_tokenize
from jobs.examples.digits.trial import DigitsTrial
from jobs.examples.text.trial import CharTransformerTrial
from tests.helpers.builders import text_experiment, write_corpus

pytestmark = pytest.mark.usefixtures("ray_session")

SEQ_LEN = 160  # the text corpora's rows have up to 128 characters: one or two per window
SHORT = 48  # most rows are longer: cut into chunks
TOKENIZER = "text-trial-characters"
LONG_ROWS = 4000
SPLIT_ROWS = 700  # rows per shard file in the split shard set


tokenize = CharTransformerTrial({}).tokenize  # the text example's own: a character per token


def long_texts() -> list[str]:
    """Rows of 0 to 400 characters (empty ones and exact multiples of SHORT among them)."""
    generator = random.Random(18)
    lengths = [0, 1, SHORT - 1, SHORT, SHORT + 1, 2 * SHORT, 0, 3 * SHORT + 5, SEQ_LEN, SEQ_LEN + 1]
    lengths += [generator.randrange(0, 401) for _ in range(LONG_ROWS - len(lengths))]
    return ["".join(generator.choice("abcdefgh ") for _ in range(length)) for length in lengths]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> ShardSet:
    """The text example's three corpora plus a permissive corpus of rows of every length, which
    shares the `public` route with the prose (two corpora in one route)."""
    root = tmp_path_factory.mktemp("packing")
    raw = text_experiment(root)
    write_corpus(root / "long.jsonl", [{"text": text} for text in long_texts()])
    raw["data"]["corpora"].append(
        {**raw["data"]["corpora"][0], "id": "text-long", "path": str(root / "long.jsonl")}
    )
    (root / "experiment.yaml").write_text(yaml.safe_dump(raw))
    config = load_experiment(root / "experiment.yaml")
    assert config.policy.trust is not None
    policy = load_verified_policy(
        config.policy.file, config.policy.signature_path, load_trust(config.policy.trust)
    )
    result = ingest(config, policy)
    assert result.manifest.route("public").corpus_counts.keys() == {"text-public", "text-long"}
    return ShardSet.open(result.root)


@pytest.fixture(scope="module")
def store(shards: ShardSet) -> PackedStore:
    return pack_shards(shards, seq_len=SEQ_LEN, tokenize=tokenize, tokenizer=TOKENIZER)


@pytest.fixture(scope="module")
def short(shards: ShardSet) -> PackedStore:
    return pack_shards(shards, seq_len=SHORT, tokenize=tokenize, tokenizer=TOKENIZER)


def route_rows(shards: ShardSet, route: str) -> tuple[list[str], list[int], list[list[int]]]:
    """Each training row of ``route`` in shard order: its corpus, ``_row`` and tokens."""
    table = shards.route_table(route)
    return table["_corpus"].to_pylist(), table["_row"].to_pylist(), tokenize(table)


def everything(store: PackedStore, route: str) -> pa.Table:
    return store.take(route, np.arange(store.layout(route).rows))


@pytest.fixture(scope="module")
def split(shards: ShardSet, tmp_path_factory: pytest.TempPathFactory) -> ShardSet:
    """The same rows with each route's file cut into files of SPLIT_ROWS rows (a file may hold
    two corpora, or part of one): windows never cross files."""
    root = tmp_path_factory.mktemp("split")
    routes = []
    for route in shards.manifest.routes:
        table = shards.route_table(route.route) if route.rows else None
        files = []
        for number, start in enumerate(range(0, route.rows, SPLIT_ROWS)):
            path = root / "train" / route.route / f"part-{number:05d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            assert table is not None
            pq.write_table(table.slice(start, SPLIT_ROWS), path)
            files.append(
                ShardFile(
                    path=str(path.relative_to(root)),
                    rows=min(SPLIT_ROWS, route.rows - start),
                    sha256=file_sha256(path),
                )
            )
        routes.append(route.model_copy(update={"files": files}))
    manifest = shards.manifest.model_copy(
        update={"key": f"{shards.manifest.key[:60]}spli", "routes": routes, "holdout": {}}
    )
    (root / MANIFEST).write_text(manifest.to_json())
    return ShardSet.open(root, verify=True)


@pytest.fixture(scope="module")
def packings(
    shards: ShardSet, split: ShardSet, store: PackedStore, short: PackedStore
) -> list[tuple[ShardSet, PackedStore]]:
    """Each store with the shard set it packs: one file per route at two lengths, and many files."""
    cut = pack_shards(split, seq_len=SHORT, tokenize=tokenize, tokenizer=TOKENIZER)
    assert all(len(route.parts) > 1 for route in cut.manifest.routes if route.parts)
    return [(shards, store), (shards, short), (split, cut)]


def test_a_window_holds_one_route_and_one_corpus_and_at_most_seq_len_tokens(
    packings: list[tuple[ShardSet, PackedStore]],
) -> None:
    for shards, packed in packings:
        for route in shards.manifest.routes:
            layout = packed.layout(route.route)
            windows = everything(packed, route.route)
            assert set(windows["_route"].to_pylist()) <= {route.route}
            # Each corpus a contiguous range, in the manifest's order: the schedule's layout holds.
            positions = np.arange(layout.rows)
            assert windows["_corpus"].to_pylist() == list(layout.corpora_of(positions))
            order = [
                corpus.corpus_id
                for corpus in shards.manifest.corpora
                if corpus.corpus_id in route.corpus_counts
            ]
            assert [corpus for corpus, _ in layout.corpus_counts] == order
            assert max(windows["tokens"].to_pylist()) <= packed.seq_len


def test_examples_and_tokens_per_corpus_and_route_are_exact(
    packings: list[tuple[ShardSet, PackedStore]],
) -> None:
    for shards, packed in packings:
        for route in shards.manifest.routes:
            corpora, _, tokens = route_rows(shards, route.route)
            layout = packed.layout(route.route)
            positions = np.arange(layout.rows)
            of = np.asarray(layout.corpora_of(positions))
            examples, counted = packed.examples(route.route, positions), packed.tokens(route.route, positions)
            for corpus, rows in route.corpus_counts.items():
                assert int(examples[of == corpus].sum()) == rows
                expected = sum(len(ids) for ids, name in zip(tokens, corpora, strict=True) if name == corpus)
                assert int(counted[of == corpus].sum()) == expected


def by_hand(shards: ShardSet, route: str, seq_len: int) -> list[tuple[str, int, int, int]]:
    """The windows of ``route`` by the rules, applied here row by row: (corpus, ``_row`` of the
    first row, tokens, rows starting)."""
    corpora, row_numbers, tokens = route_rows(shards, route)
    file_starts = set(np.cumsum([0, *(file.rows for file in shards.manifest.route(route).files)]).tolist())
    windows: list[list[Any]] = []
    open_window: list[Any] | None = None
    for index, (corpus, number, ids) in enumerate(zip(corpora, row_numbers, tokens, strict=True)):
        if open_window and (
            index in file_starts or open_window[0] != corpus or open_window[2] + len(ids) > seq_len
        ):
            open_window = None
        if len(ids) <= seq_len:  # joins the open window, or opens one
            if open_window is None:
                open_window = [corpus, number, 0, 0]
                windows.append(open_window)
            open_window[2] += len(ids)
            open_window[3] += 1
            continue
        chunks: list[list[Any]] = [
            [corpus, number, len(ids[start : start + seq_len]), int(start == 0)]
            for start in range(0, len(ids), seq_len)
        ]
        windows += chunks  # longer: one window per seq_len chunk; a short last one stays open
        open_window = chunks[-1] if chunks[-1][2] < seq_len else None
    return [(corpus, row, count, rows) for corpus, row, count, rows in windows]


def test_windows_are_the_rows_in_shard_order_packed_greedily(
    packings: list[tuple[ShardSet, PackedStore]],
) -> None:
    for shards, packed in packings:
        for route in shards.manifest.routes:
            _, _, tokens = route_rows(shards, route.route)
            windows = everything(packed, route.route)
            counts = windows["tokens"].to_pylist()
            ids = windows["input_ids"].to_pylist()
            # No token lost, none added, none moved: the windows give back the rows in order.
            assert [t for window, n in zip(ids, counts, strict=True) for t in window[:n]] == [
                token for row in tokens for token in row
            ]
            found = zip(
                windows["_corpus"].to_pylist(),
                windows["_row"].to_pylist(),
                counts,
                windows["_rows"].to_pylist(),
                strict=True,
            )
            assert list(found) == by_hand(shards, route.route, packed.seq_len)


def test_rows_longer_than_seq_len_are_cut_into_chunks_and_counted_once(
    shards: ShardSet, short: PackedStore
) -> None:
    corpora, row_numbers, tokens = route_rows(shards, "public")
    long_rows = [row for row in zip(corpora, row_numbers, tokens, strict=True) if len(row[2]) > SHORT]
    assert len(long_rows) > 100
    for corpus, row, ids in long_rows[:200]:
        found = short.locate(corpus, row)
        assert len(found) == -(-len(ids) // SHORT)
        windows = short.take("public", np.asarray([position for _, position in found]))
        assert windows["tokens"].to_pylist()[:-1] == [SHORT] * (len(found) - 1)
        chunks = [
            w[:n]
            for w, n in zip(windows["input_ids"].to_pylist(), windows["tokens"].to_pylist(), strict=True)
        ]
        assert [token for chunk in chunks for token in chunk][: len(ids)] == ids
        assert windows["_row"].to_pylist() == [row] * len(found)
        assert windows["_rows"][0].as_py() >= 1 and windows["_rows"].to_pylist()[1:-1] == [0] * (
            len(found) - 2
        )


def test_locate_equals_a_brute_force_search(
    packings: list[tuple[ShardSet, PackedStore]], shards: ShardSet, store: PackedStore
) -> None:
    for source, packed in packings:
        for route in source.manifest.routes:
            corpora, row_numbers, tokens = route_rows(source, route.route)
            counts = everything(packed, route.route)["tokens"].to_numpy()
            starts, ends = np.cumsum(counts) - counts, np.cumsum(counts)  # each window's tokens in the route
            position = 0
            for corpus, number, row in zip(corpora, row_numbers, tokens, strict=True):
                found = packed.locate(corpus, number)
                if row:  # every window sharing a token with the row
                    touched = np.flatnonzero((starts < position + len(row)) & (position < ends))
                    assert found == [(route.route, w) for w in touched.tolist()], (corpus, number)
                else:  # an empty row is counted in the window it was packed into
                    window = packed.take(route.route, np.asarray([position for _, position in found]))
                    assert window["_corpus"].to_pylist() == [corpus]
                position += len(row)
    holdout = shards.holdout_table("text-long")["_row"].to_pylist()
    assert holdout and all(store.locate("text-long", row) == [] for row in holdout)
    with pytest.raises(IngestError, match="has no corpus 'nobody'"):
        store.locate("nobody", 0)


def test_take_pads_every_window_to_seq_len_in_the_order_asked(store: PackedStore) -> None:
    positions = np.asarray([5, 0, 3, 3])
    table = store.take("licensed", positions, pad_id=127)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.column_names == ["input_ids", "tokens", "_corpus", "_row", "_rows", "_route"]
    one = store.take("licensed", positions[1:2])
    assert table.slice(1, 1).equals(store.take("licensed", positions[1:2], pad_id=127))
    for ids, count in zip(table["input_ids"].to_pylist(), table["tokens"].to_pylist(), strict=True):
        assert len(ids) == SEQ_LEN and ids[count:] == [127] * (SEQ_LEN - count) and 127 not in ids[:count]
    assert one["input_ids"][0].as_py()[one["tokens"][0].as_py() :] == [0] * (
        SEQ_LEN - one["tokens"][0].as_py()
    )
    assert table["tokens"].to_pylist() == store.tokens("licensed", positions).tolist()
    assert table["_rows"].to_pylist() == store.examples("licensed", positions).tolist()
    assert store.take("licensed", np.zeros(0, dtype=np.int64)).num_rows == 0
    windows = store.layout("licensed").rows
    with pytest.raises(IngestError, match=rf"route 'licensed' .* has {windows} windows"):
        store.take("licensed", np.asarray([windows]))


def test_the_schedule_reads_windows_as_it_read_rows(store: PackedStore) -> None:
    spec = ScheduleSpec(
        seed=3, world_size=2, batch_size=8, routes=store.layouts(), excluded_corpora=frozenset({"text-long"})
    )
    for step in range(spec.steps_per_epoch):
        for rank in range(2):
            mine = slot(spec, step, rank)
            if mine.route is not None and mine.rows:
                taken = store.take(mine.route, np.asarray(mine.rows))
                assert taken["_corpus"].to_pylist() == list(mine.corpora)
                assert "text-long" not in mine.corpora


def test_a_rebuild_is_byte_identical(shards: ShardSet, short: PackedStore) -> None:
    before = {
        path.relative_to(short.root): path.read_bytes() for path in short.root.rglob("*") if path.is_file()
    }
    again = pack_shards(shards, seq_len=SHORT, tokenize=tokenize, tokenizer=TOKENIZER, force=True)
    after = {
        path.relative_to(again.root): path.read_bytes() for path in again.root.rglob("*") if path.is_file()
    }
    assert again.root == short.root and after == before
    assert len(before) == 1 + 3 * sum(len(route.files) for route in shards.manifest.routes)
    assert not [path.name for path in short.root.parent.iterdir() if path.name.startswith(".")]  # no staging


def test_a_changed_byte_is_refused_naming_the_file(store: PackedStore, tmp_path: Path) -> None:
    copy = tmp_path / store.root.name
    shutil.copytree(store.root, copy)
    PackedStore.open(copy, verify=True)
    part = store.manifest.route("licensed").parts[0]
    path = copy / part.token_file.path
    data = bytearray(path.read_bytes())
    data[17] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IngestError, match=rf"{path} does not match its digest"):
        PackedStore.open(copy, verify=True)
    lazily = PackedStore.open(copy, verify="touched")  # a worker hashes the parts it reads
    lazily.take("public", np.asarray([0]))
    with pytest.raises(IngestError, match=rf"{path} does not match its digest"):
        lazily.take("licensed", np.asarray([0]))
    manifest = (copy / MANIFEST).read_text().replace(f'"seq_len": {SEQ_LEN}', '"seq_len": 99')
    (copy / MANIFEST).write_text(manifest)
    with pytest.raises(IngestError, match="the manifest was edited or moved"):
        PackedStore.open(copy)


@pytest.mark.parametrize("version", [0, 2, None])
def test_a_store_of_another_format_is_refused_naming_both_versions(
    store: PackedStore, tmp_path: Path, version: int | None
) -> None:
    copy = tmp_path / store.root.name
    shutil.copytree(store.root, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    assert manifest["format_version"] == 1
    manifest["format_version"] = version
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        IngestError, match=rf"packed store format {version!r} is not the one this govray reads \(1\)"
    ):
        PackedStore.open(copy)


def test_reader_memory_does_not_grow_with_the_corpus(store: PackedStore) -> None:
    stored = sum(path.stat().st_size for path in store.root.rglob("*") if path.is_file())
    assert stored > 5_000_000
    generator = np.random.default_rng(0)
    windows = store.layout("public").rows
    tracemalloc.start()
    try:
        opened = PackedStore.open(store.root)
        for _ in range(20):
            positions = generator.integers(0, windows, size=32)
            opened.take("public", positions)
            opened.tokens("public", positions)
        opened.locate("text-long", 1234)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 500_000, f"reading 32 windows held {peak} bytes at peak (the store has {stored})"


def test_a_trial_without_tokenize_is_refused_naming_it(shards: ShardSet) -> None:
    assert defines_tokenize(CharTransformerTrial) and not defines_tokenize(DigitsTrial)
    with pytest.raises(
        IngestError,
        match=r"tokenizing shard file .*/train/[a-z]+/text-[a-z]+-000000\.parquet rows 0\.\.[0-9]+ failed: "
        r"NotImplementedError: DigitsTrial does not define tokenize\(rows\), which data.packing needs",
    ):
        pack_shards(shards, seq_len=64, tokenize=DigitsTrial({}).tokenize, tokenizer="digits")
    assert not [path.name for path in (shards.root / "packed").iterdir() if path.name.startswith(".")]


# --- the experiment's data.packing ------------------------------------------------------------


def experiment(tmp_path: Path, packing: Any = None) -> Path:
    raw = text_experiment(tmp_path)
    if packing is not None:
        raw["data"]["packing"] = packing
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("packing", "message"),
    [
        ({"seq_len": 1}, r"data.packing.seq_len should be greater than or equal to 2"),
        ({}, r"data.packing.seq_len is required"),
        ({"seq_len": 64, "pad": 0}, r"data.packing: unknown field 'pad'"),
    ],
)
def test_packing_config_errors_name_the_field(tmp_path: Path, packing: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_experiment(experiment(tmp_path, packing))


def test_unset_packing_is_not_serialized_so_existing_digests_stay(tmp_path: Path) -> None:
    plain = load_experiment(experiment(tmp_path))
    assert plain.data.packing is None and "packing" not in plain.model_dump(mode="json")["data"]
    packed = load_experiment(experiment(tmp_path, {"seq_len": 256}))
    assert packed.data.packing is not None and packed.data.packing.seq_len == 256
    assert packed.model_dump(mode="json")["data"]["packing"] == {"seq_len": 256}
    assert config_digest(packed) != config_digest(plain)
    unpacked = packed.model_copy(update={"data": packed.data.model_copy(update={"packing": None})})
    assert config_digest(unpacked) == config_digest(plain)
