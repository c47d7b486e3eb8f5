"""The memorization probe measures the model as it trains: under a bf16 run's autocast every
probe forward pass (loss gap, the detectors' logits, entropy profile; canary scores go through
the same context) runs in autocast, and in an fp32 run none does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from govray.train.parallel.worker import Worker
from tests.helpers.builders import governed_step
from tests.helpers.engine import run_spec
from tests.helpers.golden import GoldenRun


@pytest.mark.parametrize(("precision", "autocast"), [("bf16", torch.bfloat16), ("fp32", None)])
def test_the_probe_runs_under_the_runs_autocast(
    golden_run: GoldenRun, precision: str, autocast: torch.dtype | None
) -> None:
    spec = run_spec(golden_run)
    assert spec.settings is not None
    settings = spec.settings.model_copy(update={"precision": precision})
    spec = spec.model_copy(update={"settings": settings})
    governed = governed_step(spec, Worker(0, 1), settings)
    seen: list[torch.dtype | None] = []
    loss = governed.trial.loss

    def recording_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        enabled = torch.is_autocast_enabled("cpu")
        seen.append(torch.get_autocast_dtype("cpu") if enabled else None)
        return loss(model, batch)

    predictions = governed.trial.predictions

    def recording_predictions(model: torch.nn.Module, batch: Any) -> Any:
        recording_loss(model, batch)  # what autocast the logit detectors' forward ran under
        return predictions(model, batch)

    governed.trial.loss = recording_loss  # type: ignore[method-assign]
    governed.trial.predictions = recording_predictions  # type: ignore[method-assign]
    measures = governed.probe.measure()
    assert measures and any(m.loss_gap is not None for m in measures.values()), "the probe measured"
    # Every detector the digits trial's logits allow (a classifier: no text, so no zlib ratio).
    for m in measures.values():
        if m.loss_gap is not None:
            assert None not in (m.min_k_prob, m.min_k_plus_plus, m.reference_loss, m.confidence_gap)
            assert m.zlib_ratio is None
    assert seen and set(seen) == {autocast}
