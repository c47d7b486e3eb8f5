"""A replay follows the world sizes its trial trained on, segment by segment.

Summation order differs between world sizes, so a trial resized during its life (``govray resume
EXP --workers N``, an elastic restart) is reproduced bit for bit only on the same world sizes from
the same steps. Its final checkpoint records them, signed (``CheckpointState.world_history``: the
checkpoint chain's, so steps a failure lost and the new world trained again count as the new
world's). The replay runs one segment per entry: W1 workers from step 0 to s2, where it pauses
with a sealed checkpoint (``Attempt.pause_at``), then W2 workers resume from that checkpoint to s3
(a resume on another world size: the schedule's slots per step stay the run's first, which a
replay whose first segment runs on another world size plans from the start), and so on.
Its own checkpoints then carry the same history. A history of one entry is one run, as before.

Example::

    segments = replay_segments(recorded_world_history(final), max_steps=30)
    print(describe_segments(segments))
    # replay segments (the replayed trial's world sizes): 2 workers for steps 1-10, 1 worker for steps 11-30
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from govray.core.errors import GovrayError
from govray.train.checkpoints.files import STATE_FILE, CheckpointState
from govray.train.checkpoints.manifest import TrainedUnder, continued_history


class WorldHistoryError(GovrayError):
    """A recorded world-size history that no sequence of replay segments reproduces, or a replay of a
    resized trial asked to resume on other workers than that trial's."""

    exit_code = 11


@dataclass(frozen=True)
class WorldSegment:
    """Steps ``start + 1`` .. ``end`` of a replay, trained on ``workers`` workers."""

    start: int
    end: int
    workers: int


def recorded_world_history(checkpoint: Path) -> list[tuple[int, int]]:
    """The (from step, workers) entries of a checkpoint that ``verify_checkpoint`` verified (its
    signed manifest covers ``state.json``): from step 0, and at each resize."""
    state = CheckpointState.model_validate_json((checkpoint / STATE_FILE).read_text())
    return [(int(step), int(workers)) for step, workers in state.world_history]


def recorded_lineage(checkpoint: Path) -> list[TrainedUnder]:
    """Who trained a verified checkpoint's state under which hyperparameters, from which step,
    up to its step (``CheckpointState.hparams_history``: a PBT clone's begins with its donor's);
    an entry that began at the checkpoint's step trained nothing of it and is left out."""
    state = CheckpointState.model_validate_json((checkpoint / STATE_FILE).read_text())
    return [entry for entry in state.hparams_history if entry.from_step < state.step or entry.from_step == 0]


def split_at(segments: tuple[WorldSegment, ...], steps: list[int]) -> tuple[WorldSegment, ...]:
    """``segments`` cut where one of ``steps`` falls inside one (a replay's hyperparameters change
    there: a PBT clone's lineage), each part on its segment's world size."""
    parts: list[WorldSegment] = []
    for segment in segments:
        cuts = sorted({step for step in steps if segment.start < step < segment.end})
        bounds = [segment.start, *cuts, segment.end]
        parts += [WorldSegment(start, end, segment.workers) for start, end in itertools.pairwise(bounds)]
    return tuple(parts)


def recorded_slots_per_step(checkpoint: Path) -> int:
    """The slots per step of a verified checkpoint's schedule: its run's first world size (an
    elastic run's most workers), kept whatever world sizes followed."""
    state = CheckpointState.model_validate_json((checkpoint / STATE_FILE).read_text())
    return int(state.schedule["world_size"])


def replay_segments(history: list[tuple[int, int]], max_steps: int) -> tuple[WorldSegment, ...]:
    """The segments that reproduce ``history`` over ``max_steps`` steps. An entry that began where
    the next one begins trained nothing (a run resumed on another world size from its step-0
    checkpoint) and is left out."""
    entries = history
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


def segments_left(segments: tuple[WorldSegment, ...], done: int) -> tuple[WorldSegment, ...]:
    """What a run of ``segments`` still trains once ``done`` steps are: the segment ``done`` falls
    in from ``done`` on its own world size, and the ones after it."""
    return tuple(WorldSegment(max(s.start, done), s.end, s.workers) for s in segments if s.end > done)
