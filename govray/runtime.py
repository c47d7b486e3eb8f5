"""Connecting to Ray: the cluster named by RAY_ADDRESS, else a local instance sized to this machine."""

from __future__ import annotations

import logging
import os

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
