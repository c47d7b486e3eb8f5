"""A step run in rounds: a world of fewer workers than the step's slots (a run resumed on fewer
ranks than it started with) runs ``ceil(S / W)`` slots per rank, one per round
(``data.slots.rank_slots``), each under its own route, seed and adapter.

The divisors are the step's (every slot's examples); what a round's route decides is the
masking. Under FSDP the reduce-scatter of every micro-batch is masked by its round's route and
adds into the sharded gradient, so the shards simply keep summing and are divided once at the
end. What is reduced per slot — DDP's comm hook, the adapters' flat all-reduce, one worker's
``govern_local`` — would, in a second round, reduce again what the first one already reduced
(DDP's bucket reads the accumulated ``.grad``), and would mask the first round's contribution
with the second round's route. So each round's reduced gradients are moved out of ``.grad`` and
set aside (:class:`RoundSums`), summed in round order, and put back before the clipping and
the optimizer step. Every tensor's gradient is then the sum over the step's slots allowed to
update it, each divided by the step's count: exact zeros where no slot may, the same counts
and ledger as on S workers. Only the summation order differs from an S-worker run, which is
why the world-size history is recorded (``CheckpointState.world_history``).

With W = S there is one round and nothing is set aside: the computation is the one-slot step's.
fp16 (a loss scale per route, its overflow attributed to the rank's route) is refused with
rounds (``refuse_rounds``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from govray.core.errors import ConfigError


class RoundSums:
    """Each tensor's reduced gradients over a step's rounds, summed in round order."""

    def __init__(self) -> None:
        self._sums: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def set_aside(self, parameters: Sequence[nn.Parameter]) -> None:
        """Move these tensors' reduced gradients out of ``.grad``, adding them to the sums."""
        for parameter in parameters:
            grad = parameter.grad
            if grad is None:
                continue
            kept = self._sums.get(id(parameter))
            if kept is None:
                self._sums[id(parameter)] = (parameter, grad)
            else:
                kept[1].add_(grad)
            parameter.grad = None

    def put_back(self) -> None:
        """Every summed gradient into its tensor's ``.grad`` (None stays None: no round had one)."""
        for parameter, total in self._sums.values():
            parameter.grad = total
        self._sums = {}


def refuse_rounds(slots_per_step: int, world_size: int, fp16: bool) -> None:
    """Refuse what rounds cannot run exactly: fp16's per-route loss scales (a rank's overflow is
    attributed to its one route)."""
    if fp16 and slots_per_step > world_size:
        raise ConfigError(
            f"precision fp16: this run has {slots_per_step} slots per step and {world_size} "
            f"worker(s); fp16's per-route loss scaling needs one slot per worker (resume it on "
            f"{slots_per_step} workers)"
        )
