"""The signer recomputes a checkpoint's ledger before it seals it (issue 49): a worker that writes
a ledger hiding a corpus's reach — fewer examples, one tensor left out, an entry added — or a
schedule that does not hash to its digest, gets nothing signed, and the refusal names where the
ledger differs; nor does one whose run spec (``run.json``: the routing the ledger is recomputed
with) is not the one the run was launched with. The honest checkpoint (the golden run's, copied
into a run of the test's own) seals; every run of the suite seals through the same check (the
development signer's)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from govray.core.canonical import file_sha256
from govray.core.keys import KeyRole, SigningKey
from govray.data.schedule import ScheduleSpec
from govray.signer.service import Signer
from govray.train.checkpoints import ledger_check
from govray.train.checkpoints.ledger_check import LedgerMismatch, expected_ledger
from govray.train.checkpoints.manifest import MANIFEST_FILE, SIGNATURE_FILE, STATE_FILE
from govray.train.checkpoints.sealing import SealRefused
from govray.train.runspec import RUN_SPEC_FILE, parse_run_spec
from tests.helpers.golden import GoldenRun, final_checkpoint
from tests.helpers.signing import run_spec_at, training_state


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
    capability, _ = signer.open_run(str(run_dir), file_sha256(folder / RUN_SPEC_FILE))
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
    capability, _ = signer.open_run(str(run_dir), file_sha256(folder / RUN_SPEC_FILE))

    def other_seed(state: dict[str, Any]) -> None:
        state["schedule"]["seed"] += 1  # (the rows each step read: a ledger recomputed from them)

    _edit_state(folder, other_seed)
    with pytest.raises(LedgerMismatch, match="does not hash to its schedule_digest"):
        signer.seal(capability, str(folder), step, {})
    shutil.rmtree(folder)
    folder = _copy(golden_run, run_dir)
    (folder / "run.json").unlink()
    with pytest.raises(SealRefused, match="run.json is not the run spec this run was launched with.*none"):
        signer.seal(capability, str(folder), step, {})
    unbound = Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "unbound")
    capability, _ = unbound.open_run(str(run_dir))  # (a search driver's channel: for Tune state only)
    with pytest.raises(SealRefused, match="opened without its run spec: it seals no checkpoint"):
        unbound.seal(capability, str(folder), step, {})


def _forged(folder: Path, step: int) -> None:
    """Rewrite the folder's run spec and ledger consistently, as a trial writing both could: the
    licensed corpus's route no longer reaches the hidden layer, and the ledger is the one
    recomputed with that routing (so the ledger check alone agrees with it)."""
    spec = json.loads((folder / RUN_SPEC_FILE).read_text())
    masks = spec["routing"]["masks"]
    hidden = [i for i, p in enumerate(spec["routing"]["parameters"]) if p["name"].startswith("hidden.")]
    assert hidden and all(masks["licensed"][i] for i in hidden)  # (the honest routing reaches it)
    masks["licensed"] = [ok and i not in hidden for i, ok in enumerate(masks["licensed"])]
    (folder / RUN_SPEC_FILE).write_text(json.dumps(spec, indent=1))
    forged = parse_run_spec((folder / RUN_SPEC_FILE).read_bytes(), folder / RUN_SPEC_FILE)
    state = json.loads((folder / STATE_FILE).read_text())
    ledger = expected_ledger(ScheduleSpec.from_json(state["schedule"]), forged.routing, step, None)
    state["ledger"] = ledger.to_json()
    (folder / STATE_FILE).write_text(json.dumps(state))


def test_a_run_spec_and_ledger_rewritten_together_are_refused_against_the_launchs_run_spec(
    golden_run: GoldenRun, run_dir: Path, tmp_path: Path
) -> None:
    """The ledger is recomputed with the routing of the folder's ``run.json``, which rank 0 writes:
    a trial rewriting both consistently hides the licensed corpus's reach into the hidden layer.
    The signer seals only the run spec the launch opened the run with."""
    folder = _copy(golden_run, run_dir)
    step = int(folder.name.removeprefix("checkpoint_"))
    launched = file_sha256(folder / RUN_SPEC_FILE)
    honest = {name: (folder / name).read_bytes() for name in (RUN_SPEC_FILE, STATE_FILE)}
    _forged(folder, step)
    state = json.loads((folder / STATE_FILE).read_text())
    assert not any(
        e["corpus"].endswith("licensed") and e["tensor"].startswith("hidden.")
        for e in state["ledger"]["entries"]
    )
    # The forgery is consistent: a signer told the forged spec (not the launch's) seals it.
    fooled = Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "fooled")
    capability, _ = fooled.open_run(str(run_dir), file_sha256(folder / RUN_SPEC_FILE))
    assert json.loads(fooled.seal(capability, str(folder), step, {}).manifest)["step"] == step
    signer = Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "state")
    capability, _ = signer.open_run(str(run_dir), launched)
    with pytest.raises(
        SealRefused, match=f"run.json is not the run spec this run was launched with .sha256 {launched}"
    ):
        signer.seal(capability, str(folder), step, {})
    for name, content in honest.items():
        (folder / name).write_bytes(content)
    assert json.loads(signer.seal(capability, str(folder), step, {}).manifest)["step"] == step


def test_each_seal_recomputes_only_the_steps_after_the_last_it_checked_and_still_refuses(
    golden_run: GoldenRun, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's seals move forward, so the signer recomputes the steps after the last checkpoint it
    checked under the same run spec (not the whole run at every seal: quadratic in its length);
    a ledger forged at a later step is still refused. (Where the schedules disagree on an earlier
    step, it recomputes from step 0: ``test_ledger.py``.)"""
    ranges: list[tuple[int, int]] = []
    real = ledger_check.recompute_ledger

    def counted(*args: Any, **kwargs: Any) -> Any:
        ranges.append((kwargs.get("start", 0), args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(ledger_check, "recompute_ledger", counted)
    signer = Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "state")
    source = golden_run.outcome.run_dir
    capability, _ = signer.open_run(str(run_dir), run_spec_at(source, 10).sha256())
    for step in (10, 20):
        folder = training_state(run_dir / f"checkpoint_{step:08d}", source, step)
        signer.seal(capability, str(folder), step, {})
    last = training_state(run_dir / "checkpoint_00000030", source, 30)
    _edit_state(last, _fewer_examples)
    with pytest.raises(LedgerMismatch, match="not the one recomputed"):
        signer.seal(capability, str(last), 30, {})
    training_state(last, source, 30)  # (the honest state back)
    signer.seal(capability, str(last), 30, {})
    assert ranges == [(0, 10), (10, 20), (20, 30), (30, 30)]  # (the refused state's schedule agreed)
    # Another signer (a restart: nothing kept) checks step 30 from step 0 and agrees.
    ranges.clear()
    again = Signer(SigningKey.generate(KeyRole.PLATFORM), tmp_path / "again")
    capability, _ = again.open_run(str(run_dir), run_spec_at(source, 10).sha256())
    again.seal(capability, str(last), 30, {})
    assert ranges == [(0, 30)]
