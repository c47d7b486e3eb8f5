"""Processes the tests start as a person would: the CLI from another directory, a driver killed
mid-run, a fresh interpreter on this checkout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers.builders import REPO


def edited_trial_elsewhere(directory: Path) -> dict[str, str]:
    """A working directory away from the project with its own copy of the digits trial, edited
    after the golden runs (its losses doubled: every weight would change), and the environment
    of a process started there on this session's Ray: that copy shadows the project's on
    PYTHONPATH, so only the recorded code snapshot runs the trial as it ran."""
    import ray

    package = directory / "jobs" / "examples" / "digits"
    package.mkdir(parents=True)
    for relative in ("jobs/__init__.py", "jobs/examples/__init__.py", "jobs/examples/digits/__init__.py"):
        shutil.copyfile(REPO / relative, directory / relative)
    source = (REPO / "jobs" / "examples" / "digits" / "trial.py").read_text()
    edited = source.replace("return F.cross_entropy(model(", "return 2.0 * F.cross_entropy(model(")
    assert edited != source
    (package / "trial.py").write_text(edited)
    path = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    imported = subprocess.run(
        [sys.executable, "-c", "import jobs.examples.digits.trial as t; print(t.__file__)"],
        cwd=directory,
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.strip() == str(package / "trial.py")  # what a plain import runs there
    return environment


def govray_elsewhere(directory: Path, *args: str) -> str:
    """``python -m govray ARGS`` run from ``directory`` set up by ``edited_trial_elsewhere``;
    fails unless it exits 0; returns what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "govray", *args],
        cwd=directory,
        env=edited_trial_elsewhere(directory),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def kill_driver_when(
    script: str, config: Path | list[str], ready: Callable[[], bool], settle: float = 0.0
) -> None:
    """Run ``jobs/SCRIPT --config CONFIG`` (``config`` a list: ``jobs/SCRIPT ARGS``) in its own
    process on this session's Ray cluster (as ``ray job submit`` would), SIGKILL it once ``ready()``
    holds (polled every 0.05 s, at most 300 s; ``settle`` seconds later), and wait until it is
    gone. Fails if it never got ready."""
    import ray

    environment = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    arguments = config if isinstance(config, list) else ["--config", str(config)]
    driver = subprocess.Popen(
        [sys.executable, str(REPO / "jobs" / script), *arguments],
        cwd=REPO,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    killed = False
    while driver.poll() is None and time.monotonic() < deadline:
        if ready():
            time.sleep(settle)
            driver.send_signal(signal.SIGKILL)  # a real kill, no cleanup
            killed = True
            break
        time.sleep(0.05)
    driver.wait(timeout=60)
    assert killed, f"jobs/{script} ended or timed out before it was ready to be killed"


def python(*args: str) -> str:
    """Run ``python ARGS`` on this checkout's govray in a fresh interpreter; its stdout."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
