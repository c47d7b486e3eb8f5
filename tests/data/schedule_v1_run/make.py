"""Build the stored version-1 run (run with govray at commit b519793, before schedule version 2).

    git worktree add /tmp/v1src b519793
    cd /tmp/v1src && PYTHONPATH=/tmp/v1src python /work/wt-sched/tests/data/schedule_v1_run/make.py \
        /tmp/govray-v1-run /work/wt-sched/tests/data/schedule_v1_run/run.tar.xz

One worker in-process (``LocalSession``, no Ray), the digits example, 20 steps, a checkpoint every
10. Packed: the shards, both checkpoints, the platform's public key (not its private key), and
``expected.json``: the rows' steps as that govray's row lookup gave them.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
from functools import partial
from pathlib import Path

ROOT, ARCHIVE = Path(sys.argv[1]), Path(sys.argv[2])
os.environ["GOVRAY_HOME"] = str(ROOT / "home")  # a platform key made for this run alone

from govray.data.schedule import ScheduleSpec, slot  # noqa: E402
from govray.platform.run.plan import plan_run  # noqa: E402
from govray.provenance.rows import row_steps  # noqa: E402
from govray.train.checkpoints.files import STATE_FILE, find_checkpoints  # noqa: E402
from govray.train.run.loop import train_worker  # noqa: E402
from govray.train.run.session import LocalSession  # noqa: E402
from jobs.examples.digits.golden import GOLDEN_HPARAMS, golden_example, opened  # noqa: E402

STEPS = 20

HPARAMS = {**GOLDEN_HPARAMS, "optimizer": "adamw", "lr": 0.01}  # AdamW: optimizer state to compare
example = golden_example(ROOT, workers=1, max_length={"batches": STEPS}, hparams=HPARAMS)
config, store, checked, experiment, ingested = opened(example)
spec = plan_run(config, checked, ingested.root).named("v1-run", {})
spec = spec.model_copy(update={"log_dir": "", "control_file": ""})
train_worker(spec.model_dump(mode="json"), session=partial(LocalSession, deliver=lambda report: None))
found = find_checkpoints(Path(spec.run_dir))
assert [path.name for path in found] == ["checkpoint_00000010", "checkpoint_00000020"], found
schedule = ScheduleSpec.from_json(json.loads((found[-1] / STATE_FILE).read_text())["schedule"])
# Rows the run trained (the first rows of three steps' slots), and a spread of every route's rows
# looked up over three epochs of the schedule.
held = [slot(schedule, step, 0) for step in (0, 9, 19)]
trained = [(item.route, row) for item in held for row in item.rows[:3]]
spread = [(r.route, position) for r in schedule.routes for position in range(0, r.rows, max(1, r.rows // 5))]
lookups = [
    {"route": route, "position": p, "steps": steps, "found": row_steps(schedule, route, p, steps)}
    for steps, rows in ((STEPS, trained), (3 * schedule.steps_per_epoch, spread))
    for route, p in rows
]
expected = {"root": str(ROOT), "shard_root": str(ingested.root), "run_dir": spec.run_dir, "lookups": lookups}
(ROOT / "expected.json").write_text(json.dumps(expected, indent=1))
with tarfile.open(ARCHIVE, "w:xz") as archive:
    for path in [ingested.root, *found, ROOT / "home" / "keys" / "platform.pub", ROOT / "expected.json"]:
        archive.add(path, arcname=str(path.relative_to(ROOT)))
