"""Counterfactual replay: rerun a recorded trial with some corpora's schedule slots left empty.

Everything else is identical — config, hyperparameters, seeds, policy, shards, schedule — and the
replay runs under a fresh Ray Train run name. The influence report compares the original's final
weights with the replay's, tensor by tensor: where the excluded corpus contributed **directly**
(its gradients reached that tensor: from the ledger), and how far its influence spread
**indirectly** (no direct contribution, yet the weights differ, because the layers it did train
changed every other corpus's gradients).

Example::

    replayed = replay_trial(store, experiment="digits-governed", exclude=("digits-licensed",))
    replayed.report.tensors  # per tensor: direct examples, distance, relative distance
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from govray.config.experiment import ExperimentConfig
from govray.core.errors import GovrayError
from govray.core.keys import TrustConfig
from govray.core.storage import open_storage
from govray.platform.rerun.resume import run_segments
from govray.platform.rerun.world_history import (
    WorldSegment,
    recorded_lineage,
    recorded_slots_per_step,
    recorded_world_history,
    replay_segments,
    split_at,
)
from govray.platform.run.plan import RunPlan, plan_run, recorded_final_checkpoint, recorded_trial_code
from govray.platform.run.preflight import check_policy, ingest_experiment
from govray.platform.run.runner import Progress, TrialOutcome, stored_ledger
from govray.tracking.audit import AuditEventType, AuditLog
from govray.tracking.store import TrackingStore
from govray.tracking.tables import Experiment, TrialKind, TrialRecord, TrialState
from govray.train.checkpoints.files import MODEL_FILE, find_checkpoints, verify_checkpoint
from govray.train.checkpoints.manifest import STATE_FILE, CheckpointState, TrainedUnder
from govray.train.checkpoints.whole_file import base_tensors, file_tensors
from govray.train.control.decisions import (
    EarlyStopDecision,
    EarlyStopState,
    GateDecision,
    PlateauState,
    RecordedDecision,
    RollbackDecision,
)
from govray.train.reproduce.record import ReproducibilityRecord
from govray.train.reproduce.snapshots import verify_corpora_unchanged, verify_input_digests
from govray.train.runspec import RUN_SPEC_FILE, RunSpec, read_run_spec
from govray.train.step.ledger import Ledger
from govray.train.step.scaling import LossScalingState
from govray.train.trial import make_trial


class ReplayError(GovrayError):
    """The recorded trial cannot be replayed as it was (missing, unfinished, or data changed)."""

    exit_code = 11


class TensorInfluence(BaseModel):
    model_config = ConfigDict(frozen=True)

    tensor: str
    file: str  # model.safetensors or adapter-NAME.safetensors
    direct_examples: int  # examples of the excluded corpora whose gradients reached it (ledger)
    distance: float  # L2 norm of (original - replay)
    relative: float  # distance / L2 norm of the original
    kind: str  # "direct", "indirect" or "none"


class InfluenceReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    experiment: str
    original_trial: int  # the trial replayed (compared with)
    original_replay_of: int | None = None  # set when that trial is itself a replay of this trial
    replay_trial: int
    replay_run: str
    excluded_corpora: list[str]  # the corpora whose influence is measured
    # Corpora the replayed trial already left out (it is a replay): the replay leaves them out too.
    already_excluded: list[str] = []
    step: int
    created_at: str
    note: str = (
        "direct = the excluded corpora's gradients reached this tensor's updates (ledger); "
        "indirect = no direct contribution, but the weights differ because tensors they did train "
        "changed the other corpora's gradients."
    )
    tensors: list[TensorInfluence]


@dataclass(frozen=True)
class Replay:
    outcome: TrialOutcome
    report: InfluenceReport
    report_path: Path
    segments: tuple[WorldSegment, ...]  # the world sizes it ran on: the replayed trial's
    lineage: tuple[TrainedUnder, ...] = ()  # the hyperparameters it followed: the replayed state's


def _original_trial(store: TrackingStore, experiment_id: int, trial_id: int | None) -> TrialRecord:
    """Trial ``trial_id``, or the experiment's latest completed original: never a replay unless
    named (a replay compared with itself would show no influence at all). A trial of a search
    counts as soon as it completed, also when its scheduler stopped it early."""
    trials = store.list_trials(experiment_id)
    if trial_id is not None:
        named = [t for t in trials if t.id == trial_id]
        if not named:
            raise ReplayError(f"experiment {experiment_id} has no trial {trial_id}")
        if named[0].state != TrialState.COMPLETED.value:
            raise ReplayError(f"trial {trial_id} is {named[0].state}: only a completed trial is replayed")
        return named[0]
    originals = [t for t in trials if t.state == TrialState.COMPLETED.value and t.kind == TrialKind.ORIGINAL]
    if not originals:
        raise ReplayError(f"experiment {experiment_id} has no completed original trial to replay")
    return originals[-1]


def recorded_decisions(store: TrackingStore, trial_id: int) -> tuple[RecordedDecision, ...]:
    """The decisions a trial recorded (LR cuts, early stops, gates, rollbacks), for a replay to
    apply as they were."""
    return tuple(
        TypeAdapter(RecordedDecision).validate_python(
            {"seq": row.seq, "step": row.step, "kind": row.kind, **json.loads(row.payload_json)}
        )
        for row in store.decisions(trial_id)
    )


def carried_decisions(checkpoint: Path, trial_id: int, store: TrackingStore) -> tuple[RecordedDecision, ...]:
    """The decisions a verified checkpoint's state carries — every one its controllers took along
    its lineage (LR cuts, gates, rollbacks, fp16 skips, an early stop; a PBT clone's include its
    donors', which its own row does not hold apart from its own) — then the scheduler's stop the
    driver recorded for the trial, in the order taken, numbered anew."""
    state = CheckpointState.model_validate_json((checkpoint / STATE_FILE).read_text())
    taken: list[RecordedDecision] = [
        *(PlateauState.model_validate(state.plateau).decisions if state.plateau else ()),
        *(GateDecision.model_validate(gate) for gate in state.gates),
        *(RollbackDecision.model_validate(rollback) for rollback in state.rollbacks),
        *(LossScalingState.model_validate(state.loss_scaling).skips if state.loss_scaling else ()),
    ]
    if state.early_stopping and (stop := EarlyStopState.model_validate(state.early_stopping).decision):
        taken.append(stop)
    scheduler = [
        decision
        for decision in recorded_decisions(store, trial_id)
        if isinstance(decision, EarlyStopDecision) and decision.reason == "scheduler"
    ]
    ordered = [*sorted(taken, key=lambda decision: (decision.step, decision.seq)), *scheduler]
    return tuple(decision.model_copy(update={"seq": seq}) for seq, decision in enumerate(ordered))


def final_checkpoint(run_dir: Path, trust: TrustConfig) -> Path:
    """The run's last checkpoint, verified against ``trust`` (the replay's: ``CheckedPolicy.trust``)."""
    found = find_checkpoints(run_dir)
    if not found:
        raise ReplayError(f"{run_dir}: no checkpoint to compare with")
    verify_checkpoint(found[-1], trust)
    return found[-1]


def tensor_influence(
    original: Path, replay: Path, ledger: Ledger, excluded: tuple[str, ...], trust: TrustConfig
) -> list[TensorInfluence]:
    """Per tensor of the base model and of each adapter, each once: direct examples of the
    excluded corpora and distances. Tensors are read one at a time (a sharded checkpoint's base
    from its shards, verified against ``trust``, put together: ``train.whole_file``)."""
    rows = []
    for file in sorted({MODEL_FILE, *(path.name for path in original.glob("adapter-*.safetensors"))}):
        for name, before, after in _paired_tensors(original, replay, file, trust):
            direct = sum(  # (adapter files already use the ledger's names)
                entry.examples
                for (corpus, tensor), entry in ledger.entries.items()
                if corpus in excluded and tensor == name
            )
            difference = (before.double() - after.double()).norm().item()
            scale = before.double().norm().item()
            kind = "direct" if direct else ("indirect" if difference > 0 else "none")
            rows.append(
                TensorInfluence(
                    tensor=name,
                    file=file,
                    direct_examples=direct,
                    distance=difference,
                    relative=difference / scale if scale else 0.0,
                    kind=kind,
                )
            )
    return rows


def _paired_tensors(
    original: Path, replay: Path, file: str, trust: TrustConfig
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, original's tensor, replay's tensor) for each tensor of ``file``, in name order."""
    if file == MODEL_FILE:
        pairs = zip_longest(base_tensors(original, trust), base_tensors(replay, trust))
    else:
        pairs = zip_longest(file_tensors(original / file), file_tensors(replay / file))
    for before, after in pairs:
        if before is None or after is None or before[0] != after[0]:
            found = (before or ("nothing",))[0], (after or ("nothing",))[0]
            raise ReplayError(f"{file}: the original holds {found[0]} where the replay holds {found[1]}")
        yield before[0], before[1], after[1]


@dataclass(frozen=True)
class PreparedReplay:
    """A replay checked and planned, nothing run yet: the trial it reruns, that trial's final
    checkpoint (verified), the plan, and the world-size segments it runs on."""

    original: TrialRecord
    original_dir: Path
    already_excluded: tuple[str, ...]  # the corpora the replayed trial left out (it is a replay)
    plans: tuple[RunPlan, ...]  # one per lineage entry, under its hyperparameters
    lineage: tuple[TrainedUnder, ...]  # who trained the state under which hyperparameters, from when
    segments: tuple[WorldSegment, ...]

    @property
    def plan(self) -> RunPlan:
        """The plan the replay begins with (its trial row's)."""
        return self.plans[0]

    def respec(self, segment: WorldSegment, named: RunSpec) -> RunSpec:
        """The spec of ``segment``: the plan of the lineage entry it falls in, under the replay's
        own run name (``named``)."""
        index = max(i for i, entry in enumerate(self.lineage) if entry.from_step <= segment.start)
        return self.plans[index].named_as(named)


def replay_trial(
    store: TrackingStore,
    experiment: str,
    exclude: tuple[str, ...],
    *,
    trial_id: int | None = None,
    progress: Progress | None = None,
) -> Replay:
    """Rerun a recorded trial — of a run or of a search, stopped early or not — without
    ``exclude``'s rows, on the world sizes it trained on from the steps it trained on them
    (``platform.world_history``), and write the influence report. Whatever stops it before it
    trains is a ``ReplayError`` naming the cause (exit 11)."""
    try:
        recorded = store.get_experiment(experiment)
        prepared = prepare_replay(store, recorded, exclude, trial_id)
    except ReplayError:
        raise
    except (GovrayError, OSError, ValidationError) as error:  # changed code or data, a tampered checkpoint
        raise ReplayError(f"replay refused: {error}") from error
    original, plan = prepared.original, prepared.plan
    assert recorded.id is not None and original.id is not None
    respec = prepared.respec if len(prepared.plans) > 1 else None
    outcome = run_segments(
        plan, recorded, store, prepared.segments, progress=progress, replay_of=original.id, respec=respec
    )
    if outcome.state != "completed":
        raise ReplayError(
            f"replay trial {outcome.trial_id} was {outcome.state} at step {outcome.steps_done}; finish "
            f"it with `govray resume {recorded.id}` (it goes on with the replayed trial's world sizes), "
            "then compare"
        )
    replay_dir = final_checkpoint(outcome.run_dir, plan.trust)
    report = InfluenceReport(
        experiment=recorded.name,
        original_trial=original.id,
        original_replay_of=original.replay_of,
        replay_trial=outcome.trial_id,
        replay_run=outcome.run_name,
        excluded_corpora=list(exclude),
        already_excluded=list(prepared.already_excluded),
        step=outcome.steps_done,
        created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        tensors=tensor_influence(
            prepared.original_dir, replay_dir, stored_ledger(store, original.id), tuple(exclude), plan.trust
        ),
    )
    path = plan.storage.root / "reports" / f"influence-trial{original.id}-replay{outcome.trial_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json(indent=2))
    AuditLog(store).append(
        AuditEventType.REPLAY_COMPLETED,
        {
            "original_trial": original.id,
            "replay_trial": outcome.trial_id,
            "excluded": list(exclude),
            "report": str(path),
        },
        experiment_id=recorded.id,
    )
    return Replay(outcome, report, path, prepared.segments, prepared.lineage)


def prepare_replay(
    store: TrackingStore, recorded: Experiment, exclude: tuple[str, ...], trial_id: int | None
) -> PreparedReplay:
    """Check that trial ``trial_id`` (default: the latest completed original) can be rerun as it
    ran — its recorded code, the same corpus bytes, its verified final checkpoint and inputs —
    and plan the rerun from what that checkpoint says ran: hyperparameters, validation period,
    schedule version, world sizes."""
    assert recorded.id is not None
    config = ExperimentConfig.model_validate_json(recorded.config_json)
    original = _original_trial(store, recorded.id, trial_id)
    assert original.id is not None
    known = {corpus.corpus_id: corpus for corpus in store.list_corpora(recorded.id)}
    unknown = [corpus for corpus in exclude if corpus not in known]
    if unknown:
        raise ReplayError(f"experiment '{recorded.name}' has no corpus {', '.join(unknown)}")
    storage = open_storage(config.storage_path)
    code = recorded_trial_code(storage, original)  # the code it ran, whatever the working directory
    checked = check_policy(config, store, allow_unsigned=config.policy.allow_unsigned)
    # The bytes the trial trained on (its own record), checked before the ingest records anything.
    trained_on = ReproducibilityRecord.model_validate_json(str(original.reproducibility_json)).corpora
    verify_corpora_unchanged(config.data.corpora, trained_on, since=f"trial {original.id} trained on it")
    _, ingested = ingest_experiment(config, checked, store)
    original_dir = recorded_final_checkpoint(store, storage, original, checked.trust)
    ran = read_run_spec(original_dir / RUN_SPEC_FILE)
    if ran.policy_digest != checked.policy.digest:
        raise ReplayError(
            f"trial {original.id} trained under policy digest {ran.policy_digest[:16]}…, the policy is "
            f"now {checked.policy.digest[:16]}…: a replay needs the same policy"
        )
    trial = make_trial(ran.trial, ran.hparams, ran.settings)
    verify_input_digests(ran.input_digests, trial, run=f"trial {original.id}")  # before any packing
    already = ran.excluded_corpora
    # A PBT clone's state was trained by its donors first, each under its own hyperparameters and
    # decisions: the replay follows that lineage, one plan per entry (verified with the checkpoint).
    lineage = recorded_lineage(original_dir)
    cloned = any(entry.run != original.ray_run_name for entry in lineage)
    # A clone's row mixes its decisions before the exploit with those after; its state's are its lineage's.
    decisions = (
        carried_decisions(original_dir, original.id, store)
        if cloned
        else recorded_decisions(store, original.id)
    )

    def planned(hparams: dict[str, Any]) -> RunPlan:
        return plan_run(
            config,
            checked,
            ingested.root,
            storage=storage,
            hparams=dict(hparams),
            trial_seed=original.seed,
            excluded_corpora=already + tuple(c for c in exclude if c not in already),
            report_every=ran.report_every,
            threads=ran.threads,  # summation order follows the thread count
            recorded_decisions=decisions,
            # A search trial validated where its scheduler's rungs are (its ASHA stop is applied there).
            validation_period=ran.validation_period,
            code=code,
            # The original's slots per step (its first world's, an elastic run's most workers'),
            # whatever world the replay's first segment has: the same global batch at every step.
            slots_per_step=slots,
        )

    slots = recorded_slots_per_step(original_dir)  # verified with the checkpoint
    plans = [planned(entry.hparams) for entry in lineage]
    history = recorded_world_history(original_dir)  # (so is this)
    segments = replay_segments(history, plans[0].spec.max_steps)
    segments = split_at(segments, [entry.from_step for entry in lineage[1:]])
    return PreparedReplay(original, original_dir, already, tuple(plans), tuple(lineage), segments)
