"""Each rank's log ends its run with one ``timings`` line (``govray.train.run.timings``): where the
worker's wall time went, what ``jobs/benchmarks/trial_cost.py`` reads (issue 33, item 4)."""

from __future__ import annotations

from govray.core.logs import log_path
from govray.tracking.lineage import checkpoints
from govray.train.run.timings import read_timings
from jobs.examples.digits.golden import GOLDEN_STEPS
from tests.helpers.golden import GoldenRun


def test_every_rank_logs_one_timing_per_step_and_rank_0_one_per_checkpoint(golden_run: GoldenRun) -> None:
    trial = golden_run.store.get_trial(golden_run.outcome.trial_id)
    recorded = checkpoints(golden_run.store, trial.id)
    for rank in (0, 1):
        timings = read_timings(log_path(golden_run.config.storage_path, trial.ray_run_name, rank))
        assert timings is not None
        parts = timings["parts"]
        assert isinstance(parts, dict) and timings["process_age"] >= 0  # type: ignore[operator]
        counts = {name: len(seconds) for name, seconds in parts.items()}
        assert (counts["open"], counts["build"], counts["first_step"], counts["close"]) == (1, 1, 1, 1)
        assert counts["first_step"] + counts["steps"] == GOLDEN_STEPS
        assert counts.get("checkpoint", 0) == (len(recorded) if rank == 0 else 0)
        assert all(seconds >= 0 for part in parts.values() for seconds in part)
