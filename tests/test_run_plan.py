"""A run is planned once on the driver: one ``Storage``, the trust file read once (with the policy)
and carried, the trial built once for the plan; the refusal check and the run share that plan."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import govray.platform.run.plan
from govray.config.experiment import load_experiment
from govray.core import keys
from govray.core import storage as storage_module
from govray.core.keys import Revocation, TrustConfig, platform_key, save_trust
from govray.core.settings import operator_trust
from govray.platform.run.plan import PlanError, RunPlan, RunPlanner, plan_run, run_spec_path
from govray.platform.run.preflight import CheckedPolicy, check_policy, ingest_experiment
from govray.platform.run.runner import TrialOutcome, run_planned
from govray.tracking.store import TrackingStore
from govray.train import trial as trial_module
from govray.train.checkpoints.files import CheckpointError, find_checkpoints, verify_checkpoint
from govray.train.runspec import RUN_SPEC_FILE, RunSpec, read_run_spec
from jobs.examples.digits.golden import golden_example
from tests.helpers.golden import GoldenRun, assert_run_as_planned

DRIVER = ("govray.platform.", "govray.cli.")  # the driver's modules


def count_calls(
    patch: pytest.MonkeyPatch, calls: Counter[str], real: Callable[..., Any], prefixes: tuple[str, ...]
) -> None:
    """Count the calls of ``real`` made through every module below ``prefixes`` that imported it
    (each call still runs the real function)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[real.__name__] += 1
        return real(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith(prefixes) and getattr(module, real.__name__, None) is real:
            patch.setattr(module, real.__name__, counted)


@dataclass(frozen=True)
class PlannedRun:
    calls: Counter[str]
    checked: CheckedPolicy
    plan: RunPlan
    outcome: TrialOutcome
    trust_file: Path


@pytest.fixture(scope="module")
def planned_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> PlannedRun:
    """``govray run``'s steps (policy check, ingest with the planner as its refusal check, the
    planned run), counted; between planning and running, the trust file revokes the platform key
    that signs the run's checkpoints."""
    path = golden_example(
        tmp_path_factory.mktemp("plan"), workers=1, max_length={"batches": 10}, lr_schedule=False
    )
    config = load_experiment(path)
    assert config.policy.trust is not None
    revoked = keys.load_trust(config.policy.trust)
    # (``TrustConfig.revoke`` takes only keys the file lists; the platform key is trusted implicitly)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    revoked.revoked.append(Revocation(keyid=platform_key().keyid, revoked_at=now, reason="after planning"))
    calls: Counter[str] = Counter()
    with pytest.MonkeyPatch.context() as patch:
        count_calls(patch, calls, storage_module.open_storage, DRIVER)
        count_calls(patch, calls, keys.load_trust, ("govray.",))
        count_calls(patch, calls, trial_module.make_trial, DRIVER)
        count_calls(patch, calls, govray.platform.run.plan.plan_run, DRIVER)
        store = TrackingStore.open(config.database_url)
        checked = check_policy(config, store, allow_unsigned=False)
        planner = RunPlanner(config, checked)
        experiment, _ = ingest_experiment(config, checked, store, check=planner)
        save_trust(revoked, config.policy.trust)
        outcome = run_planned(planner.plan, experiment, store)
    return PlannedRun(calls, checked, planner.plan, outcome, config.policy.trust)


def test_a_planned_run_opens_its_storage_once_and_builds_its_trial_once(planned_run: PlannedRun) -> None:
    assert planned_run.outcome.state == "completed" and planned_run.outcome.steps_done == 10
    assert planned_run.calls["open_storage"] == 1, planned_run.calls
    assert planned_run.calls["plan_run"] == 1, "the refusal check's plan is the one that runs"
    # The policy check resolves the default routing; the plan builds the sample's trial: nothing else.
    assert planned_run.calls["make_trial"] == 2, planned_run.calls


def trusted_keys(trust: TrustConfig) -> set[str]:
    return {key.keyid for key in trust.keys}


def test_the_trust_file_is_read_once_and_a_later_change_does_not_change_what_the_run_checks(
    planned_run: PlannedRun,
) -> None:
    assert planned_run.calls["load_trust"] == 1, planned_run.calls
    # The experiment's trust file now revokes the key that signed the run's checkpoints: that file
    # only checks the policy. Checkpoints are checked against the operator's trust, and the run's
    # spec (a file the engineer can write) carries no trust of its own for a resume to believe.
    assert platform_key().keyid in {entry.keyid for entry in keys.load_trust(planned_run.trust_file).revoked}
    recorded = json.loads(run_spec_path(planned_run.plan.storage, planned_run.outcome.run_name).read_text())
    assert "trust" not in recorded and "trust" not in RunSpec.model_fields
    assert planned_run.checked.trust == planned_run.plan.trust
    assert trusted_keys(planned_run.plan.trust) == trusted_keys(operator_trust())
    assert not planned_run.plan.trust.revoked
    final = find_checkpoints(planned_run.outcome.run_dir)[-1]
    verify_checkpoint(final, planned_run.plan.trust)


def test_a_plan_refuses_a_start_checkpoint_its_trust_does_not_accept(
    planned_run: PlannedRun, tmp_path: Path
) -> None:
    """The start checkpoint is checked against the plan's trust, before anything is recorded."""
    final = find_checkpoints(planned_run.outcome.run_dir)[-1]
    untrusting = dataclasses.replace(planned_run.checked, trust=TrustConfig())
    config = planned_run.plan.config
    with pytest.raises(CheckpointError, match="is not trusted for role 'platform'"):
        plan_run(config, untrusting, planned_run.plan.shard_root, start_checkpoint=final)
    accepted = plan_run(config, planned_run.checked, planned_run.plan.shard_root, start_checkpoint=final)
    assert accepted.start is not None and accepted.start.step == 10
    assert accepted.spec.start_checkpoint == str(final)


def test_a_planner_that_no_ingest_called_says_so(planned_run: PlannedRun) -> None:
    planner = RunPlanner(planned_run.plan.config, planned_run.checked)
    with pytest.raises(PlanError, match="pass this planner as ingest_experiment's check"):
        _ = planner.plan


def test_a_run_spec_of_another_shape_is_refused_naming_the_file(
    golden_run: GoldenRun, tmp_path: Path
) -> None:
    """The one reader of run.json: a pre-release spec (its ``schedule_version``), an edited one, or
    none at all is a ``CheckpointError`` naming the file and the field — never a traceback."""
    written = find_checkpoints(golden_run.outcome.run_dir)[-1] / RUN_SPEC_FILE
    assert read_run_spec(written) == RunSpec.model_validate_json(written.read_text())
    document = json.loads(written.read_text())
    for name, edit in [
        ("pre-release", {**document, "schedule_version": 1}),
        ("edited", {**document, "max_steps": "thirty"}),
    ]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(edit))
        field = "schedule_version" if name == "pre-release" else "max_steps"
        with pytest.raises(CheckpointError, match=rf"{path}: not a run spec this govray reads: .*{field}"):
            read_run_spec(path)
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'none.json'}: no run spec"):
        read_run_spec(tmp_path / "none.json")


def test_a_run_and_its_replay_train_the_specs_they_were_planned_with(
    golden_run: GoldenRun, golden_run_without_writers: GoldenRun
) -> None:
    """Nothing edits a spec after planning: the two-worker run (its attempt reports to a sink of
    its own) and its replay (planned on its original's slots per step and recorded code) keep the
    spec each recorded when it started in every checkpoint."""
    for run in (golden_run, golden_run_without_writers):
        assert_run_as_planned(run.config.storage_path, run.outcome.run_name, run.outcome.run_dir)
