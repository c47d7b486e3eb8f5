"""A replay follows the world sizes its trial trained on, segment by segment.

Summation order differs between world sizes, so a trial resized during its life (``govray resume
EXP --workers N``, an elastic restart) is reproduced bit for bit only on the same world sizes from
the same steps. Its final checkpoint records them, signed (``CheckpointState.world_history``: the
checkpoint chain's, so steps a failure lost and the new world trained again count as the new
world's). The replay runs one segment per entry: W1 workers from step 0 to s2, where it pauses
with a sealed checkpoint (``RunSpec.pause_at``), then W2 workers resume from that checkpoint to s3
(a resume on another world size: the schedule's slots per step stay the run's first, which a
replay whose first segment runs on another world size plans from the start), and so on.
Its own checkpoints then carry the same history. A history of one entry is one run, as before.

Example::

    segments = replay_segments(recorded_world_history(final), max_steps=30, configured=2)
    print(describe_segments(segments))
    # replay segments (the replayed trial's world sizes): 2 workers for steps 1-10, 1 worker for steps 11-30
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from govray.core.errors import GovrayError
from govray.platform.mlflow_mirror import mirrored
from govray.platform.plan import RunPlan
from govray.platform.resume import on_workers
from govray.platform.runner import Progress, TrialOutcome, start_planned, train_run
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, TrialState
from govray.train.checkpoint import STATE_FILE, CheckpointState
from govray.train.checkpoint_manifest import continued_history


class WorldHistoryError(GovrayError):
    """A recorded world-size history that no sequence of replay segments reproduces."""

    exit_code = 11


@dataclass(frozen=True)
class WorldSegment:
    """Steps ``start + 1`` .. ``end`` of a replay, trained on ``workers`` workers."""

    start: int
    end: int
    workers: int


def recorded_world_history(checkpoint: Path) -> list[tuple[int, int]]:
    """The (from step, workers) entries of a checkpoint that ``verify_checkpoint`` verified (its
    signed manifest covers ``state.json``); empty for a checkpoint written before they were kept."""
    state = CheckpointState.model_validate_json((checkpoint / STATE_FILE).read_text())
    return [(int(step), int(workers)) for step, workers in state.world_history]


def recorded_slots_per_step(checkpoint: Path) -> int:
    """The slots per step of a verified checkpoint's schedule: its run's first world size (an
    elastic run's most workers), kept whatever world sizes followed."""
    state = CheckpointState.model_validate_json((checkpoint / STATE_FILE).read_text())
    return int(state.schedule["world_size"])


def replay_segments(
    history: list[tuple[int, int]], max_steps: int, configured: int
) -> tuple[WorldSegment, ...]:
    """The segments that reproduce ``history`` over ``max_steps`` steps (no history: one segment on
    the ``configured`` workers, as a run was before world sizes could change). An entry that began
    where the next one begins trained nothing (recorded so before ``continued_history`` folded it:
    a run resumed on another world size from its step-0 checkpoint) and is left out."""
    entries = history or [(0, configured)]
    starts = [step for step, _ in entries]
    if starts[0] != 0 or starts != sorted(starts) or starts[-1] >= max_steps:
        raise WorldHistoryError(
            f"world-size history {entries} does not split steps 1-{max_steps} into segments: it "
            "must begin at step 0, and each entry at or after the one before, before the last step"
        )
    folded: list[tuple[int, int]] = []
    for step, workers in entries:
        folded = continued_history(folded, step, workers)
    ends = [start for start, _ in folded[1:]] + [max_steps]
    return tuple(
        WorldSegment(start, end, workers) for (start, workers), end in zip(folded, ends, strict=True)
    )


def describe_segments(segments: tuple[WorldSegment, ...]) -> str:
    """One line: the world size of each segment and its steps."""
    parts = [
        f"{s.workers} worker{'s' if s.workers != 1 else ''} for steps {s.start + 1}-{s.end}" for s in segments
    ]
    return "replay segments (the replayed trial's world sizes): " + ", ".join(parts)


def run_segments(
    plan: RunPlan,
    experiment: Experiment,
    store: TrackingStore,
    segments: tuple[WorldSegment, ...],
    *,
    progress: Progress | None = None,
    replay_of: int | None = None,
) -> TrialOutcome:
    """Train the planned trial one segment after another under one trial and run name: each
    segment but the last pauses at its end with a sealed checkpoint, the next resumes from it on
    its own world size. Returns the last segment's outcome, or that of a segment that ended
    otherwise (paused or killed on request elsewhere, or completed early: an early stop)."""
    assert experiment.id is not None
    trial_id, run_name, spec = start_planned(plan, experiment, store, replay_of=replay_of)
    outcome: TrialOutcome | None = None
    with mirrored(store, plan.config.tracking.mlflow, experiment.id):
        for segment in segments:
            pause_at = segment.end if segment.end < spec.max_steps else None
            outcome = train_run(
                on_workers(plan.config, segment.workers),
                plan.checked,
                plan.storage,
                experiment,
                store,
                trial_id,
                run_name,
                spec.model_copy(update={"pause_at": pause_at}),
                progress,
            )
            paused_at_end = outcome.state == TrialState.PAUSED.value and outcome.steps_done == segment.end
            if pause_at is None or not paused_at_end:
                break
    assert outcome is not None
    return outcome
