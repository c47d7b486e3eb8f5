"""The lineage app reads, and reads only what is signed: no GET writes anything (a checkpoint whose
ledger is not stored answers 409 naming the write that stores it), the routing and policy it
shows come from the run spec its signed (or recorded) manifest lists, and it never imports a
trial's code — a run spec an engineer rewrote to name a planted module is refused, unrun."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from govray.cli import main
from govray.config.serve import ServeSettings
from govray.tracking.lineage import checkpoints
from govray.train.runspec import RUN_SPEC_FILE
from serve.app import create_app
from tests.helpers.golden import GoldenRun
from tests.helpers.lineage_server import copy_store

TOKEN = "reads-only-token"
PLANTED = "planted_trial"


@dataclass(frozen=True)
class Served:
    client: TestClient
    database: Path
    checkpoint: Path
    checkpoint_id: int
    marker: Path  # what the planted module writes when imported


def table_counts(database: Path) -> dict[str, int]:
    with sqlite3.connect(database) as connection:
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {name: connection.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0] for name in tables}


@pytest.fixture
def served(golden_run: GoldenRun, tmp_path: Path) -> Iterator[Served]:
    """A copy of the golden store whose final checkpoint's ledger rows are gone (as when they could
    not be stored at recording), served with a trust file and a write token."""
    store = copy_store(golden_run, tmp_path / "storage")
    final = checkpoints(store, golden_run.outcome.trial_id)[-1]
    assert final.id is not None
    store.close()
    database = tmp_path / "storage" / "govray.db"
    with sqlite3.connect(database) as connection:
        connection.execute("DELETE FROM ledger_rows WHERE checkpoint_id = ?", (final.id,))
    trust = tmp_path / "trust.yaml"
    assert main(["keys", "trust-platform", "--trust", str(trust)]) == 0
    settings = ServeSettings(database_url=f"sqlite:///{database}", trust=trust, token=SecretStr(TOKEN))
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "imported-the-planted-trial"
    (planted / f"{PLANTED}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nclass Planted: ...\n"
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield Served(client, database, Path(final.path), final.id, marker)


def test_a_get_for_a_checkpoint_without_a_stored_ledger_writes_nothing_and_names_the_write(
    served: Served,
) -> None:
    before = table_counts(served.database)
    for path in (
        f"/api/checkpoints/{served.checkpoint_id}/lineage",
        f"/lineage/checkpoints/{served.checkpoint_id}",
    ):
        answer = served.client.get(path)
        if path.startswith("/api"):
            assert answer.status_code == 409, answer.text
            assert f"POST /api/checkpoints/{served.checkpoint_id}/ledger" in answer.json()["detail"]
    assert table_counts(served.database) == before
    written = served.client.post(
        f"/api/checkpoints/{served.checkpoint_id}/ledger", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert written.status_code == 200, written.text
    assert written.json()["rows"] > 0
    assert table_counts(served.database)["ledger_rows"] == before["ledger_rows"] + written.json()["rows"]
    answer = served.client.get(f"/api/checkpoints/{served.checkpoint_id}/lineage")
    assert answer.status_code == 200 and answer.json()["layers"], answer.text
    unauthorised = served.client.post(f"/api/checkpoints/{served.checkpoint_id}/ledger")
    assert unauthorised.status_code == 401


def test_a_run_spec_rewritten_to_name_a_planted_trial_is_refused_and_its_code_never_runs(
    served: Served,
) -> None:
    spec_file = served.checkpoint / RUN_SPEC_FILE
    original = spec_file.read_text()
    document = json.loads(original)
    document["trial"] = f"{PLANTED}:Planted"
    document["code_dir"] = str(served.marker.parent / "planted")
    spec_file.write_text(json.dumps(document))
    before = table_counts(served.database)
    write = {"Authorization": f"Bearer {TOKEN}"}
    stored = served.client.post(f"/api/checkpoints/{served.checkpoint_id}/ledger", headers=write)
    assert stored.status_code == 409 and "run.json: sha256 does not match its manifest" in stored.text
    assert table_counts(served.database) == before
    lineage = served.client.get(f"/api/checkpoints/{served.checkpoint_id}/lineage")
    assert lineage.status_code == 409
    # With the ledger stored (from the run spec as signed), the page shows no rule of the rewrite.
    spec_file.write_text(original)
    assert (
        served.client.post(f"/api/checkpoints/{served.checkpoint_id}/ledger", headers=write).status_code
        == 200
    )
    spec_file.write_text(json.dumps(document))
    page = served.client.get(f"/lineage/checkpoints/{served.checkpoint_id}")
    assert page.status_code == 200, page.text
    assert "rules unavailable" in page.text and "run.json: sha256 does not match its manifest" in page.text
    assert not served.marker.exists()  # nothing imported the planted module
