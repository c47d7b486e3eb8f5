"""The experiment lifecycle a user drives: pause, activate, kill, fork.

States follow Determined: ``active`` while a driver trains, ``paused`` and ``killed`` on a user's
request, ``completed`` and ``errored`` by the driver. A request to a running experiment is a row
in the tracking store; its driver passes it to rank 0, and the workers stop together at the next
step boundary (a pause with a signed checkpoint). ``activate`` continues a paused trial from that
checkpoint under its own Ray Train run name, so the result is the uninterrupted run's, bit for bit.

Example::

    request_pause(store, "digits-governed")             # the running driver pauses at a step boundary
    wait_while_active(store, "digits-governed", 60.0)   # -> the experiment, now paused
    activate(store, "digits-governed")                  # -> TrialOutcome of the finished trial
    child, outcome = fork(store, "digits-governed", from_checkpoint="latest")
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from govray.config.experiment import ExperimentConfig, load_experiment
from govray.core.errors import GovrayError
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.lineage import checkpoints
from govray.tracking.store import TrackingStore
from govray.tracking.tables import (
    TERMINAL_EXPERIMENT_STATES,
    CheckpointStatus,
    ControlRequest,
    Experiment,
    ExperimentState,
    TrialState,
)

if TYPE_CHECKING:
    from govray.platform.run.runner import Progress, TrialOutcome

LATEST = "latest"  # --from-checkpoint latest: the parent's newest kept checkpoint


class LifecycleError(GovrayError):
    """The experiment is not in a state that allows what was asked."""

    exit_code = 14


def _experiment(store: TrackingStore, experiment: int | str) -> tuple[Experiment, int]:
    found = store.get_experiment(experiment)
    assert found.id is not None
    return found, found.id


def _refuse_terminal(found: Experiment, verb: str) -> None:
    if found.state in TERMINAL_EXPERIMENT_STATES:
        raise LifecycleError(f"experiment {found.id} '{found.name}' is {found.state}: nothing to {verb}")


def request_pause(store: TrackingStore, experiment: int | str) -> Experiment:
    """Ask the experiment's running driver to checkpoint and stop at the next step boundary."""
    found, experiment_id = _experiment(store, experiment)
    _refuse_terminal(found, "pause")
    if found.state != ExperimentState.ACTIVE:
        raise LifecycleError(
            f"experiment {experiment_id} '{found.name}' is {found.state}: only an active one can be paused"
        )
    updated = store.request(experiment_id, ControlRequest.PAUSE)
    AuditLog(store).append(
        AuditEventType.EXPERIMENT_REQUESTED, {"request": "pause"}, experiment_id=experiment_id
    )
    return updated


def request_kill(store: TrackingStore, experiment: int | str, *, force: bool = False) -> Experiment:
    """Stop the experiment for good.

    An active one is asked to stop at its next step boundary (its driver marks it killed); one
    that is not running — created, ingested, paused — is killed at once, as is an active one with
    ``force`` (for a driver that died and will not be resumed).
    """
    found, experiment_id = _experiment(store, experiment)
    _refuse_terminal(found, "kill")
    audit = AuditLog(store)
    if found.state == ExperimentState.ACTIVE and not force:
        updated = store.request(experiment_id, ControlRequest.KILL)
        audit.append(AuditEventType.EXPERIMENT_REQUESTED, {"request": "kill"}, experiment_id=experiment_id)
        return updated
    for trial in store.list_trials(experiment_id):
        if trial.state in (TrialState.PENDING, TrialState.ACTIVE, TrialState.PAUSED):
            assert trial.id is not None
            store.set_trial_state(trial.id, TrialState.KILLED)
    store.request(experiment_id, None)
    audit.append(
        AuditEventType.EXPERIMENT_REQUESTED,
        {"request": "kill", "immediate": True, "was": found.state},
        experiment_id=experiment_id,
    )
    return store.set_experiment_state(experiment_id, ExperimentState.KILLED)


def wait_while_active(store: TrackingStore, experiment: int | str, timeout: float) -> Experiment:
    """Poll until the experiment leaves ``active`` (its driver acted on a request) or ``timeout``."""
    deadline = time.monotonic() + timeout
    found, experiment_id = _experiment(store, experiment)
    while found.state == ExperimentState.ACTIVE and time.monotonic() < deadline:
        time.sleep(0.25)
        found = store.get_experiment(experiment_id)
    return found


def activate(
    store: TrackingStore, experiment: int | str, *, progress: Progress | None = None
) -> TrialOutcome:
    """Continue a paused experiment's trial from its pause checkpoint (this process drives it)."""
    # Here, not at the top: a pause or kill request (``govray experiment pause``) needs only the
    # store, not the training stack these bring (torch, Ray).
    from govray.platform.rerun.resume import resume_trial, use_interrupted_trial_code
    from govray.platform.run.preflight import check_policy

    found, experiment_id = _experiment(store, experiment)
    if found.state != ExperimentState.PAUSED:
        raise LifecycleError(
            f"experiment {experiment_id} '{found.name}' is {found.state}: only a paused one can be activated"
            + ("; a driver that died is continued with `govray resume`" if found.state == "active" else "")
        )
    config = ExperimentConfig.model_validate_json(found.config_json)
    use_interrupted_trial_code(config, store, found)  # the recorded trial, from any directory
    checked = check_policy(config, store, allow_unsigned=config.policy.allow_unsigned)
    return resume_trial(config, checked, found, store, progress=progress)


def parent_checkpoint(store: TrackingStore, experiment_id: int) -> Path:
    """The experiment's newest kept checkpoint (newest trial first, then highest step)."""
    for trial in reversed(store.list_trials(experiment_id)):
        assert trial.id is not None
        kept = [c for c in checkpoints(store, trial.id) if c.state == CheckpointStatus.ACTIVE]
        if kept:
            return Path(max(kept, key=lambda c: c.step).path)
    raise LifecycleError(f"experiment {experiment_id} has no kept checkpoint to start from")


def fork(
    store: TrackingStore,
    experiment: int | str,
    *,
    config_path: Path | None = None,
    from_checkpoint: Path | str | None = None,
    allow_unsigned: bool = False,
    strict: bool = False,
    progress: Progress | None = None,
) -> tuple[Experiment, TrialOutcome]:
    """A new experiment from a recorded one (its config, or ``config_path`` edited from it),
    with the parent in its lineage; ``from_checkpoint`` (a directory, or ``"latest"``: the
    parent's newest kept checkpoint) starts it from those weights and that ledger."""
    from govray.platform.run.plan import RunPlanner  # (see activate)
    from govray.platform.run.preflight import check_policy, ingest_experiment
    from govray.platform.run.runner import run_planned

    parent, parent_id = _experiment(store, experiment)
    if config_path is not None:
        config = load_experiment(config_path)
    else:
        config = ExperimentConfig.model_validate_json(parent.config_json)
    start: Path | None = None
    if from_checkpoint == LATEST:
        start = parent_checkpoint(store, parent_id)
    elif from_checkpoint is not None:
        start = Path(from_checkpoint)
    checked = check_policy(config, store, allow_unsigned=allow_unsigned)
    planner = RunPlanner(config, checked, start)  # refused before the child exists
    child, _ = ingest_experiment(config, checked, store, strict=strict, fork_of=parent_id, check=planner)
    assert child.id is not None
    outcome = run_planned(planner.plan, child, store, progress=progress)
    return store.get_experiment(child.id), outcome
