"""``training.tf32`` and ``training.deterministic`` reach torch's kernel settings in the worker:
TensorFloat-32 on by default for a GPU run and off on the CPU, off in deterministic mode, which
also stops torch filling every new tensor with NaN (``fill_uninitialized_memory``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from pydantic import ValidationError

from govray.config.training import TrainingSettings
from govray.train.reproduce.record import use_deterministic_mode

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def kernel_modes() -> dict[str, object]:
    return {
        "matmul": torch.backends.cuda.matmul.fp32_precision,
        "conv": torch.backends.cudnn.conv.fp32_precision,  # type: ignore[attr-defined]
        "rnn": torch.backends.cudnn.rnn.fp32_precision,  # type: ignore[attr-defined]
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "fill": torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
    }


@pytest.fixture(autouse=True)
def restored_modes() -> Iterator[None]:
    """Whatever a test sets, the process's settings are torch's again afterwards."""
    before = kernel_modes()
    yield
    torch.backends.cuda.matmul.fp32_precision = before["matmul"]
    torch.backends.cudnn.conv.fp32_precision = before["conv"]  # type: ignore[attr-defined]
    torch.backends.cudnn.rnn.fp32_precision = before["rnn"]  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(bool(before["deterministic"]))
    torch.utils.deterministic.fill_uninitialized_memory = before["fill"]  # type: ignore[attr-defined]


def test_tf32_is_a_training_setting_left_out_of_the_record_when_unset() -> None:
    assert TrainingSettings.model_validate({}).tf32 is None
    assert TrainingSettings.model_validate({"tf32": False}).tf32 is False
    assert "tf32" not in TrainingSettings().model_dump(), "an unchanged config keeps its digest"
    assert TrainingSettings(tf32=True).model_dump()["tf32"] is True
    with pytest.raises(ValidationError, match="tf32: true with deterministic: true"):
        TrainingSettings.model_validate({"tf32": True, "deterministic": True})


@pytest.mark.parametrize(
    ("settings", "device", "tf32"),
    [
        ({}, CUDA, True),
        ({}, CPU, False),
        ({"tf32": False}, CUDA, False),
        ({"tf32": True}, CPU, True),
        ({"deterministic": True}, CUDA, False),
        ({"deterministic": True, "tf32": False}, CUDA, False),
    ],
)
def test_tf32_on_for_gpu_runs_off_on_cpu_and_in_deterministic_mode(
    settings: dict[str, object], device: torch.device, tf32: bool
) -> None:
    use_deterministic_mode(TrainingSettings(tf32=not tf32), device)  # the opposite first: it changes
    use_deterministic_mode(TrainingSettings.model_validate(settings), device)
    modes = kernel_modes()
    want = "tf32" if tf32 else "ieee"
    assert (modes["matmul"], modes["conv"], modes["rnn"]) == (want, want, want)


def test_deterministic_mode_stops_filling_uninitialized_memory_and_a_later_run_restores_it() -> None:
    use_deterministic_mode(TrainingSettings(deterministic=True), CUDA)
    assert kernel_modes()["deterministic"] is True and kernel_modes()["fill"] is False
    use_deterministic_mode(TrainingSettings(), CPU)  # the next run in this process is not deterministic
    assert kernel_modes()["deterministic"] is False and kernel_modes()["fill"] is True
