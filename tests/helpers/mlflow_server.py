"""A real ``mlflow server`` (SQLite backend, artifacts served over HTTP) on a free port of
127.0.0.1, started and stopped by the test that needs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def mlflow_server(directory: Path, port: int, timeout: float = 240.0) -> Iterator[str]:
    """Serve an MLflow tracking server from ``directory`` on ``port``; yields its URI."""
    directory.mkdir(parents=True, exist_ok=True)
    uri = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}", "--workers", "1"]
    command += ["--artifacts-destination", str(directory / "artifacts")]
    log = open(directory / "server.log", "wb")  # noqa: SIM115 (closed when the server stops)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(uri):
            assert server.poll() is None, (directory / "server.log").read_text()
            assert time.monotonic() < deadline, f"mlflow server not up in {timeout} s"
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn workers: our own group
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False
