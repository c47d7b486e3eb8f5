"""A spot node's reclaim notice, read by every rank at the same step: ``PreemptionWatch``.

Ray Train 2.60 learns from Ray Core that a node holding some of a run's workers is being drained
for preemption and tells every worker; ``ray.train.get_preemption_info()`` (alpha) returns that
notice, the same on every rank. The call is a barrier (every rank must make it the same number of
times), so the governed loop makes it every ``control_period`` steps, where it also reads the
pause/kill request. When the notice's deadline passes (plus ``FailureConfig.preemption_grace_s``,
0 here) Ray Train's controller tears the worker group down and restarts it, charged to
``max_preemption_failures`` (unlimited), not to ``max_restarts``; the restart resumes from the
newest verified checkpoint of the run directory.

On a notice the loop seals a checkpoint at that step boundary, records a ``PreemptedDecision`` and
trains nothing more: every step after the checkpoint would be trained again after the restart. It
waits (``wait_for_restart``). Returning instead would end the run: Ray Train counts a worker group
whose workers all returned as finished, even while it waits out a preemption; raising would charge
``max_restarts``. If the workers are still running ``RESTART_SLACK_S`` after Ray Train's teardown
was due, nothing is coming (the drain was withdrawn, or Ray changed): they train on rather than
stall, and a reclaim without notice then costs at most a checkpoint period, as it always did.

Off Ray Train (one worker in the driver's process, a Tune trial) the watch has no question to ask
and never sees a notice: Ray's local mode would answer None, and inside a Tune trial the call
raises.

    watch = PreemptionWatch(period=5, ask=ray.train.get_preemption_info)
    notice = watch.look(step)          # every rank, before each step: None, or a new notice
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

# Ray Train's DEFAULT_PREEMPTION_DEADLINE_S: how long its controller waits after a notice
# without a deadline before it restarts the worker group.
UNKNOWN_DEADLINE_S = 120.0
RESTART_SLACK_S = 30.0  # past the teardown's due time: several of the controller's polls


class PreemptionNotice(BaseModel):
    """Ray's ``PreemptionInfo``: the reclaimed nodes (each with the ranks it holds) and when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deadline_ms: int | None  # UNIX ms; None: the drain gave no deadline
    nodes: dict[str, list[int]]  # Ray node id → the ranks on it

    @classmethod
    def of(cls, info: Any) -> PreemptionNotice:
        """From ``ray.train.PreemptionInfo``."""
        nodes = {node: sorted(ranks) for node, ranks in info.preempted_node_to_ranks.items()}
        return cls(deadline_ms=info.deadline_ms, nodes=nodes)

    def teardown_due(self, seen_at: float) -> float:
        """When (UNIX s) Ray Train restarts the worker group for it, for a notice this worker first
        saw at ``seen_at`` (Ray's controller saw it no later)."""
        if self.deadline_ms is None:
            return seen_at + UNKNOWN_DEADLINE_S
        return self.deadline_ms / 1000


class PreemptionWatch:
    """Asks for a reclaim notice every ``period`` steps (``ask`` is None off Ray Train: never)."""

    def __init__(self, period: int, ask: Callable[[], Any] | None) -> None:
        self.period = period
        self.ask = ask
        self.seen: PreemptionNotice | None = None

    def look(self, step: int) -> PreemptionNotice | None:
        """Before ``step``, on every rank: a notice not seen before (every rank gets the same)."""
        if self.ask is None or (step + 1) % self.period:
            return None
        info = self.ask()
        if info is None:
            return None
        notice = PreemptionNotice.of(info)
        if notice == self.seen:  # the notice a worker trained on after waiting for nothing
            return None
        self.seen = notice
        return notice


def wait_for_restart(
    notice: PreemptionNotice,
    seen_at: float,
    *,
    now: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Wait for Ray Train to tear this worker down for ``notice`` (then this never returns).
    Returns the seconds waited when ``RESTART_SLACK_S`` past the due time nothing happened."""
    started = now()
    give_up = notice.teardown_due(seen_at) + RESTART_SLACK_S
    while (left := give_up - now()) > 0:
        sleep(min(left, 1.0))
    return now() - started
