"""The signer recomputes a checkpoint's ledger before it seals it (issue 49): a worker that writes
a ledger hiding a corpus's reach — fewer examples, one tensor left out, an entry added — or a
schedule that does not hash to its digest, gets nothing signed, and the refusal names where the
ledger differs. The honest checkpoint (the golden run's, copied into a run of the test's own)
seals; every run of the suite seals through the same check (the development signer's)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from govray.core.keys import KeyRole, SigningKey
from govray.signer.service import Signer
from govray.train.checkpoints.ledger_check import LedgerMismatch
from govray.train.checkpoints.manifest import MANIFEST_FILE, SIGNATURE_FILE, STATE_FILE
from govray.train.checkpoints.sealing import SealRefused
from tests.helpers.golden import GoldenRun, final_checkpoint


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gl-", dir="/tmp")) / "run-ledger"
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


def _copy(golden_run: GoldenRun, run_dir: Path) -> Path:
    source = final_checkpoint(golden_run.outcome.run_dir)
    folder = Path(shutil.copytree(source, run_dir / source.name))
    for stale in (MANIFEST_FILE, SIGNATURE_FILE):
        (folder / stale).unlink()
    return folder


def _edit_state(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    state = json.loads((folder / STATE_FILE).read_text())
    change(state)
    (folder / STATE_FILE).write_text(json.dumps(state))


def _fewer_examples(state: dict[str, Any]) -> None:
    state["ledger"]["entries"][0]["examples"] -= 1


def _a_tensor_left_out(state: dict[str, Any]) -> None:
    del state["ledger"]["entries"][-1]


def _an_entry_added(state: dict[str, Any]) -> None:
    entry = dict(state["ledger"]["entries"][0])
    state["ledger"]["entries"].append({**entry, "tensor": "fc_out.weight_not_reached"})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_fewer_examples, "claimed"),
        (_a_tensor_left_out, "claimed nothing"),
        (_an_entry_added, "recomputed nothing"),
    ],
)
def test_a_ledger_that_is_not_the_recomputed_one_is_refused_and_the_honest_one_sealed(
    golden_run: GoldenRun,
    run_dir: Path,
    tmp_path: Path,
    change: Callable[[dict[str, Any]], None],
    named: str,
) -> None:
    signer = Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "state")
    folder = _copy(golden_run, run_dir)
    step = int(folder.name.removeprefix("checkpoint_"))
    honest = (folder / STATE_FILE).read_bytes()
    _edit_state(folder, change)
    capability, _ = signer.open_run(str(run_dir))
    with pytest.raises(LedgerMismatch, match=f"not the one recomputed.*{named}"):
        signer.seal(capability, str(folder), step, {})
    assert not (folder / MANIFEST_FILE).exists()
    (folder / STATE_FILE).write_bytes(honest)
    sealed = signer.seal(capability, str(folder), step, {})  # the refused seal recorded nothing
    assert json.loads(sealed.manifest)["step"] == step


def test_a_schedule_not_hashing_to_its_digest_and_a_missing_run_spec_are_refused(
    golden_run: GoldenRun, run_dir: Path, tmp_path: Path
) -> None:
    signer = Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "state")
    folder = _copy(golden_run, run_dir)
    step = int(folder.name.removeprefix("checkpoint_"))
    capability, _ = signer.open_run(str(run_dir))

    def other_seed(state: dict[str, Any]) -> None:
        state["schedule"]["seed"] += 1  # (the rows each step read: a ledger recomputed from them)

    _edit_state(folder, other_seed)
    with pytest.raises(LedgerMismatch, match="does not hash to its schedule_digest"):
        signer.seal(capability, str(folder), step, {})
    shutil.rmtree(folder)
    folder = _copy(golden_run, run_dir)
    (folder / "run.json").unlink()
    with pytest.raises(SealRefused, match="holds no run.json"):
        signer.seal(capability, str(folder), step, {})
