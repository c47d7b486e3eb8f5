"""fp16's dynamic loss scale, one per route (ARCHITECTURE.md, "Precision").

Each rank multiplies its slot's loss by its route's scale; the governed allreduce unscales the
rank's own contribution by that scale in its masking pass, before the sum, and checks it. An
overflow is therefore attributed to the route whose slot produced it: only the tensors that
route may update skip the step (``grad = None``), and only that route's scale backs off. The
other routes' tensors step as usual, so an adapter route's overflow never touches the base.

The rule per route is torch's ``GradScaler``: start at 2**16; on an overflow multiply by 0.5;
after 2000 steps of that route without one, multiply by 2. Each skip is a recorded decision
(``LossScaleSkip``); a replay applies the record instead of its own check, so the scales and the
skipped steps of the routes it keeps are the source's.

Example (the step; ``found`` is what the overflow check saw on every rank)::

    scaler = LossScaler(recorded=None, next_seq=lambda: 0)
    loss = losses.sum() * scaler.scale(route)
    skipped = scaler.settle(steps_done=t + 1, present={"public", "pii"}, found=frozenset({"pii"}))
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from govray.train.control.decisions import DecisionError, LossScaleSkip

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class LossScalingState(BaseModel):
    """What the scaler remembers between steps (kept in every checkpoint)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scales: dict[str, float] = Field(default_factory=dict)  # routes not listed: INIT_SCALE
    good_steps: dict[str, int] = Field(default_factory=dict)  # steps since the last overflow
    skips: tuple[LossScaleSkip, ...] = ()


class LossScaler:
    """Per-route loss scales and the skip decisions they led to; live, or applying ``recorded``."""

    def __init__(self, recorded: Sequence[LossScaleSkip] | None, next_seq: Callable[[], int]) -> None:
        self.recorded = None if recorded is None else {skip.step: skip for skip in recorded}
        self.next_seq = next_seq
        self.state = LossScalingState()

    @property
    def skips(self) -> tuple[LossScaleSkip, ...]:
        return self.state.skips

    def scale(self, route: str | None) -> float:
        """The loss scale of ``route``'s slots (1 for an empty slot: nothing to scale)."""
        return 1.0 if route is None else self.state.scales.get(route, INIT_SCALE)

    def settle(self, steps_done: int, present: Collection[str], found: frozenset[str]) -> frozenset[str]:
        """After a step's backward: the routes whose tensors skip it (``found`` live; the record
        in a replay), recorded as a decision; every ``present`` route's scale moves on."""
        skipped = found
        if self.recorded is not None:
            recorded = self.recorded.get(steps_done)
            skipped = frozenset(recorded.routes) & frozenset(present) if recorded else frozenset()
            if found - skipped:
                raise DecisionError(
                    f"step {steps_done - 1}: routes {sorted(found - skipped)} overflowed in this replay "
                    "but not in the recorded run (it is not the same computation)"
                )
        scales, good = dict(self.state.scales), dict(self.state.good_steps)
        for route in present:
            scale = scales.get(route, INIT_SCALE)
            if route in skipped:
                scales[route], good[route] = scale * BACKOFF_FACTOR, 0
            elif good.get(route, 0) + 1 >= GROWTH_INTERVAL:
                scales[route], good[route] = scale * GROWTH_FACTOR, 0
            else:
                good[route] = good.get(route, 0) + 1
        skips = self.state.skips
        if skipped:
            routes = sorted(skipped)
            skip = LossScaleSkip(
                # a replay keeps the record's number (its source's preemptions are not re-made)
                seq=self.next_seq() if self.recorded is None else self.recorded[steps_done].seq,
                step=steps_done,
                routes=routes,
                scales=None if self.recorded is not None else [self.scale(route) for route in routes],
            )
            skips = (*skips, skip)
        self.state = LossScalingState(scales=scales, good_steps=good, skips=skips)
        return skipped

    def to_json(self) -> dict[str, Any]:
        return self.state.model_dump(mode="json")

    def restore(self, state: dict[str, Any]) -> None:
        if state:
            self.state = LossScalingState.model_validate(state)
