"""Connecting to Ray: the instance already running on this machine or named by RAY_ADDRESS
(``govray.core.rayhead``), else a local instance sized to this machine, started quietly."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import ray

from govray.core.rayhead import RunningRay, running_ray, settle_token_auth
from govray.core.raylogs import route_ray_logs


def ensure_ray(address: str | None = None) -> None:
    """Initialise Ray once per process; a no-op when already connected.

    Joins ``address``, else the running instance (``running_ray``), saying which in one line on
    stderr; otherwise starts a local instance that ends with the process. Either way Ray's
    loggers write to a file, not the terminal (``govray.core.raylogs``).
    """
    if ray.is_initialized():
        return
    target = RunningRay(address, "the address given") if address else running_ray()
    notice = settle_token_auth(starting=target is None)
    route_ray_logs()
    if notice is not None:
        print(f"govray: {notice}", file=sys.stderr)
    if target is not None:
        ray.init(address=target.address, log_to_driver=False, configure_logging=False)
        print(f"govray: joined Ray at {target.address} ({target.origin})", file=sys.stderr)
    else:
        # Small machines: no dashboard, and quiet workers; everything else as Ray defaults.
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    importlib.import_module("ray.data")  # it configures its loggers at import (Ray Train imports it too)
    route_ray_logs()


def stop_tasks(refs: list[ray.ObjectRef]) -> None:
    """Cancel these tasks and wait until none of them runs: a caller that gives up (ingest, packing)
    removes its staging directory after, and no task writes into it again."""
    pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[1]
    for ref in pending:
        ray.cancel(ref)
    ray.wait(pending, num_returns=len(pending), fetch_local=False)


def ray_node_id() -> str | None:
    """The id of the Ray node this process runs on; None outside Ray."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def train_worker_pids() -> list[int]:
    """PIDs of this machine's live Ray Train worker processes (titled ``ray::RayTrainWorker``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if title.startswith(b"ray::RayTrainWorker"):
                pids.append(int(entry.name))
    return pids
