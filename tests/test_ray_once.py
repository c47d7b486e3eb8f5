"""One Ray per machine, and refusals without Ray's internals (issue 33, items 2 and 5): a command
joins the Ray that runs here and says which in one line; ``govray up``/``down`` start and stop
the head commands join; a refused ingest prints govray's message, and Ray's logs go to a file
the message names."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from govray.core import rayhead
from govray.core.keys import SigningKey
from govray.core.rayhead import HeadRecord, RunningRay, leftover_processes, running_ray, settle_token_auth
from tests.helpers.builders import REPO
from tests.helpers.ingest import build, corpus_spec

REFUSAL = "IngestError: corpus 'bad': {csv} row 2 (line 4): 4 fields, but the header has 3"


def malformed_ingest(tmp_path: Path, authority_key: SigningKey, trust_file: Path) -> tuple[Path, Path]:
    """An experiment whose CSV has a ragged row 2 (line 4); (experiment file, CSV)."""
    csv = tmp_path / "c.csv"
    csv.write_text("x,y,text\n1,2,a\n3,4,b\n5,6,c,extra\n")
    return build(tmp_path, authority_key, trust_file, [corpus_spec("bad", "c.csv")]), csv


def govray(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "govray", *args],
        cwd=REPO,
        env={**env, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_refused_with_one_message(done: subprocess.CompletedProcess[str], joined: str, csv: Path) -> None:
    """The whole output: the Ray joined, govray's refusal, and the file holding Ray's logs (which
    holds Ray Data's stack trace, kept off the terminal)."""
    lines = done.stderr.splitlines()
    assert (done.returncode, done.stdout, len(lines)) == (7, "", 3), done.stderr
    assert lines[0] == f"govray: joined Ray at {joined}"
    assert lines[1] == REFUSAL.format(csv=csv)
    assert lines[2].startswith("(Ray's logs of this command: ") and lines[2].endswith(".log)")
    logs = Path(lines[2].removeprefix("(Ray's logs of this command: ").removesuffix(")"))
    assert "Traceback" in logs.read_text() and "ReadCSV" in logs.read_text()


def environment(home: Path, **extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    return {**env, "GOVRAY_HOME": str(home), **extra}


@pytest.mark.usefixtures("ray_session")
def test_a_refused_ingest_prints_govrays_message_and_nothing_from_rays_loggers(
    tmp_path: Path, authority_key: SigningKey, trust_file: Path
) -> None:
    """The CLI as a user runs it, joined to this session's Ray (RAY_ADDRESS)."""
    import ray

    experiment, csv = malformed_ingest(tmp_path, authority_key, trust_file)
    address = ray.get_runtime_context().gcs_address
    done = govray("data", "ingest", str(experiment), env=environment(tmp_path / "home", RAY_ADDRESS=address))
    assert_refused_with_one_message(done, f"{address} (RAY_ADDRESS)", csv)


@pytest.fixture
def listening() -> Iterator[str]:
    """An address something listens at, standing in for a live GCS."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def test_a_command_joins_govray_ups_head_while_it_answers_and_no_stale_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listening: str
) -> None:
    import ray._common.utils

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("GOVRAY_HOME", str(tmp_path))
    monkeypatch.setattr(ray._common.utils, "get_ray_address_file", lambda _: str(tmp_path / "none"))
    head = HeadRecord(address=listening, pid=os.getpid(), temp_dir=str(tmp_path), num_cpus=2)
    rayhead.record_path().parent.mkdir(parents=True)
    rayhead.record_path().write_text(head.model_dump_json())
    monkeypatch.setattr(rayhead, "_runs_head", lambda record: record == head)
    assert running_ray() == RunningRay(listening, "started by govray up")

    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")  # named by the user: joined as named
    assert running_ray() == RunningRay("10.1.2.3:6379", "RAY_ADDRESS")
    monkeypatch.delenv("RAY_ADDRESS")

    monkeypatch.setattr(rayhead, "_runs_head", lambda record: False)  # the head died
    assert running_ray() is None
    (tmp_path / "bootstrap").write_text(listening)  # a plain `ray start --head`
    monkeypatch.setattr(ray._common.utils, "get_ray_address_file", lambda _: str(tmp_path / "bootstrap"))
    assert running_ray() == RunningRay(listening, "started by ray start --head")


def test_rays_token_notice_is_shown_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOVRAY_HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert settle_token_auth(starting=True) is None  # the user chose: nothing to say
    monkeypatch.delenv("RAY_AUTH_MODE")
    notice = settle_token_auth(starting=True)
    assert notice is not None and f"the token is {tmp_path / 'auth_token'}" in notice
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert settle_token_auth(starting=True) is None and os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert settle_token_auth(starting=False) is None and os.environ["RAY_AUTH_MODE"] == "disabled"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_two_commands_in_a_row_join_the_one_ray_govray_up_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, authority_key: SigningKey, trust_file: Path
) -> None:
    """``govray up`` on a private temp dir and port; two refused ingests join it (one Ray session
    in all); Ray's token notice is said once, by ``up``; ``govray down`` leaves no process."""
    home = tmp_path / "home"
    monkeypatch.setenv("GOVRAY_HOME", str(home))  # so that the cleanup below finds the head
    temp = Path(tempfile.mkdtemp(prefix="govray-up-", dir="/tmp"))  # short: Ray's socket paths
    env = environment(home)
    env.pop("RAY_AUTH_MODE", None)
    experiment, csv = malformed_ingest(tmp_path, authority_key, trust_file)
    try:
        started = govray(
            "up", "--port", str(free_port()), "--num-cpus", "2", "--temp-dir", str(temp), env=env
        )
        assert started.returncode == 0, started.stderr
        address = HeadRecord.model_validate_json(rayhead.record_path().read_text()).address
        assert started.stdout.startswith(f"started Ray at {address} (2 CPUs")
        assert "token authentication is on" in started.stderr
        again = govray("up", env=env)
        assert (again.returncode, again.stdout.strip()) == (
            0,
            f"Ray is already running at {address} (started by govray up)",
        )
        for _ in range(2):
            done = govray("data", "ingest", str(experiment), env=env)
            assert_refused_with_one_message(done, f"{address} (started by govray up)", csv)
        assert len(list(temp.glob("session_2*"))) == 1, "both commands joined the one Ray session"
        head = HeadRecord.model_validate_json(rayhead.record_path().read_text())
        environ = Path(f"/proc/{head.pid}/environ").read_bytes().split(b"\0")
        assert f"{rayhead.DRAIN_TIMEOUT}=0".encode() in environ, "down waits for no drain"
        began = time.monotonic()
        stopped = govray("down", env=env)
        assert (stopped.returncode, stopped.stdout.strip()) == (0, f"stopped Ray at {address}")
        assert time.monotonic() - began < 20, "Ray's 30 s drain on SIGTERM is skipped"
        assert leftover_processes(temp) == []
        idle = govray("down", env=env)
        assert (idle.returncode, idle.stdout.strip()) == (0, "no Ray started by govray up is running")
    finally:
        rayhead.stop_head()  # only this test's head: its own process and what names its temp dir
        subprocess.run(["rm", "-rf", str(temp)], check=False)
