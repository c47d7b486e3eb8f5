"""Ray's error messages pushed to a driver (``(raylet) Task ServeController.graceful_shutdown
failed...`` as ``govray serve`` stops Serve) go to the command's Ray log file, not the terminal."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray._private.worker

from govray.core import raylogs


def test_an_error_message_pushed_to_the_driver_goes_to_the_ray_log_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GOVRAY_HOME", str(tmp_path))
    monkeypatch.setattr(raylogs, "_handler", None)  # a fresh file for this test
    # both restored afterwards: the printer Ray's listener looks up, and the ray logger's handlers
    monkeypatch.setattr(ray._private.worker, "print_to_stdstream", ray._private.worker.print_to_stdstream)
    logger = raylogs.logging.getLogger("ray")
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    path = raylogs.route_ray_logs()
    raylogs.route_ray_logs()  # idempotent: one line per message still
    message = "Task ServeController.graceful_shutdown failed. There are infinite retries remaining"
    ray._private.worker.print_to_stdstream(
        {"lines": [message], "pid": "raylet", "is_err": False}, ignore_prefix=False
    )
    assert capsys.readouterr() == ("", "")
    assert raylogs.ray_log_file() == path
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and "\tWARNING ray " in lines[0] and lines[0].endswith(f" -- (raylet) {message}")
