"""A run recorded on schedule version 1 (by govray before version 2 existed) still verifies,
recomputes its ledger, resumes bit for bit and answers row lookups as it did.

The run (``tests/data/schedule_v1_run``, see its README) is extracted anywhere: its run spec names
the paths it was made at, so the resumed run is given the extracted shards and a run directory of
its own, as a relocated run's spec would be.
"""

from __future__ import annotations

import contextlib
import json
import platform
import tarfile
from functools import partial
from pathlib import Path

import pytest
import torch

from govray.core.keys import platform_key, platform_key_path
from govray.data.reader import ShardReader
from govray.data.schedule import ScheduleSpec
from govray.data.shards import ShardSet
from govray.provenance.locations import run_spec_of
from govray.provenance.predicates import routing_of
from govray.provenance.rows import row_steps
from govray.train.checkpoints.files import (
    MODEL_FILE,
    OPTIMIZER_META,
    OPTIMIZER_TENSORS,
    STATE_FILE,
    CheckpointError,
    CheckpointState,
    load_checkpoint,
)
from govray.train.parallel.worker import RouteRows
from govray.train.run.loop import train_worker
from govray.train.run.reports import StepReport
from govray.train.run.session import LocalSession
from govray.train.step.ledger import Ledger, recompute_ledger
from govray.train.trial import make_trial

ARCHIVE = Path(__file__).parent / "data" / "schedule_v1_run" / "run.tar.xz"
REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """This machine's CPU model name, as /proc/cpuinfo gives it ("" where it does not)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor()


def cpu_vendor(model: str) -> str:
    return next((vendor for vendor in ("Intel", "AMD") if vendor in model), model)


class StoredRun:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.expected = json.loads((root / "expected.json").read_text())
        self.run_dir = root / Path(self.expected["run_dir"]).relative_to(self.expected["root"])
        self.shard_root = root / Path(self.expected["shard_root"]).relative_to(self.expected["root"])
        self.first, self.second = (self.run_dir / f"checkpoint_{step:08d}" for step in (10, 20))
        self.spec = run_spec_of(self.second)

    def skip_unless_made_on_this_hardware_class(self) -> None:
        """Bit-exactness holds on the hardware class a run was made on (ARCHITECTURE.md, "Scope
        of bit-exactness"): torch's CPU kernels differ with the instruction set it dispatches to and
        with the CPU's vendor (the run made on an AVX512 Intel Xeon does not resume bit for bit on
        an AVX512 AMD EPYC, with the code that made it as with today's)."""
        hardware = json.loads((self.root / "hardware.json").read_text())
        made_on = (hardware["cpu_capability"], cpu_vendor(hardware["cpu_model"]))
        here = (torch.backends.cpu.get_cpu_capability(), cpu_vendor(cpu_model()))
        if made_on != here:
            pytest.skip(f"the stored run was made on {made_on} CPU kernels, this machine runs {here}")

    def state(self, checkpoint: Path) -> CheckpointState:
        return CheckpointState.model_validate_json((checkpoint / STATE_FILE).read_text())


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> StoredRun:
    root = tmp_path_factory.mktemp("v1-run")
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(root, filter="data")
    return StoredRun(root)


def test_the_stored_run_recorded_schedule_version_1_and_its_checkpoints_verify(stored: StoredRun) -> None:
    assert "schedule_version" not in json.loads((stored.second / "run.json").read_text())
    assert stored.spec.schedule_version == 1  # a run.json from before the field: version 1
    for checkpoint in (stored.first, stored.second):
        loaded = load_checkpoint(checkpoint, stored.spec.trust)
        assert loaded.state.schedule["version"] == 1
        assert ScheduleSpec.from_json(loaded.state.schedule).digest() == loaded.state.schedule_digest


def test_the_ledgers_of_the_stored_run_recompute_from_its_version_1_schedule(stored: StoredRun) -> None:
    trial = make_trial(stored.spec.trial, stored.spec.hparams, stored.spec.settings)
    tokens = RouteRows(ShardReader(ShardSet.open(stored.shard_root))).tokens(trial)
    for checkpoint in (stored.first, stored.second):
        state = stored.state(checkpoint)
        schedule = ScheduleSpec.from_json(state.schedule)
        assert schedule.version == 1
        recomputed = recompute_ledger(schedule, routing_of(stored.spec), state.step, tokens)
        assert recomputed == Ledger.from_json(state.ledger)


def test_row_lookups_in_the_stored_run_give_the_steps_the_old_govray_gave(stored: StoredRun) -> None:
    schedule = ScheduleSpec.from_json(stored.state(stored.second).schedule)
    lookups = stored.expected["lookups"]
    assert any(lookup["found"][0] for lookup in lookups)  # some rows were trained
    for lookup in lookups:
        found = row_steps(schedule, lookup["route"], lookup["position"], lookup["steps"])
        assert [list(steps) for steps in found] == lookup["found"], lookup


def rerun(stored: StoredRun, directory: Path, **changes: object) -> list[StepReport]:
    """The stored run's spec, run again in-process under ``directory`` with ``changes``: signed by
    this machine's platform key, on the extracted shards."""
    key = platform_key(directory / "home")
    trust = stored.spec.trust.model_copy(deep=True)
    trust.add(key.public_key)
    update = {
        "shard_root": str(stored.shard_root),
        "run_dir": str(directory / "run"),
        "platform_key": str(platform_key_path(directory / "home")),
        "trust": trust,
        "code_dir": str(REPO),
        **changes,
    }
    reports: list[StepReport] = []
    spec = stored.spec.model_copy(update=update)
    train_worker(spec.model_dump(mode="json"), session=partial(LocalSession, deliver=reports.append))
    return reports


def assert_same_checkpoint(mine: Path, recorded: Path) -> None:
    for name in (MODEL_FILE, "adapter-pii-lora.safetensors", OPTIMIZER_TENSORS, OPTIMIZER_META):
        assert (mine / name).read_bytes() == (recorded / name).read_bytes(), name
    state = CheckpointState.model_validate_json((mine / STATE_FILE).read_text())
    expected = CheckpointState.model_validate_json((recorded / STATE_FILE).read_text())
    assert (state.step, state.ledger) == (expected.step, expected.ledger)
    assert (state.schedule, state.schedule_digest) == (expected.schedule, expected.schedule_digest)


def test_resuming_the_stored_run_from_its_first_checkpoint_reproduces_its_second_bit_for_bit(
    stored: StoredRun, tmp_path: Path
) -> None:
    stored.skip_unless_made_on_this_hardware_class()
    reports = rerun(stored, tmp_path, resume_checkpoint=str(stored.first))
    assert [report.step for report in reports][-1] == 20 and min(r.step for r in reports) > 10
    assert_same_checkpoint(tmp_path / "run" / stored.second.name, stored.second)


def test_rerunning_the_stored_run_from_the_start_reproduces_its_first_checkpoint(
    stored: StoredRun, tmp_path: Path
) -> None:
    """What a replay that excludes nothing does: the source's schedule version, the same slots."""
    stored.skip_unless_made_on_this_hardware_class()
    rerun(stored, tmp_path, max_steps=10)
    assert_same_checkpoint(tmp_path / "run" / stored.first.name, stored.first)


def test_resuming_a_version_1_checkpoint_on_version_2_is_refused_naming_both(
    stored: StoredRun, tmp_path: Path
) -> None:
    with pytest.raises(CheckpointError, match="written on schedule version 1, this run is on version 2"):
        rerun(stored, tmp_path, resume_checkpoint=str(stored.first), schedule_version=2)
