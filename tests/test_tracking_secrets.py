"""The tracking store's password comes from the environment, never from a committed file, and is
never shown: not in the recorded experiment, not in a log line, not in an error."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import yaml

from govray.config.experiment import load_experiment
from govray.core.errors import ConfigError, TrackingError
from govray.tracking.database import tracking_url
from govray.tracking.store import TrackingStore
from jobs.examples.digits.golden import EXAMPLE_CONFIG

SECRET = "s3cret-Pa55"


def experiment(tmp_path: Path, database: str) -> Path:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    raw["data"]["corpora"] = [
        {**c, "path": str(EXAMPLE_CONFIG.parent / c["path"])} for c in raw["data"]["corpora"]
    ]
    raw["policy"] = {k: str(EXAMPLE_CONFIG.parent / v) for k, v in raw["policy"].items()}
    raw["tracking"] = {"database": database}
    path = tmp_path / "experiment-cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_a_variable_in_the_tracking_url_reaches_the_connection_and_stays_out_of_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = "postgresql+psycopg://govray:${GOVRAY_DB_PASSWORD}@db.internal:5432/govray"
    config = load_experiment(experiment(tmp_path, template))
    monkeypatch.setenv("GOVRAY_DB_PASSWORD", SECRET)
    assert tracking_url(config.database_url).password == SECRET
    recorded = config.model_dump_json()  # what the store, run.json and a job's directory keep
    assert "${GOVRAY_DB_PASSWORD}" in recorded and SECRET not in recorded
    # The expanded URL is the one a store connects to: a SQLite file at the variable's path.
    monkeypatch.setenv("GOVRAY_DB_DIR", str(tmp_path / "db"))
    local = load_experiment(experiment(tmp_path, "sqlite:///${GOVRAY_DB_DIR}/tracking.db"))
    TrackingStore.open(local.database_url).close()
    assert (tmp_path / "db" / "tracking.db").is_file()


def test_an_unset_variable_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOVRAY_DB_PASSWORD", raising=False)
    config = load_experiment(
        experiment(tmp_path, "postgresql+psycopg://govray:${GOVRAY_DB_PASSWORD}@db.internal/govray")
    )
    with pytest.raises(
        ConfigError,
        match=r"tracking.database uses \$\{GOVRAY_DB_PASSWORD\}, but the environment variable "
        r"GOVRAY_DB_PASSWORD is not set",
    ):
        config.database_url  # noqa: B018  (the property is what expands)


def test_a_password_never_appears_in_logs_or_errors(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("GOVRAY_DB_PASSWORD", SECRET)
    url = f"postgresql+psycopg://govray:${{GOVRAY_DB_PASSWORD}}@127.0.0.1:{closed_port()}/govray"
    config = load_experiment(experiment(tmp_path, url))
    with pytest.raises(TrackingError) as refused:
        TrackingStore.open(config.database_url)  # nothing listens there: the connection fails
    assert "govray:***@127.0.0.1" in str(refused.value)
    with pytest.raises(TrackingError) as unparseable:
        tracking_url(f"postgresql+psycopg://govray:{SECRET}@db.internal:port/govray")
    out, err = capfd.readouterr()
    shown = [
        str(refused.value),
        str(unparseable.value),
        caplog.text,
        out,
        err,
        repr(TrackingStore(f"sqlite:///{tmp_path}/x.db")),
    ]
    assert all(SECRET not in text for text in shown)
