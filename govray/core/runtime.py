"""Connecting to Ray: the cluster named by RAY_ADDRESS, else a local instance sized to this machine."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray


def ensure_ray(address: str | None = None) -> None:
    """Initialise Ray once per process; a no-op when already connected."""
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # per-dataset progress lines and notices
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        ray.init(address=target, log_to_driver=False)
    else:
        # Small machines: no dashboard, and quiet workers; everything else as Ray defaults.
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)


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
