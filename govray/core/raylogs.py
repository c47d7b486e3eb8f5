"""Ray's driver-side logs go to a file, not the terminal: the terminal gets govray's own messages.

Ray's loggers (``ray``, ``ray.data``, ...) print to stderr: a refused ingest printed about 80 lines
of Ray Data stack traces before govray's one-line error. ``route_ray_logs`` moves every handler
of theirs that writes to the terminal onto one file per command, under ``$GOVRAY_HOME/logs``,
created only when Ray logs something; the CLI names the file after a refusal
(``ray_log_file``). Ray's own files (the session's ``logs/``, ``ray-data.log``) stay as they are.

Ray also prints, not logs, the error messages its cluster pushes to a driver (``(raylet) Task
ServeController.graceful_shutdown failed...`` when ``govray serve`` stops Serve): once Ray is
imported they go to the same file, through the ``ray`` logger.

This module imports no Ray: the CLI reads ``ray_log_file`` without loading it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
from pathlib import Path
from typing import Any

_FORMAT = "%(asctime)s\t%(levelname)s %(name)s %(filename)s:%(lineno)s -- %(message)s"
_handler: logging.FileHandler | None = None


def route_ray_logs() -> Path:
    """Send every terminal handler of Ray's loggers to this command's log file; its path.

    Idempotent: a second call (after Ray Data configured its loggers at import) moves what is new.
    """
    global _handler
    if _handler is None:
        from govray.core.keys import govray_home

        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = govray_home() / "logs" / f"ray-{stamp}-{os.getpid()}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        _handler = logging.FileHandler(path, delay=True)  # no file unless Ray logs something
        _handler.setFormatter(logging.Formatter(_FORMAT))
        _handler.setLevel(logging.INFO)  # Ray Data's debug lines stay in its own ray-data.log
    for name in ["ray", *sorted(logging.root.manager.loggerDict)]:
        if name != "ray" and not name.startswith("ray."):
            continue
        logger = logging.getLogger(name)
        terminal = [handler for handler in logger.handlers if _to_terminal(handler)]
        for handler in terminal:
            logger.removeHandler(handler)
        if terminal or name == "ray":
            logger.addHandler(_handler)
            logger.propagate = False
    _route_error_messages()
    return Path(_handler.baseFilename)


def _route_error_messages() -> None:
    """The driver's listener of the cluster's error messages prints each with
    ``ray._private.worker.print_to_stdstream`` (looked up at each message; Ray's log-to-driver
    printer is bound at ``ray.init`` and stays off: govray's ``log_to_driver=False``)."""
    worker = sys.modules.get("ray._private.worker")
    if worker is None or getattr(worker.print_to_stdstream, "_govray", False):
        return

    def to_log(data: dict[str, Any], ignore_prefix: bool) -> None:
        for line in data.get("lines", []):
            logging.getLogger("ray").warning("(%s) %s", data.get("pid", "ray"), line)

    to_log._govray = True  # type: ignore[attr-defined]
    worker.__dict__["print_to_stdstream"] = to_log


def ray_log_file() -> Path | None:
    """This command's file of Ray's logs, when Ray logged anything to it."""
    if _handler is None:
        return None
    path = Path(_handler.baseFilename)
    return path if path.exists() and path.stat().st_size else None


def _to_terminal(handler: logging.Handler) -> bool:
    # FileHandler is a StreamHandler too; only handlers writing to stderr/stdout move.
    return (
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and (
            handler.stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
            or getattr(handler.stream, "name", None) in ("<stderr>", "<stdout>")
        )
    )
