"""The reproducibility record: exact versions, the trial's code, corpora kept by content, drift."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from govray.config.data import CorpusFormat, CorpusSpec
from govray.config.experiment import load_experiment
from govray.core.canonical import file_sha256
from govray.data.fingerprint import corpus_files, fingerprint_files
from govray.tracking.drift import FingerprintChange, changed_corpora
from govray.tracking.store import TrackingStore
from govray.train.reproduce.record import (
    DETERMINISM_VARIABLES,
    ReproducibilityRecord,
    build_record,
    capture_environment,
)
from govray.train.reproduce.snapshots import (
    ReproducibilityError,
    code_digest,
    snapshot_corpus,
    snapshot_trial_code,
    verify_corpus_snapshot,
)
from tests.helpers.builders import BASE_CREDENTIAL, REPO, table_rows, write_corpus

DIGITS_TRIAL = "jobs.examples.digits.trial:DigitsTrial"


def corpus_spec(corpus_id: str, path: Path) -> CorpusSpec:
    return CorpusSpec(id=corpus_id, path=path, credential=BASE_CREDENTIAL)


def snapshot_dirs(storage: Path) -> list[str]:
    return sorted(entry.name for entry in (storage / "corpora").iterdir())


def test_environment_records_exact_versions_and_every_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")

    environment = capture_environment()

    assert environment.torch == torch.__version__
    assert environment.ray == ray.__version__
    assert environment.python == ".".join(map(str, sys.version_info[:3]))
    assert environment.packages["torch"] == torch.__version__
    assert list(environment.packages) == sorted(environment.packages)
    assert environment.torch_threads == torch.get_num_threads()
    assert environment.env["OMP_NUM_THREADS"] == "3"
    assert set(environment.env) <= set(DETERMINISM_VARIABLES) - {"MKL_NUM_THREADS"}
    json.loads(environment.model_dump_json())  # JSON-able


def test_code_snapshot_copies_the_trial_package_importably_with_recomputable_digests(tmp_path: Path) -> None:
    snapshot = snapshot_trial_code(DIGITS_TRIAL, tmp_path / "code")

    assert snapshot.module == "jobs.examples.digits.trial"
    assert {
        "jobs/__init__.py",
        "jobs/examples/__init__.py",
        "jobs/examples/digits/__init__.py",
        "jobs/examples/digits/trial.py",
        "jobs/examples/digits/make_corpora.py",
    } <= set(snapshot.files)
    assert not any(path.startswith("jobs/examples/digits/data/") for path in snapshot.files)
    for relative, digest in snapshot.files.items():
        copied = tmp_path / "code" / relative
        assert copied.read_bytes() == (REPO / relative).read_bytes()
        assert file_sha256(copied) == digest
    assert snapshot.digest == code_digest(snapshot.files)


def test_a_trial_module_without_source_is_refused(tmp_path: Path) -> None:
    from govray.train import trial as trial_module

    compiled = type("CompiledTrial", (trial_module.Trial,), {})
    module = type(sys)("compiled_trial_module")  # a module with no file behind it
    module.CompiledTrial = compiled  # type: ignore[attr-defined]
    sys.modules["compiled_trial_module"] = module
    try:
        with pytest.raises(ReproducibilityError, match="compiled_trial_module.*no Python source"):
            snapshot_trial_code("compiled_trial_module:CompiledTrial", tmp_path / "code")
    finally:
        del sys.modules["compiled_trial_module"]


def test_corpus_snapshots_are_content_addressed_and_copied_once(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    path = write_corpus(tmp_path / "data" / "news.jsonl", table_rows(20))

    first = snapshot_corpus(corpus_spec("news", path), storage)
    stored = storage / "corpora" / first.fingerprint / "news.jsonl"
    written_at = stored.stat().st_mtime_ns
    second = snapshot_corpus(corpus_spec("news", path), storage)

    assert first == second
    assert first.copied and first.bytes == path.stat().st_size
    assert first.fingerprint == fingerprint_files(corpus_files(path, "jsonl", corpus_id="news"))
    assert snapshot_dirs(storage) == [first.fingerprint]  # no staging directory left behind
    assert stored.read_bytes() == path.read_bytes()
    assert stored.stat().st_mtime_ns == written_at  # not copied again
    verify_corpus_snapshot(first)


def test_a_changed_byte_gets_a_new_snapshot_and_keeps_the_old_one(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    path = write_corpus(tmp_path / "data" / "news.jsonl", table_rows(20))
    before = snapshot_corpus(corpus_spec("news", path), storage)

    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    after = snapshot_corpus(corpus_spec("news", path), storage)

    assert after.fingerprint != before.fingerprint
    assert snapshot_dirs(storage) == sorted([before.fingerprint, after.fingerprint])
    verify_corpus_snapshot(before)  # the recorded bytes are still there for a replay
    verify_corpus_snapshot(after)


def test_a_directory_corpus_keeps_its_layout_and_fingerprint(tmp_path: Path) -> None:
    corpus = tmp_path / "data" / "shards"
    write_corpus(corpus / "a" / "part-0.csv", table_rows(5))
    write_corpus(corpus / "part-1.csv", table_rows(5, start=5))
    (corpus / "README.md").write_text("not part of the corpus")
    spec = CorpusSpec(id="shards", path=corpus, format=CorpusFormat.CSV, credential=BASE_CREDENTIAL)

    snapshot = snapshot_corpus(spec, tmp_path / "storage")

    stored = tmp_path / "storage" / "corpora" / snapshot.fingerprint
    assert sorted(p.relative_to(stored).as_posix() for p in stored.rglob("*") if p.is_file()) == [
        "a/part-0.csv",
        "part-1.csv",
    ]
    verify_corpus_snapshot(snapshot)


def test_a_corpus_too_large_to_copy_is_recorded_by_uri_and_a_changed_row_is_detected(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    path = write_corpus(tmp_path / "data" / "crawl.csv", table_rows(50))

    snapshot = snapshot_corpus(corpus_spec("crawl", path), storage, max_copy_bytes=100)

    assert not snapshot.copied
    assert snapshot.uri == path.resolve().as_uri()
    assert not (storage / "corpora").exists()
    verify_corpus_snapshot(snapshot)

    lines = path.read_text().splitlines(keepends=True)
    lines[7] = lines[7].replace("row", "ROW")
    path.write_text("".join(lines))
    with pytest.raises(ReproducibilityError, match="corpus 'crawl'.*changed"):
        verify_corpus_snapshot(snapshot)
    path.unlink()
    with pytest.raises(ReproducibilityError, match="corpus 'crawl'.*gone"):
        verify_corpus_snapshot(snapshot)


def test_the_record_holds_seed_config_code_environment_and_every_corpus(example_copy: Path) -> None:
    config = load_experiment(example_copy)
    storage = Path(config.storage_path)

    record = build_record(config, storage, config_digest="c0ffee", threads=2)

    assert record.seed == config.seed == 7
    assert record.config == config.model_dump(mode="json")
    assert (record.config_digest, record.threads) == ("c0ffee", 2)
    assert sorted(p.name for p in (storage / "code").iterdir()) == [record.code.digest]
    code_dir = storage / "code" / record.code.digest
    assert all(file_sha256(code_dir / rel) == digest for rel, digest in record.code.files.items())
    assert [c.corpus_id for c in record.corpora] == [spec.id for spec in config.data.corpora]
    for corpus in record.corpora:
        verify_corpus_snapshot(corpus)
    again = ReproducibilityRecord.model_validate_json(record.model_dump_json())
    assert again == record
    assert build_record(config, storage, config_digest="c0ffee", threads=2).code == record.code


def record_run(store: TrackingStore, name: str, fingerprints: dict[str, str]) -> int:
    experiment = store.create_experiment(name, "{}", "digest", "/storage")
    assert experiment.id is not None
    rows: list[dict[str, Any]] = [
        {
            "corpus_id": corpus_id,
            "role": "train",
            "fingerprint": fingerprint,
            "rows": 10,
            "train_rows": 9,
            "holdout_rows": 1,
            "credential_json": "{}",
            "route_counts_json": "{}",
        }
        for corpus_id, fingerprint in fingerprints.items()
    ]
    store.record_corpora(experiment.id, rows)
    return experiment.id


def test_rerunning_with_one_changed_corpus_names_exactly_that_corpus(store: TrackingStore) -> None:
    record_run(store, "digits", {"public": "aaa", "licensed": "bbb", "writers": "ccc"})
    record_run(store, "digits", {"public": "aaa", "licensed": "bbb", "writers": "ddd"})
    record_run(store, "other", {"public": "zzz"})
    store.create_experiment("digits", "{}", "digest", "/storage")  # the new run, nothing recorded yet

    now = {"public": "aaa", "licensed": "b2b", "writers": "ddd", "new-corpus": "eee"}

    assert changed_corpora(store, "digits", now) == [FingerprintChange("licensed", "bbb", "b2b")]
    assert changed_corpora(store, "digits", {"public": "aaa", "licensed": "bbb", "writers": "ddd"}) == []
    assert changed_corpora(store, "never-ran", now) == []


def test_the_current_run_can_be_excluded_once_it_recorded_its_corpora(store: TrackingStore) -> None:
    record_run(store, "digits", {"public": "aaa"})
    current = record_run(store, "digits", {"public": "abc"})

    assert changed_corpora(store, "digits", {"public": "abc"}, excluding=current) == [
        FingerprintChange("public", "aaa", "abc")
    ]
