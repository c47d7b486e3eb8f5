"""Live lineage without Ray: signed checkpoints with known ledgers, recorded by the driver's
``RunRecorder`` into a fresh store, and the lineage app (in-process) answering from it.

- every recorded checkpoint has its own ledger, exactly its ``state.json``'s; a running trial's
  lineage exists after its first checkpoint, says "as of step N (running)", and grows at the next;
- an answer stays cached while only other trials change (``X-Govray-Cache: hit``), and a new
  checkpoint of its own trial replaces it;
- GC keeps the ledger rows a registered version, an attestation or the trial's latest checkpoint
  needs, and drops the rest;
- a checkpoint whose ledger could not be stored when it was recorded gets it from its verified
  ``state.json`` on first request; a tampered one gets none, and the request says why.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import SecretStr
from safetensors.torch import save_file

from govray.config.serve import ServeSettings
from govray.core.keys import KeyRole, SigningKey, TrustConfig, save_trust
from govray.platform.run.recorder import GcSettings, RunRecorder
from govray.tracking.lineage import (
    checkpoint_ledger_rows,
    checkpoints,
    ledger_rows,
    mark_deleted,
    record_attestation,
    record_checkpoint,
)
from govray.tracking.store import TrackingStore
from govray.tracking.tables import LedgerRow, TrialState
from govray.train.checkpoints.files import MODEL_FILE, STATE_FILE, CheckpointState, seal_checkpoint
from govray.train.checkpoints.manifest import TrainedUnder
from govray.train.checkpoints.signer import KeySigner
from govray.train.run.reports import StepReport
from govray.train.step.ledger import Ledger, LedgerEntry
from serve.api import accepts_gzip
from serve.app import create_app
from serve.cache import GZIP_MIN_BYTES

LAYERS: dict[str, int | None] = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
KEY = SigningKey.generate(KeyRole.PLATFORM)
TRUST = TrustConfig(keys=[KEY.public_key])


def ledger_at(step: int, corpora: tuple[str, ...] = ("claims-2025", "news-2024")) -> Ledger:
    """What ``step`` steps of 8 rows each taught: the first corpus every tensor, the others fc2."""
    entries = {}
    for index, corpus in enumerate(corpora):
        for tensor in LAYERS if index == 0 else ("fc2.weight",):
            entries[corpus, tensor] = LedgerEntry(examples=8 * step // (index + 1), tokens=0, steps=step)
    return Ledger(entries=entries)


def sealed(directory: Path, step: int, ledger: Ledger) -> Path:
    """A signed checkpoint whose ``state.json`` holds ``ledger``."""
    directory.mkdir(parents=True)
    save_file({"fc1.weight": torch.full((2, 2), float(step))}, str(directory / MODEL_FILE))
    state = CheckpointState(
        step=step,
        epoch=0,
        seed=1,
        trial_seed=1,
        schedule={},
        schedule_digest="",
        policy_digest="",
        config_digest="",
        ledger=ledger.to_json(),
        world_history=[(0, 1)],
        hparams_history=[TrainedUnder(from_step=0, run="run", hparams={})],
    )
    seal_checkpoint(directory, {"state": {}, "param_groups": []}, state, KeySigner(KEY))
    return directory


@dataclass
class Live:
    store: TrackingStore
    client: TestClient
    root: Path
    experiment_id: int

    def trial(self) -> tuple[int, RunRecorder]:
        """A new running trial and the driver's recorder for it."""
        trial = self.store.create_trial(self.experiment_id, "{}", seed=1)
        assert trial.id is not None
        self.store.set_trial_state(trial.id, TrialState.ACTIVE)
        gc = GcSettings(self.experiment_id, "validation_loss", smaller_is_better=True, as_it_goes=False)
        return trial.id, RunRecorder(self.store, trial.id, LAYERS, gc, trust=TRUST)

    def checkpoint(self, recorder: RunRecorder, step: int, ledger: Ledger | None = None) -> int:
        """The run saves a checkpoint at ``step`` and reports it; returns its id."""
        path = sealed(
            self.root / f"trial-{recorder.trial_id}" / f"checkpoint_{step:06d}", step, ledger_at(step)
        )
        last = ledger.to_json() if ledger is not None else None  # the run's last report carries it too
        recorder.record(
            StepReport(step=step, epoch=0, metrics={"training_loss": 0.5}, checkpoint=str(path), ledger=last)
        )
        return checkpoints(self.store, recorder.trial_id)[-1].id or 0

    def get(self, path: str) -> tuple[dict[str, Any], str]:
        response = self.client.get(path)
        assert response.status_code == 200, response.text
        return response.json(), response.headers["X-Govray-Cache"]


TOKEN = "live-lineage-token"
WRITE = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    store = TrackingStore.open(f"sqlite:///{tmp_path / 'tracking.db'}")
    experiment = store.create_experiment("live", "{}", "ab12", str(tmp_path / "storage"))
    assert experiment.id is not None
    save_trust(TRUST, tmp_path / "trust.yaml")
    settings = ServeSettings(database_url=store.url, trust=tmp_path / "trust.yaml", token=SecretStr(TOKEN))
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield Live(store, client, tmp_path, experiment.id)
    store.close()


def stored(rows: list[LedgerRow]) -> Ledger:
    return Ledger(
        entries={(r.corpus_id, r.parameter): LedgerEntry(r.examples, r.tokens, r.steps) for r in rows}
    )


def cells(lineage: dict[str, Any]) -> dict[tuple[int, str], int]:
    return {
        (layer["index"], corpus["corpus_id"]): corpus["examples"]
        for layer in lineage["layers"]
        for corpus in layer["corpora"]
    }


def test_every_recorded_checkpoint_stores_exactly_its_state_json_ledger(live: Live) -> None:
    trial_id, recorder = live.trial()
    ids = [live.checkpoint(recorder, step) for step in (10, 20)]
    ids.append(live.checkpoint(recorder, 30, ledger=ledger_at(30)))  # the last report
    live.store.set_trial_state(trial_id, TrialState.COMPLETED)
    for checkpoint_id, record in zip(ids, checkpoints(live.store, trial_id), strict=True):
        on_disk = CheckpointState.model_validate_json((Path(record.path) / STATE_FILE).read_text())
        assert stored(checkpoint_ledger_rows(live.store, checkpoint_id)) == Ledger.from_json(on_disk.ledger)
        assert {r.layer_index for r in checkpoint_ledger_rows(live.store, checkpoint_id)} == {0, 1}
    assert stored(ledger_rows(live.store, trial_id)) == ledger_at(30)  # the trial's ledger: its last
    first, _ = live.get(f"/api/checkpoints/{ids[0]}/lineage")
    assert (first["step"], first["ledger"], first["running"]) == (10, "checkpoint", False)
    assert cells(first) == {(0, "claims-2025"): 80, (1, "claims-2025"): 80, (1, "news-2024"): 40}
    assert first["as_of"] == "as of step 10 (completed)"


def test_a_running_trials_lineage_is_there_after_its_first_checkpoint_and_grows_at_the_next(
    live: Live,
) -> None:
    trial_id, recorder = live.trial()
    response = live.client.get(f"/api/trials/{trial_id}/lineage")
    assert response.status_code == 404 and "no checkpoint yet" in response.json()["detail"]

    first_id = live.checkpoint(recorder, 10)
    first, _ = live.get(f"/api/trials/{trial_id}/lineage")
    assert (first["checkpoint_id"], first["step"], first["running"]) == (first_id, 10, True)
    assert first["as_of"] == "as of step 10 (running)"
    assert cells(first) == {(0, "claims-2025"): 80, (1, "claims-2025"): 80, (1, "news-2024"): 40}

    second_id = live.checkpoint(recorder, 20)
    second, _ = live.get(f"/api/trials/{trial_id}/lineage")
    assert (second["checkpoint_id"], second["step"], second["as_of"]) == (
        second_id,
        20,
        "as of step 20 (running)",
    )
    assert all(second_cell > cells(first)[key] for key, second_cell in cells(second).items())
    # the first checkpoint still answers as of its own step
    assert cells(live.get(f"/api/checkpoints/{first_id}/lineage")[0]) == cells(first)
    influence, _ = live.get("/api/corpora/news-2024/influence")
    assert [(i["checkpoint_id"], i["step"], i["running"]) for i in influence["items"]] == [
        (first_id, 10, True),
        (second_id, 20, True),
    ]


def test_a_commit_to_trial_a_leaves_trial_bs_answer_cached_and_a_checkpoint_of_a_replaces_as(
    live: Live,
) -> None:
    a_id, a = live.trial()
    b_id, b = live.trial()
    live.checkpoint(a, 10)
    live.checkpoint(b, 10)
    b_lineage, cached = live.get(f"/api/trials/{b_id}/lineage")
    assert cached == "miss"
    assert live.get(f"/api/trials/{b_id}/lineage") == (b_lineage, "hit")
    a_before, _ = live.get(f"/api/trials/{a_id}/lineage")
    assert live.get(f"/api/trials/{a_id}/lineage")[1] == "hit"

    live.store.record_report(a_id, 11, {"training": {"training_loss": 0.4}})  # metrics of A only
    assert live.get(f"/api/trials/{b_id}/lineage") == (b_lineage, "hit")
    assert live.get(f"/api/trials/{a_id}/lineage") == (a_before, "hit")  # its lineage did not change

    live.checkpoint(a, 20)
    a_after, cached = live.get(f"/api/trials/{a_id}/lineage")
    assert cached == "miss" and a_after["step"] == 20 and a_after != a_before
    assert live.get(f"/api/trials/{b_id}/lineage") == (b_lineage, "hit")
    cache = live.client.app.state.cache  # type: ignore[attr-defined]
    assert cache.hits >= 5 and cache.dropped >= 1


def test_gc_drops_a_deleted_checkpoints_ledger_unless_something_needs_it(live: Live) -> None:
    _, recorder = live.trial()
    plain, attested, latest = (live.checkpoint(recorder, step) for step in (10, 20, 30))
    record_attestation(live.store, attested, "sha256-of-model", "{}")
    for checkpoint_id in (plain, attested, latest):
        mark_deleted(live.store, checkpoint_id)
    assert checkpoint_ledger_rows(live.store, plain) == []
    assert stored(checkpoint_ledger_rows(live.store, attested)) == ledger_at(20)
    assert stored(checkpoint_ledger_rows(live.store, latest)) == ledger_at(30)  # the trial's ledger
    response = live.client.get(f"/api/checkpoints/{plain}/lineage")
    assert response.status_code == 404 and "deleted by GC" in response.json()["detail"]
    assert live.get(f"/api/checkpoints/{attested}/lineage")[0]["step"] == 20


def checkpoints_without_ledgers(live: Live) -> tuple[int, list[int]]:
    """A trial whose checkpoints were recorded without their ledgers (as when storing one failed)."""
    trial = live.store.create_trial(live.experiment_id, "{}", seed=2)
    assert trial.id is not None
    ids = []
    for step in (10, 20):
        path = sealed(live.root / "older" / f"checkpoint_{step:06d}", step, ledger_at(step))
        ids.append(record_checkpoint(live.store, trial.id, str(path), step).id or 0)
    live.store.set_trial_state(trial.id, TrialState.COMPLETED)
    return trial.id, ids


def test_a_ledger_not_stored_at_recording_is_stored_by_a_write_from_its_verified_state_never_by_a_read(
    live: Live,
) -> None:
    _, (first, second) = checkpoints_without_ledgers(live)
    assert checkpoint_ledger_rows(live.store, first) == []
    asked = live.client.get(f"/api/checkpoints/{first}/lineage")
    assert asked.status_code == 409 and f"POST /api/checkpoints/{first}/ledger" in asked.json()["detail"]
    assert checkpoint_ledger_rows(live.store, first) == []  # a GET writes nothing
    written = live.client.post(f"/api/checkpoints/{first}/ledger", headers=WRITE)
    assert written.status_code == 200 and written.json()["rows"] > 0, written.text
    lineage, _ = live.get(f"/api/checkpoints/{first}/lineage")
    assert lineage["step"] == 10 and lineage["ledger"] == "checkpoint"
    assert stored(checkpoint_ledger_rows(live.store, first)) == ledger_at(10)
    assert checkpoint_ledger_rows(live.store, second) == []  # only what was asked for

    state = Path(checkpoints(live.store, lineage["trial_id"])[1].path) / STATE_FILE
    forged = json.loads(state.read_text())
    forged["ledger"]["entries"] = []  # "this checkpoint trained on nothing"
    state.write_text(json.dumps(forged))
    response = live.client.post(f"/api/checkpoints/{second}/ledger", headers=WRITE)
    assert response.status_code == 409 and "does not match its manifest" in response.json()["detail"]
    assert checkpoint_ledger_rows(live.store, second) == []


def test_the_lineage_page_of_a_running_trials_checkpoint_says_as_of_which_step(live: Live) -> None:
    _, recorder = live.trial()
    checkpoint_id = live.checkpoint(recorder, 10)
    page = live.client.get(f"/lineage/checkpoints/{checkpoint_id}")
    assert page.status_code == 200, page.text
    assert "as of step 10 (running)" in page.text


def test_a_large_cached_answer_goes_gzipped_to_a_client_that_accepts_it_and_as_is_otherwise(
    live: Live,
) -> None:
    for index in range(12):
        live.store.create_experiment(f"search-{index}", "{}", "ab12", str(live.root / "storage"))
    path = "/api/experiments?limit=50"
    plain = live.client.get(path, headers={"Accept-Encoding": "identity"})
    assert plain.headers["X-Govray-Cache"] == "miss" and "content-encoding" not in plain.headers
    assert len(plain.content) >= GZIP_MIN_BYTES and plain.headers["Vary"] == "Accept-Encoding"
    for accepted in ("gzip", "br, gzip;q=0.5", "*"):
        zipped = live.client.get(path, headers={"Accept-Encoding": accepted})
        assert zipped.headers["X-Govray-Cache"] == "hit" and zipped.headers["content-encoding"] == "gzip"
        assert zipped.content == plain.content  # decoded by the client: the same bytes
        assert zipped.num_bytes_downloaded < len(plain.content) / 2
    refused = live.client.get(path, headers={"Accept-Encoding": "gzip;q=0, *"})
    assert "content-encoding" not in refused.headers and refused.content == plain.content
    small = live.client.get("/api/ping", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in small.headers


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        ("gzip", True),
        ("GZIP;q=0.5", True),
        ("*", True),
        ("deflate, gzip;q=1.0, *;q=0.5", True),
        ("*;q=0, gzip", True),
        ("", False),
        ("identity", False),
        ("gzip;q=0", False),
        ("gzip;q=0.000", False),
        ("gzip;q=0, *", False),
        ("gzip;q=nonsense", False),
        ("br, deflate", False),
    ],
)
def test_accept_encoding_admits_gzip_as_rfc_9110_reads_it(header: str, accepted: bool) -> None:
    assert accepts_gzip(header) is accepted
