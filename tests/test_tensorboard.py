"""Every trial leaves TensorBoard event files under STORAGE/tensorboard/RUN whose scalars are the
metrics the tracking store holds: same names, same steps, the same values (as 32-bit floats)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from govray.tracking.tensorboard import tensorboard_dir
from tests.helpers.golden import GoldenRun


def event_scalars(directory: Path) -> dict[tuple[str, int], float]:
    """(tag, step) → value of every scalar in the directory's event files, read as TensorBoard
    does: TFRecords (length, its CRC, an ``Event`` protobuf, its CRC), later files last."""
    scalars: dict[tuple[str, int], float] = {}
    files = sorted(directory.glob("events.out.tfevents.*"))
    assert files, f"no event files in {directory}"
    for path in files:
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = value.simple_value
    return scalars


@pytest.mark.parametrize(
    "golden",
    [
        pytest.param("golden_run", id="controller-callback"),  # 2 Ray Train workers
        pytest.param("golden_local_epoch", id="local-mode-driver"),  # 1 worker in-process
    ],
)
def test_trial_tensorboard_scalars_equal_the_tracking_store_metrics(
    golden: str, request: pytest.FixtureRequest
) -> None:
    run: GoldenRun = request.getfixturevalue(golden)
    directory = Path(tensorboard_dir(run.config.storage_path, run.outcome.run_name))
    scalars = event_scalars(directory)
    stored = {(metric.name, metric.step): metric.value for metric in run.store.metrics(run.outcome.trial_id)}
    assert scalars.keys() == stored.keys()
    assert scalars == {key: float(np.float32(value)) for key, value in stored.items()}
    names = {name for name, _ in scalars}
    assert {"training_loss", "validation_loss", "memorization_score", "examples"} <= names
    assert any(name.startswith("validation_loss/") for name in names)  # per corpus
