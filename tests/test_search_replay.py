"""Every trial of a search can be replayed: search → replay a completed and an ASHA-stopped trial
without the PII corpus (removal = replay, bit for bit) → register the best trial, remove its
adapter, and `govray lineage row` finds the version without it. Trials trained in warm trial hosts
and in Tune's own actors alike (2-worker trials: ``test_search_workers.py``; a PBT clone's
refusal: ``test_search.py``)."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from govray.config.experiment import ExperimentConfig
from govray.core.canonical import file_sha256
from govray.core.dsse import sign_envelope
from govray.core.keys import (
    KeyRole,
    SigningKey,
    TrustConfig,
    load_trust,
    platform_key,
    platform_trust,
    save_trust,
)
from govray.core.storage import Storage, open_storage
from govray.platform.rerun.resume import resumes_search
from govray.platform.run.plan import code_directory, run_spec_path
from govray.platform.search.driver import SearchOutcome
from govray.platform.search.tune_trial import SearchError
from govray.provenance.row_reach import row_reach
from govray.provenance.statement_types import COVERAGE_TYPE, PROVENANCE_TYPE, statement_type
from govray.tracking.lineage import attestations, final_checkpoint_record
from govray.tracking.store import TrackingStore
from govray.tracking.tables import TrialState
from govray.train.checkpoints.files import MANIFEST_FILE, SIGNATURE_FILE, STATE_FILE, Manifest
from govray.train.checkpoints.manifest import MANIFEST_TYPE
from govray.train.reproduce.record import ReproducibilityRecord
from tests.helpers.builders import write_signed_policy
from tests.helpers.search import searched
from tests.helpers.search_replays import (
    ADAPTER_FILE,
    WRITERS,
    assert_removal_equals_replay,
    final_folder,
    govray,
    replay_cli,
    replayed_without_writers,
)

# Rungs at steps 10 and 20; seeded samples and deterministic training stop some trials at 10.
ASHA: dict[str, Any] = {
    "name": "asha",
    "max_trials": 4,
    "divisor": 2,
    "max_rungs": 2,
    "max_length": {"batches": 20},
}


@dataclass(frozen=True)
class AshaSearch:
    root: Path
    outcome: SearchOutcome
    store: TrackingStore
    completed: int  # a trial that trained all 20 steps
    stopped: int  # a trial ASHA stopped at step 10

    @property
    def trust(self) -> TrustConfig:
        return platform_trust(platform_key())

    @property
    def storage(self) -> Storage:
        experiment = self.store.get_trial(self.completed).experiment_id
        return open_storage(
            ExperimentConfig.model_validate_json(
                self.store.get_experiment(experiment).config_json
            ).storage_path
        )


def asha_search(root: Path, hosts: bool) -> AshaSearch:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GOVRAY_TRIAL_HOSTS", "1" if hosts else "0")
        outcome, store = searched(root, ASHA)
    last = {t: store.get_trial(t).last_step for t in outcome.trial_ids}
    stopped = [t for t in outcome.trial_ids if [d.kind for d in store.decisions(t)] == ["early_stop"]]
    completed = [t for t, step in last.items() if step == 20]
    assert stopped and completed and all(last[t] == 10 for t in stopped), last
    return AshaSearch(root, outcome, store, completed[0], stopped[0])


@pytest.fixture(scope="module")
def hosted_asha(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AshaSearch]:
    search = asha_search(tmp_path_factory.mktemp("hosted-asha"), hosts=True)
    yield search
    search.store.close()


@pytest.mark.slow  # a whole Ray Tune search and two replays: the slow tier
@pytest.mark.parametrize("hosts", [True, False], ids=["trial-hosts", "tune-actors"])
def test_a_completed_and_an_asha_stopped_trial_replay_without_the_adapter_corpus_bit_for_bit(
    hosts: bool, hosted_asha: AshaSearch, tmp_path: Path
) -> None:
    """Each trial of the search recorded the search's reproducibility record (its code snapshot
    stored) before it trained; `govray replay --trial` of the trial that finished and of one ASHA
    stopped at the first rung, without the PII corpus: the stopped one's replay ends at step 10
    too, and each base is bit-identical to the trial's, its adapter not."""
    search = hosted_asha if hosts else asha_search(tmp_path, hosts=False)
    store = search.store
    records = {store.get_trial(t).reproducibility_json for t in search.outcome.trial_ids}
    assert len(records) == 1 and None not in records, "every trial keeps the search's one record"
    (recorded,) = records
    assert recorded is not None
    code = ReproducibilityRecord.model_validate_json(recorded).code
    assert (code_directory(search.storage, code) / next(iter(code.files))).is_file()
    for trial_id, step in ((search.completed, 20), (search.stopped, 10)):
        report = replayed_without_writers(store, trial_id)
        assert report.original_trial == trial_id
        assert_removal_equals_replay(store, search.trust, report, stopped_at=step)


@pytest.mark.slow  # reads the search of the slow tier's hosted_asha
def test_a_search_trials_attestation_verifies_and_its_ledger_recomputes_from_the_cli(
    hosted_asha: AshaSearch, tmp_path: Path
) -> None:
    """`govray verify --recompute-ledger` on an ASHA-stopped trial's attestation (its final
    checkpoint: the copy Tune keeps of step 10)."""
    store = hosted_asha.store
    final = final_checkpoint_record(store, hosted_asha.stopped)
    assert final is not None and final.id is not None and final.step == 10
    kinds = {PROVENANCE_TYPE: "provenance", COVERAGE_TYPE: "coverage"}
    for record in attestations(store, final.id):
        kind = kinds[str(statement_type(record.envelope_json))]
        (tmp_path / f"trial.{kind}.dsse.json").write_text(record.envelope_json)
    trust = tmp_path / "trust.yaml"
    save_trust(hosted_asha.trust, trust)
    envelope = str(tmp_path / "trial.provenance.dsse.json")
    done = govray("verify", envelope, "--model-dir", final.path, "--trust", str(trust), "--recompute-ledger")
    assert done.code == 0, (done.out, done.err)
    assert "ledger recomputed from the schedule: all" in done.out


@pytest.mark.slow  # reads the search of the slow tier's hosted_asha
def test_the_best_trial_registers_sheds_its_adapter_and_lineage_row_names_the_version_without_it(
    hosted_asha: AshaSearch,
) -> None:
    """`govray model register NAME --trial BEST` says the version's folder; `remove-adapter` makes
    version 2 without the PII corpus; `govray lineage row` of a PII row the best trial trained on
    lists version 1 as carrying it and version 2 as not."""
    store, best = hosted_asha.store, hosted_asha.outcome.best_trial_id
    folder = final_folder(store, best)
    done = govray("model", "register", "tumor", "--trial", str(best), "--database", store.url)
    assert done.code == 0, (done.out, done.err)
    step = store.get_trial(best).last_step
    assert f"registered tumor:1 (trial {best}, step {step}) ← {folder}" in done.out
    removed = govray("model", "remove-adapter", "tumor:1", "--adapter", "pii-lora", "--database", store.url)
    assert removed.code == 0 and "(excluded corpora: digits-writers)" in removed.out, removed
    experiment = store.get_trial(best).experiment_id
    (writers,) = [c for c in store.list_corpora(experiment) if c.corpus_id == WRITERS]
    row = next(
        row
        for row in range(writers.rows)
        if next(t for t in row_reach(store, WRITERS, row).trials if t.trial_id == best).step_count
    )
    done = govray("lineage", "row", WRITERS, str(row), "--json", "--database", store.url)
    assert done.code == 0, done.err
    (reach,) = [t for t in json.loads(done.out)["trials"] if t["trial_id"] == best]
    models = {(m["model"], m["version"]): (m["carries_row"], m["removed_adapters"]) for m in reach["models"]}
    assert models == {("tumor", 1): (True, []), ("tumor", 2): (False, ["pii-lora"])}


@pytest.mark.slow  # reads the search of the slow tier's hosted_asha
def test_every_refusal_of_a_search_trials_replay_exits_11_in_one_line(
    hosted_asha: AshaSearch, tmp_path: Path
) -> None:
    """A trial that is not there, a corpus the experiment lacks, and what an engineer with write
    access to storage would try — the trial's recorded code snapshot edited, its final checkpoint
    edited, and re-sealed with their own key: refused before anything trains, exit 11, in one
    line naming the cause."""
    store = hosted_asha.store
    trials = len(store.list_trials(store.get_trial(hosted_asha.completed).experiment_id))
    refusals = {
        "no such trial": govray(
            "replay",
            str(store.get_trial(hosted_asha.completed).experiment_id),
            "--trial",
            "999",
            "--exclude-corpus",
            WRITERS,
            "--database",
            store.url,
        ),
        "unknown corpus": replay_cli(store, hosted_asha.completed, "no-such-corpus"),
    }
    code = ReproducibilityRecord.model_validate_json(
        str(store.get_trial(hosted_asha.stopped).reproducibility_json)
    ).code
    snapshot = code_directory(hosted_asha.storage, code) / next(iter(code.files))
    original = snapshot.read_bytes()
    snapshot.write_bytes(original + b"\n# tampered\n")
    try:
        refusals["changed code"] = replay_cli(store, hosted_asha.stopped, WRITERS)
    finally:
        snapshot.write_bytes(original)
    # With write access to storage: the checkpoint Tune kept, an adapter file changed; then its
    # state and manifest rewritten to match and signed with the engineer's own key.
    final = final_folder(store, hosted_asha.stopped)
    kept = shutil.copytree(final, tmp_path / "kept")
    try:
        adapter = final / ADAPTER_FILE
        adapter.write_bytes(adapter.read_bytes()[:-4] + b"\x00\x00\x80\x3f")
        refusals["changed adapter"] = replay_cli(store, hosted_asha.stopped, WRITERS)
        shutil.copy2(kept / ADAPTER_FILE, adapter)
        forge_manifest(final, SigningKey.generate(KeyRole.PLATFORM))
        refusals["own key"] = replay_cli(store, hosted_asha.stopped, WRITERS)
    finally:
        shutil.rmtree(final)
        shutil.copytree(kept, final)
    # Another corpus byte or another (validly signed) policy: the trial cannot be rerun as it ran.
    with changed_file(
        hosted_asha.root / "data" / "pii.csv", lambda text: text + text.splitlines()[-1] + "\n"
    ):
        refusals["changed corpus"] = replay_cli(store, hosted_asha.stopped, WRITERS)
        refusals["changed corpus, again"] = replay_cli(store, hosted_asha.stopped, WRITERS)  # (still)
    with other_signed_policy(hosted_asha.root):
        refusals["other policy"] = replay_cli(store, hosted_asha.stopped, WRITERS)
    causes = {
        "no such trial": "has no trial 999",
        "unknown corpus": "has no corpus no-such-corpus",
        "changed code": "changed since it was recorded",
        "changed adapter": ADAPTER_FILE,
        "own key": "is not the one the tracking store recorded when it was sealed",
        "changed corpus": "digits-writers",
        "changed corpus, again": "digits-writers",
        "other policy": "a replay needs the same policy",
    }
    for name, done in refusals.items():
        assert done.code == 11, (name, done)
        line = done.first_error_line  # the whole refusal, cause included, on its first line
        assert line.startswith("ReplayError:") and causes[name] in line, (name, done.err)
    # a refused replay leaves no trial behind
    assert len(store.list_trials(store.get_trial(hosted_asha.completed).experiment_id)) == trials


@pytest.mark.slow  # reads the search of the slow tier's hosted_asha
def test_govray_resume_of_a_search_resumes_it_and_refuses_a_changed_record_of_how_it_began(
    hosted_asha: AshaSearch,
) -> None:
    """`govray resume` of the finished search (its replays finished too) resumes the search: Tune
    has nothing left to run, nothing is trained again, the best is the search's. The record the
    search began with, edited on storage (its threads), no longer matches the sha256 the audit log
    holds: refused."""
    store = hosted_asha.store
    experiment = store.get_trial(hosted_asha.completed).experiment_id

    def progress() -> dict[int | None, tuple[str, int]]:
        return {t.id: (t.state, len(store.metrics(t.id or 0))) for t in store.list_trials(experiment)}

    before = progress()
    done = govray("resume", str(experiment), "--database", store.url)
    assert done.code == 0, (done.out, done.err)
    assert "its asha search, where Ray Tune left off" in done.out
    assert f"best: trial {hosted_asha.outcome.best_trial_id} " in done.out
    assert progress() == before
    (record,) = (hosted_asha.storage.root / "searches").glob(f"*-search{experiment}.json")
    with changed_file(record, lambda text: text.replace('"threads": 1', '"threads": 2')):
        refused = govray("resume", str(experiment), "--database", store.url)
    assert refused.code == SearchError.exit_code, refused
    assert (
        refused.first_error_line.startswith("SearchError:") and "is missing or changed since" in refused.err
    )


@pytest.mark.slow  # reads the search of the slow tier's hosted_asha
def test_govray_resume_goes_on_with_an_interrupted_replay_before_the_search(hosted_asha: AshaSearch) -> None:
    """An interrupted trial that keeps a run spec on storage (a run or a replay) is what `govray
    resume` continues; the experiment's search is resumed only when none is."""
    store = hosted_asha.store
    experiment = store.get_experiment(str(store.get_trial(hosted_asha.completed).experiment_id))
    config = ExperimentConfig.model_validate_json(experiment.config_json)
    assert experiment.id is not None and resumes_search(config, store, experiment)
    row = store.create_trial(experiment.id, "{}", seed=0, replay_of=hosted_asha.completed)
    assert row.id is not None
    store.set_trial_state(row.id, TrialState.ACTIVE, ray_run_name="digits-governed-interrupted-replay")
    spec = run_spec_path(hosted_asha.storage, "digits-governed-interrupted-replay")
    try:
        assert resumes_search(config, store, experiment)  # no run spec: not a run's or a replay's
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text("{}")
        assert not resumes_search(config, store, experiment)
    finally:
        spec.unlink(missing_ok=True)
        store.set_trial_state(row.id, TrialState.COMPLETED)


def forge_manifest(folder: Path, key: SigningKey) -> None:
    """A checkpoint's state edited (its step), the manifest rewritten to match, signed by ``key``."""
    state = folder / STATE_FILE
    state.write_text(state.read_text().replace('"step": 10', '"step": 11'))
    manifest = Manifest.model_validate_json((folder / MANIFEST_FILE).read_text())
    files = {**manifest.files, STATE_FILE: file_sha256(state)}
    forged = manifest.model_copy(update={"files": files}).to_bytes()
    (folder / MANIFEST_FILE).write_bytes(forged)
    (folder / SIGNATURE_FILE).write_text(sign_envelope(forged, MANIFEST_TYPE, key).to_json())


@contextlib.contextmanager
def changed_file(path: Path, change: Callable[[str], str]) -> Iterator[None]:
    """``path``'s text changed by ``change`` inside the block, restored after it."""
    before = path.read_bytes()
    path.write_text(change(before.decode()))
    try:
        yield
    finally:
        path.write_bytes(before)


@contextlib.contextmanager
def other_signed_policy(root: Path) -> Iterator[None]:
    """The experiment's policy file replaced by a new version, signed by a key its trust file
    then lists: valid, but not the policy the trials trained under."""
    policy, trust_file = root / "policies" / "digits.policy.yaml", root / "policies" / "trust.yaml"
    kept = {path: path.read_bytes() for path in (policy, policy.with_name(policy.name + ".sig"), trust_file)}
    key = SigningKey.generate(KeyRole.POLICY_AUTHORITY)
    trust = load_trust(trust_file)
    save_trust(TrustConfig(keys=[*trust.keys, key.public_key], revoked=trust.revoked), trust_file)
    raw = yaml.safe_load(policy.read_text())
    write_signed_policy(policy.parent, {**raw, "version": raw["version"] + 1}, key, name="digits.policy")
    try:
        yield
    finally:
        for path, content in kept.items():
            path.write_bytes(content)
