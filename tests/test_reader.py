"""Reads follow the schedule: a worker reads rows by position, touching (fetching, checking) only
the files and row groups its slots name, with a cache bounded in bytes; and a governed run whose
reads follow the schedule is bit-identical to one that loaded every row, its ledger equal to the
rows it read."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from govray.core.canonical import file_sha256, sha256_hex
from govray.core.errors import IngestError
from govray.data.shard_reader import ShardReader, evaluation_rows
from govray.data.shards import MANIFEST, ShardSet
from govray.data.slots import Slot, slot
from govray.train.checkpoints.files import find_checkpoints
from govray.train.context import WorkerContext
from govray.train.parallel.worker import Worker, by_row_hash, lowest_hashes, without_rows
from govray.train.runspec import RunSpec
from govray.train.step.governed import GovernedStep
from govray.train.trial import make_trial
from tests.helpers.golden import GoldenRun
from tests.helpers.routing import routes_updating

FILES, ROWS_PER_FILE, ROWS_PER_GROUP = 4, 50, 10


def synthetic_shards(root: Path) -> ShardSet:
    """One route over ``FILES`` files of two corpora, row groups of ``ROWS_PER_GROUP`` rows."""
    files, corpus_counts = [], {"a": 0, "b": 0}
    for index in range(FILES):
        corpus = "a" if index < 2 else "b"
        first = corpus_counts[corpus]
        numbers = list(range(first, first + ROWS_PER_FILE))
        table = pa.table(
            {
                "x": [float(index * 1000 + n) for n in numbers],
                "_corpus": [corpus] * ROWS_PER_FILE,
                "_row": numbers,
                "_row_hash": [sha256_hex(f"{corpus}-{n}".encode()) for n in numbers],
                "_route": ["public"] * ROWS_PER_FILE,
                "_credential": ["{}"] * ROWS_PER_FILE,
            }
        )
        corpus_counts[corpus] += ROWS_PER_FILE
        path = root / "train" / "public" / f"part-{index:05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=ROWS_PER_GROUP)
        files.append(
            {"path": f"train/public/{path.name}", "rows": ROWS_PER_FILE, "sha256": file_sha256(path)}
        )
    manifest = {
        "key": "synthetic",
        "policy_name": "p",
        "policy_version": 1,
        "policy_digest": "0" * 64,
        "holdout_fraction": 0.0,
        "row_hash_version": 2,
        "corpora": [],
        "routes": [
            {"route": "public", "rows": FILES * ROWS_PER_FILE, "corpus_counts": corpus_counts, "files": files}
        ],
    }
    (root / MANIFEST).write_text(json.dumps(manifest))
    return ShardSet.open(root)


def whole(shards: ShardSet) -> pa.Table:
    return pa.concat_tables(
        pq.read_table(shards.root / f.path) for f in shards.manifest.route("public").files
    )


def test_take_gives_the_rows_at_the_positions_in_their_order_across_files_and_row_groups(
    tmp_path: Path,
) -> None:
    shards = synthetic_shards(tmp_path)
    reader = ShardReader(shards)
    rng = np.random.default_rng(3)
    everything = whole(shards)
    for size in (1, 7, 64, 400):
        positions = rng.integers(0, FILES * ROWS_PER_FILE, size)  # repeats allowed
        assert reader.take("public", positions).equals(everything.take(pa.array(positions)))
    assert reader.take("public", []).num_rows == 0
    with pytest.raises(IngestError, match="outside the 200 rows"):
        reader.take("public", [200])


def test_only_the_files_a_read_touches_are_checked_and_a_tampered_one_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    shards = synthetic_shards(tmp_path)
    last = shards.root / shards.manifest.route("public").files[-1].path
    last.write_bytes(last.read_bytes()[:-20] + bytes(20))  # the last file changed on disk
    reader = ShardReader(shards)
    reader.take("public", [0, 5, 60, 149])  # files 0, 1 and 2 only
    assert sorted(reader._verified) == [f.path for f in shards.manifest.route("public").files[:3]]
    with pytest.raises(IngestError, match=f"shard file {last} does not match its digest in the manifest"):
        reader.take("public", [150])


def test_the_row_group_cache_stays_within_its_bytes(tmp_path: Path) -> None:
    shards = synthetic_shards(tmp_path)
    group_bytes = (
        pq.read_table(shards.root / shards.manifest.route("public").files[0].path).slice(0, 10).nbytes
    )
    reader = ShardReader(shards, cache_bytes=3 * group_bytes)
    for start in range(0, FILES * ROWS_PER_FILE, ROWS_PER_GROUP):  # every row group once
        reader.take("public", [start])
        assert reader._cached <= 4 * group_bytes
    assert len(reader._groups) <= 4


def test_the_lowest_hash_sample_equals_sorting_the_whole_corpus(tmp_path: Path) -> None:
    shards = synthetic_shards(tmp_path)
    reader = ShardReader(shards)
    everything = whole(shards)
    for corpus in ("a", "b"):
        mine = everything.filter(pa.compute.equal(everything.column("_corpus"), corpus))
        for count, excluded in ((5, set()), (30, {3, 17, 99}), (500, {0})):
            expected = without_rows(by_row_hash(mine), excluded).slice(0, count)
            found = lowest_hashes(reader, [reader.route_files("public")], corpus, count, excluded)
            assert found.equals(expected)


def test_a_validation_reads_at_most_eval_rows_evenly_spaced_positions() -> None:
    assert evaluation_rows(5, 10).tolist() == [0, 1, 2, 3, 4]
    spread = evaluation_rows(10**9, 1000)
    assert len(spread) == 1000 and len(set(spread.tolist())) == 1000
    assert spread[0] == 0 and spread[-1] < 10**9 and np.all(np.diff(spread) >= 10**6 - 1)


class WholeTables:
    """What a worker did before reads followed the schedule: every route loaded whole."""

    def __init__(self, shards: ShardSet) -> None:
        self.tables = {r.route: shards.route_table(r.route) for r in shards.manifest.routes if r.rows}

    def take(self, slot: Slot) -> pa.Table:
        if slot.route is None or slot.empty:
            return next(iter(self.tables.values())).slice(0, 0)
        return self.tables[slot.route].take(pa.array(slot.rows, type=pa.int64()))


def test_reads_that_follow_the_schedule_train_bit_identically_to_loading_everything_and_the_ledger_counts_the_rows_read(  # noqa: E501
    golden_run: GoldenRun,
) -> None:
    spec = RunSpec.model_validate_json(
        (find_checkpoints(golden_run.outcome.run_dir)[-1] / "run.json").read_text()
    )
    weights, seen = [], []
    for loader in ("schedule", "everything"):
        trial = make_trial(spec.trial, spec.hparams, spec.settings)
        governed = GovernedStep(WorkerContext.of(spec, Worker(0, 1)), trial)
        take = WholeTables(governed.shards).take if loader == "everything" else governed.rows.take
        read: Counter[tuple[str, str]] = Counter()

        def counted(wanted: Slot, take=take, read=read) -> pa.Table:
            rows = take(wanted)
            read.update(
                zip(rows.column("_corpus").to_pylist(), rows.column("_route").to_pylist(), strict=True)
            )
            return rows

        governed.batches._take = counted  # the prefetcher's reads, counted
        for step in range(spec.max_steps):
            governed.step(step)
        governed.batches.close()
        weights.append({name: tensor.clone() for name, tensor in governed.model.state_dict().items()})
        seen.append(read)
        for (corpus, tensor), entry in governed.ledger.entries.items():
            routes = routes_updating(governed, tensor)
            assert entry.examples == sum(
                n for (c, route), n in read.items() if c == corpus and route in routes
            )
        assert {corpus for corpus, _ in read} == set(governed.ledger.corpora())
    scheduled = sum(len(slot(governed.schedule, step, 0).rows) for step in range(spec.max_steps))
    assert seen[0] == seen[1] and sum(seen[0].values()) == scheduled
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
