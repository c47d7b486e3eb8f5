"""Decisions driven by metrics: the plateau rule is torch's ``ReduceLROnPlateau``, and a replay
applies a recorded decision at its step whatever its own metrics say."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from govray.config.experiment import EarlyStoppingPolicy, PlateauSchedule
from govray.train.control.controller import Controller
from govray.train.control.decisions import (
    DecisionError,
    EarlyStopDecision,
    EarlyStopping,
    LrDecision,
    Plateau,
)

losses = st.lists(st.floats(min_value=0.01, max_value=10.0, allow_nan=False), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    values=losses,
    factor=st.sampled_from([0.1, 0.5, 0.9]),
    patience=st.integers(0, 3),
    threshold=st.sampled_from([0.0, 1e-4, 0.05, 0.5]),
    cooldown=st.integers(0, 2),
    min_scale=st.sampled_from([0.0, 0.01, 0.3]),
    smaller_is_better=st.booleans(),
)
def test_the_plateau_rule_cuts_exactly_when_torch_does(
    values: list[float],
    factor: float,
    patience: int,
    threshold: float,
    cooldown: int,
    min_scale: float,
    smaller_is_better: bool,
) -> None:
    settings_ = PlateauSchedule(
        factor=factor,
        patience=patience,
        threshold=threshold,
        cooldown=cooldown,
        min_scale=min_scale,
        smaller_is_better=smaller_is_better,
    )
    plateau = Plateau(settings_)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer,
        mode="min" if smaller_is_better else "max",
        factor=factor,
        patience=patience,
        threshold=threshold,
        threshold_mode="rel",
        cooldown=cooldown,
        min_lr=min_scale,
    )
    for index, value in enumerate(values):
        before = plateau.scale
        decision = plateau.observe(step=10 * (index + 1), metrics={"validation_loss": value})
        reference.step(value)
        assert plateau.scale == optimizer.param_groups[0]["lr"]
        assert (decision is not None) == (plateau.scale != before)
    assert [d.seq for d in plateau.decisions] == list(range(len(plateau.decisions)))


def test_a_missing_metric_is_a_clear_error() -> None:
    plateau = Plateau(PlateauSchedule(metric="validation_accuracy"))
    with pytest.raises(DecisionError, match="watches 'validation_accuracy'.*validation_loss"):
        plateau.observe(10, {"validation_loss": 1.0})


def record(*steps_and_scales: tuple[int, float]) -> list[LrDecision]:
    return [
        LrDecision(
            seq=seq, step=step, metric="validation_loss", observed=1.0, previous_scale=1.0, scale=scale
        )
        for seq, (step, scale) in enumerate(steps_and_scales)
    ]


def replaying(schedule: PlateauSchedule | None, recorded: list[Any]) -> Controller[None]:
    """The controller of a replay of a trial whose decisions were ``recorded``."""
    return Controller(schedule, None, None, recorded=recorded)


def test_a_replay_applies_the_record_and_ignores_its_own_metrics() -> None:
    control = replaying(PlateauSchedule(patience=0), record((20, 0.5), (40, 0.25)))
    # Steadily improving metrics would never cut the LR; the record does, at its steps.
    seen = [control.after_validation(step, {"validation_loss": 1.0 / step}) for step in (10, 20, 30, 40, 50)]
    assert [[(d.step, d.scale, d.observed) for d in made] for made in seen] == [  # type: ignore[union-attr]
        [],
        [(20, 0.5, None)],
        [],
        [(40, 0.25, None)],
        [],
    ]
    assert control.lr_scale == 0.25
    control.check_applied(50)  # nothing recorded was missed


def test_a_replay_that_skips_a_recorded_step_is_refused() -> None:
    control = replaying(PlateauSchedule(), record((25, 0.5)))
    assert control.after_validation(20, {}) == []
    with pytest.raises(DecisionError, match="after step 25, but this run evaluated only at step 30"):
        control.after_validation(30, {})
    with pytest.raises(DecisionError, match=r"never reached recorded decisions \[0\]"):
        replaying(PlateauSchedule(), record((25, 0.5))).check_applied(30)


def test_early_stopping_by_patience_and_by_threshold() -> None:
    patience = EarlyStopping(EarlyStoppingPolicy(patience=2, min_delta=0.1))
    seen = [
        patience.observe(step, {"validation_loss": loss}, seq=0)
        for step, loss in ((10, 1.0), (20, 0.95), (30, 0.5), (40, 0.45), (50, 0.42))
    ]
    # 0.95 and 0.45 improve by less than 0.1: the second such evaluation in a row stops it.
    assert [d is not None for d in seen] == [False, False, False, False, True]
    assert seen[-1] == EarlyStopDecision(
        seq=0, step=50, reason="patience", metric="validation_loss", observed=0.42
    )
    accuracy = EarlyStopping(
        EarlyStoppingPolicy(metric="validation_accuracy", smaller_is_better=False, threshold=0.9)
    )
    assert accuracy.observe(10, {"validation_accuracy": 0.85}, seq=3) is None
    stop = accuracy.observe(20, {"validation_accuracy": 0.9}, seq=3)
    assert stop is not None and (stop.reason, stop.step, stop.seq) == ("threshold", 20, 3)


def test_a_replayed_early_stop_happens_at_the_recorded_step_only() -> None:
    recorded = EarlyStopDecision(seq=1, step=20, reason="scheduler", metric="validation_loss", observed=None)
    control = Controller(None, EarlyStoppingPolicy(patience=1), None, recorded=[recorded])
    assert control.after_validation(10, {"validation_loss": 9.0}) == []  # its own metrics do not matter
    assert control.after_validation(20, {"validation_loss": 0.1}) == [recorded]
    skipped = replaying(None, [recorded])  # also without a rule of its own (a scheduler's stop)
    with pytest.raises(DecisionError, match="recorded early stop after step 20 was missed"):
        skipped.after_validation(30, {})


def test_early_stopping_needs_a_rule() -> None:
    with pytest.raises(ValueError, match="needs 'patience', 'threshold' or both"):
        EarlyStoppingPolicy()
