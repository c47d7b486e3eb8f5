"""TensorBoard event files of each trial: the scalars the tracking store records, as it records them.

The driver's run recorder (``govray.platform.run.recorder``: a Ray Train run, an in-process run, each
Tune trial) writes the scalars it stores, at the same steps, to ``STORAGE/tensorboard/RUN/`` — one
TensorBoard run per trial::

    tensorboard --logdir STORAGE/tensorboard

Tags are the store's metric names (``training_loss``, ``validation_loss``,
``validation_loss/digits-public``, ``memorization_score``, ``loss_gap/digits-writers``, ...);
TensorBoard keeps 32-bit floats where the store keeps 64-bit ones. With an ``s3://`` storage path
the files are written in the driver node's cache of it and uploaded when the trial's run ends; a
resumed run's file starts with every report the store already holds (the killed driver's file may
lie on a node that is gone), and its first event tells TensorBoard to drop what earlier files said
from that step on.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary

from govray.core.storage import Storage


def tensorboard_dir(storage_root: str | Path, run_name: str) -> Path:
    """``STORAGE/tensorboard/RUN`` (``storage_root``: a local storage path, or the node's cache of
    object storage)."""
    return Path(storage_root) / "tensorboard" / run_name


class TensorBoardLog:
    """One trial's event file, opened at the first write (so it can be pickled to the Ray Train
    controller before). Written synchronously: each report is on disk when ``write`` returns
    (tensorboardX's ``SummaryWriter`` queues events to a thread, which a test, a reader or a
    killed controller would race)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._writer: EventsWriter | None = None

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """The scalars of one report, as one event at ``step``."""
        if not scalars:
            return
        if self._writer is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = EventsWriter(f"{self.directory}/events", f".{os.getpid()}")
            # A resumed trial re-reports the steps after its checkpoint: TensorBoard discards what
            # an earlier file recorded from this step on.
            restart = SessionLog(status=SessionLog.START)
            self._writer.write_event(Event(wall_time=time.time(), step=step, session_log=restart))
        values = [Summary.Value(tag=name, simple_value=value) for name, value in scalars.items()]
        self._writer.write_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def publish(self, storage: Storage) -> None:
        """Close, and copy the event files written on this node to ``storage`` (object storage)."""
        self.close()
        if self.directory.exists():
            storage.upload(self.directory)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}
