"""A governed run with ``storage_path: s3://...`` against a local S3-compatible server (moto's,
started here): shards, checkpoints, the run spec, TensorBoard files and attestations land in the
bucket; a driver killed after its first checkpoint is resumed on a node whose cache is empty
(everything comes back from the bucket) and ends bit-identical to the same run on local storage;
the attestation verifies against files downloaded from the bucket with boto3; GC deletes from the
bucket. `python -m pytest -m cluster tests/cluster/test_s3.py`."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from moto.server import ThreadedMotoServer

from govray.core.keys import platform_key, platform_trust
from govray.core.storage import StorageError, open_storage
from govray.provenance.verify import verify_attestation
from govray.tracking.lineage import attestations, checkpoints
from govray.tracking.store import TrackingStore
from tests.helpers.governed_job import (
    MODEL_FILES,
    digits_experiment,
    finished_run,
    kill_driver_when,
    query_one,
)
from tests.helpers.local_ray import LocalRayCluster
from tests.helpers.ports import free_port

pytestmark = pytest.mark.cluster

BUCKET = "govray-test"
PREFIX = "team/digits"
STEPS = 10


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 with one empty bucket."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Credentials and endpoint in the environment (the only place govray reads them), inherited
    by the Ray nodes and drivers this test starts; each node's cache under ``tmp_path``."""
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": s3_endpoint,
        "GOVRAY_CACHE": str(tmp_path / "node-cache"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    client = s3_client()
    client.create_bucket(Bucket=BUCKET)
    yield env
    objects = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
    for item in objects:
        client.delete_object(Bucket=BUCKET, Key=item["Key"])
    client.delete_bucket(Bucket=BUCKET)


def s3_client() -> Any:
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])


def bucket_keys() -> list[str]:
    paginator = s3_client().get_paginator("list_objects_v2")
    return [item["Key"] for page in paginator.paginate(Bucket=BUCKET) for item in page.get("Contents", [])]


def download(prefix: str, destination: Path) -> Path:
    """Every object below ``prefix``, with boto3 (not govray), into ``destination``."""
    client = s3_client()
    for key in bucket_keys():
        if key.startswith(prefix + "/") and not key.endswith("/"):  # not a directory marker
            target = destination / key[len(prefix) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(BUCKET, key, str(target))
    return destination


@pytest.fixture
def cluster(s3_env: dict[str, str]) -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster()
    cluster.start_head(num_cpus=2)
    cluster.wait_for_nodes(1)
    try:
        yield cluster
    finally:
        cluster.stop()
        assert cluster.leftover_processes() == []


def on_s3(experiment: Path, database: Path) -> Path:
    raw = yaml.safe_load(experiment.read_text())
    raw["storage_path"] = f"s3://{BUCKET}/{PREFIX}"
    raw["tracking"] = {"database": f"sqlite:///{database}"}  # required with remote storage
    experiment.write_text(yaml.safe_dump(raw, sort_keys=False))
    return experiment


def test_an_s3_run_checkpoints_resumes_from_the_bucket_and_attests(
    cluster: LocalRayCluster, s3_env: dict[str, str], tmp_path: Path
) -> None:
    # The reference: the same experiment on local storage, uninterrupted.
    reference = digits_experiment(tmp_path / "local", steps=STEPS)
    job = cluster.govray("run", str(reference))
    assert job.returncode == 0, job.stdout + job.stderr
    local = finished_run(reference)

    database = tmp_path / "s3" / "govray.db"
    experiment = on_s3(digits_experiment(tmp_path / "s3", steps=STEPS), database)
    first_checkpoint = "SELECT trial_id FROM checkpoints WHERE step = 5"
    trial_id = kill_driver_when(
        cluster, "train.py", experiment, lambda: query_one(database, first_checkpoint)
    )
    time.sleep(3)  # the job's Ray Train controller and workers die with their driver
    shutil.rmtree(s3_env["GOVRAY_CACHE"])  # a fresh node: only the bucket holds the run now
    # The killed driver's workers outlive it for a moment and may upload the step-10 checkpoint,
    # whose report nobody heard: the resume records it (report included) and starts from it.
    left = {k.split("/")[4] for k in bucket_keys() if "/checkpoint_" in k and k.endswith("/manifest.sig")}
    job = cluster.govray("resume", "digits-governed", "--database", f"sqlite:///{database}")
    assert job.returncode == 0, job.stdout + job.stderr

    store = TrackingStore.open(f"sqlite:///{database}")
    trial = store.get_trial(trial_id)
    assert trial.state == "completed" and trial.ray_run_name
    # Every report stored once: step 5 before the kill, step 10 after it (heard or recovered).
    assert [m.step for m in store.metrics(trial_id, "training_loss")] == [5, 10]
    run = trial.ray_run_name
    keys = bucket_keys()
    assert any(k.startswith(f"{PREFIX}/shards/") and k.endswith("/manifest.json") for k in keys), keys
    assert f"{PREFIX}/runs/{run}.json" in keys
    assert any(k.startswith(f"{PREFIX}/tensorboard/{run}/events.out.tfevents.") for k in keys), keys
    stored = sorted(
        k.split("/")[4]
        for k in keys
        if k.startswith(f"{PREFIX}/ray/{run}/checkpoint_") and k.endswith("/manifest.json")
    )
    # GC (save_trial_latest 1, save_trial_best 1) deleted from the bucket what the store marks
    # deleted, and the bucket holds exactly what the store records as active: nothing unrecorded.
    recorded = checkpoints(store, trial_id)
    states = {Path(c.path).name: (c.step, c.state) for c in recorded}
    assert sorted(states.values()) == [(5, "deleted"), (10, "active")], states
    (final,) = [name for name, (_, state) in states.items() if state == "active"]
    assert stored == [final], (stored, states)
    # The resume starts from the newest verified checkpoint (the one the orphans may add included).
    at_least = max(states[name][0] for name in left if name in states)
    assert all(c.manifest_digest for c in recorded)  # the stored checkpoint's, fetched to record it

    # Everything a third party needs comes from the bucket, downloaded without govray.
    model_dir = download(f"{PREFIX}/ray/{run}/{final}", tmp_path / "downloaded" / final)
    attested = download(f"{PREFIX}/attestations/{run}", tmp_path / "downloaded" / "attestations")
    envelope = attested / f"{final}.provenance.dsse.json"
    assert envelope.exists() and (attested / f"{final}.coverage.dsse.json").exists()
    verified = verify_attestation(envelope, model_dir=model_dir, trust=platform_trust(platform_key()))
    assert verified.statement["subject"][0]["digest"]["sha256"]
    (final_record,) = [c for c in recorded if Path(c.path).name == final]
    assert envelope.read_text() in {r.envelope_json for r in attestations(store, final_record.id)}  # type: ignore[arg-type]

    # Bit-identical to the uninterrupted run on local storage.
    for name in MODEL_FILES:
        assert (local.final_checkpoint / name).read_bytes() == (model_dir / name).read_bytes(), name
    ledgers = [
        json.loads((d / "state.json").read_text())["ledger"] for d in (local.final_checkpoint, model_dir)
    ]
    assert ledgers[0] == ledgers[1]

    # Every rank's log, from before the kill and after the resume, read from the bucket alone.
    assert {f"{PREFIX}/logs/{run}/rank-{rank}.log" for rank in (0, 1)} <= set(keys), keys
    shutil.rmtree(s3_env["GOVRAY_CACHE"])
    shown = cluster.govray("trial", "logs", str(trial_id), "--database", f"sqlite:///{database}")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    for rank in (0, 1):
        lines = [line for line in shown.stdout.splitlines() if f" rank{rank} | " in line]
        assert any(f"steps 1..{STEPS}" in line for line in lines), lines  # the killed attempt
        resumed = [int(line.split()[-1]) for line in lines if "resumed from a verified checkpoint" in line]
        assert len(resumed) == 1 and at_least <= resumed[0] <= STEPS, lines
        # The run's end: its completion, then only the rank's one timings line (train.timings).
        ended = [i for i, line in enumerate(lines) if f"completed {STEPS} steps" in line]
        assert ended and all(" timings {" in line for line in lines[ended[-1] + 1 :]), lines


def test_unreachable_or_unknown_storage_is_refused_naming_it(s3_env: dict[str, str]) -> None:
    with pytest.raises(StorageError, match="bucket 'no-such-bucket'.*AWS_ACCESS_KEY_ID"):
        open_storage("s3://no-such-bucket/x").check()
    with pytest.raises(StorageError, match="only a local path or s3://"):
        open_storage("gs://bucket/x")
    open_storage(f"s3://{BUCKET}/probe").check()  # a reachable bucket passes, and keeps no object
    assert bucket_keys() == ["probe/"]  # pyarrow keeps the emptied prefix as a directory marker


def test_a_search_on_s3_keeps_tunes_state_checkpoints_and_attestations_in_the_bucket(
    cluster: LocalRayCluster, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Two 2-worker grid trials, each one Ray Train run whose checkpoints (a validation's and the
    last) go through the bucket to Tune; the search's driver is killed after the first trial and
    the search resumed from the bucket alone."""
    database = tmp_path / "govray.db"
    experiment = on_s3(digits_experiment(tmp_path / "search", steps=STEPS), database)
    raw = yaml.safe_load(experiment.read_text())
    raw["hyperparameters"]["hidden"] = {"type": "categorical", "vals": [8, 16]}
    raw["searcher"] = {"name": "grid", "metric": "validation_loss", "max_length": {"batches": STEPS}}
    del raw["lr_schedule"]
    experiment.write_text(yaml.safe_dump(raw, sort_keys=False))
    # Killed 2 s after its first trial completed (Tune saves its state within a second), then
    # run again on a node with an empty cache: Tune's state comes back from the bucket.
    completed = "SELECT min(id) FROM trials WHERE state = 'completed'"
    first = kill_driver_when(cluster, "search.py", experiment, lambda: query_one(database, completed), 2.0)
    metrics_before = query_one(database, f"SELECT count(*) FROM metrics WHERE trial_id = {first}")
    time.sleep(3)  # the dead driver's Tune trials die with it
    shutil.rmtree(s3_env["GOVRAY_CACHE"])
    job = cluster.govray("search", str(experiment))
    assert job.returncode == 0, job.stdout + job.stderr

    store = TrackingStore.open(f"sqlite:///{database}")
    (recorded,) = store.list_experiments()
    trials = store.list_trials(recorded.id)  # type: ignore[arg-type]
    assert sorted(json.loads(t.hparams_json)["hidden"] for t in trials) == [8, 16]
    assert len(store.metrics(first)) == metrics_before  # the finished trial did not run again
    keys = bucket_keys()
    assert any(k.startswith(f"{PREFIX}/tune/digits-governed-search") for k in keys), keys
    trust = platform_trust(platform_key())
    for trial in trials:
        assert trial.state == "completed" and trial.id is not None and trial.ray_run_name
        assert [m.step for m in store.metrics(trial.id, "validation_loss")] == [5, STEPS]
        (final,) = [c for c in checkpoints(store, trial.id) if c.state == "active"]
        key = storage_key(Path(final.path))
        assert f"{key}/manifest.json" in keys, (key, keys)
        model_dir = download(key, tmp_path / "downloaded" / trial.ray_run_name)
        attested = f"{PREFIX}/attestations/{trial.ray_run_name}/{Path(final.path).name}.provenance.dsse.json"
        assert attested in keys, keys
        envelope = tmp_path / "downloaded" / f"{trial.ray_run_name}.dsse.json"
        s3_client().download_file(BUCKET, attested, str(envelope))
        verify_attestation(envelope, model_dir=model_dir, trust=trust)
        assert any(k.startswith(f"{PREFIX}/tensorboard/{trial.ray_run_name}/events.") for k in keys)


def storage_key(cached: Path) -> str:
    """The object key of a path in this machine's cache of the test's storage."""
    return open_storage(f"s3://{BUCKET}/{PREFIX}").remote_path(cached).removeprefix(f"{BUCKET}/")
