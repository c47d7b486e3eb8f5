"""The lineage app on this session's Ray Serve, over a copy of a golden run's store, for tests that
talk to it over HTTP on 127.0.0.1."""

from __future__ import annotations

import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from pydantic import SecretStr

from govray.config.serve import ServeSettings
from govray.core.keys import platform_key, platform_trust, save_trust
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from tests.helpers.golden import GoldenRun
from tests.helpers.ports import free_port


@dataclass
class Served:
    url: str
    store: TrackingStore  # the served copy of the golden store
    trial_id: int
    experiment_id: int
    checkpoint_ids: list[int]  # by step; the last one holds the trial's ledger
    started_s: float  # from deploying to the first answer

    def call(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return requests.request(method, f"{self.url}{path}", headers=headers, timeout=120, **kwargs)

    def get(self, path: str, **params: Any) -> Any:
        response = self.call("GET", path, params=params)
        assert response.status_code == 200, f"GET {path} {params}: {response.status_code} {response.text}"
        return response.json()


def copy_store(golden: GoldenRun, destination: Path) -> TrackingStore:
    """The golden run's storage and store, copied with paths rewritten: writes through the app
    (registering, removing an adapter) never touch what other tests read."""
    source = Path(golden.config.storage_path)
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("govray.db*"))
    database = destination / "govray.db"
    with sqlite3.connect(source / "govray.db") as original, sqlite3.connect(database) as copy:
        original.backup(copy)
        old, new = str(source), str(destination)
        copy.execute("UPDATE checkpoints SET path = replace(path, ?, ?)", (old, new))
        copy.execute("UPDATE experiments SET storage_path = replace(storage_path, ?, ?)", (old, new))
    return TrackingStore.open(f"sqlite:///{database}")


@contextmanager
def serve_golden_copy(golden: GoldenRun, root: Path, token: str) -> Iterator[Served]:
    """Serve a copy of ``golden``'s store (trusting this machine's platform key, writes allowed
    with ``token``) the way ``govray serve`` does; Serve is shut down afterwards."""
    from ray import serve

    from serve.app import start

    store = copy_store(golden, root / "storage")
    trust = root / "trust.yaml"
    save_trust(platform_trust(platform_key()), trust)
    settings = ServeSettings(database_url=store.url, trust=trust, token=SecretStr(token), port=free_port())
    began = time.monotonic()
    try:
        url = start(settings)
        while True:  # the proxy may take a moment after the deployment is ready
            try:
                if requests.get(f"{url}/api/ping", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                assert time.monotonic() - began < 120, f"the lineage app at {url} never answered /api/ping"
                time.sleep(0.2)
        started = time.monotonic() - began
        trial_id = golden.outcome.trial_id
        saved = [c.id for c in checkpoints(store, trial_id) if c.id is not None]
        yield Served(url, store, trial_id, store.get_trial(trial_id).experiment_id, saved, started)
    finally:
        serve.shutdown()
        store.close()
