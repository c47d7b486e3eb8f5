"""Planning one run on the driver: everything it needs, built once and carried.

``plan_run`` opens the experiment's storage, verifies a start checkpoint against the trust that
was read with the policy (``CheckedPolicy.trust``: the trust file is read once, at preflight),
builds the trial for this hyperparameter sample once (on the meta device), and from it the routing
table, the packed windows and the schedule's length: the ``RunSpec`` every worker runs. Run,
search, replay and the refusal checks before an experiment exists all go through it, so what a
run is refused for, what it is checked against and what it runs are the same objects.

Example::

    planner = RunPlanner(config, checked)                       # refuses on the shards ...
    experiment, ingested = ingest_experiment(config, checked, store, check=planner)
    outcome = run_planned(planner.plan, experiment, store)      # ... and runs what it planned
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from govray.config.experiment import ExperimentConfig, load_canaries
from govray.core.canonical import canonical_json, file_sha256
from govray.core.errors import ConfigError, GovrayError
from govray.core.keys import TrustConfig
from govray.core.logs import log_dir
from govray.core.storage import Storage, open_storage
from govray.data.ingest import IngestResult
from govray.data.packed import PackedStore
from govray.data.packing import pack_shards
from govray.data.schedule import ScheduleSpec, derive_seed
from govray.data.shards import MANIFEST, ShardManifest, ShardSet
from govray.governance.canaries import CanaryProbe
from govray.platform.run.preflight import CheckedPolicy, config_digest
from govray.tracking.lineage import final_checkpoint_record
from govray.tracking.store import TrackingStore
from govray.tracking.tables import TrialRecord
from govray.train.checkpoints.files import load_checkpoint, recorded_state, verify_checkpoint
from govray.train.control.decisions import RecordedDecision
from govray.train.parallel.worker import default_threads
from govray.train.reproduce.record import ReproducibilityRecord
from govray.train.reproduce.snapshots import CodeSnapshot, input_digests, use_recorded_code
from govray.train.runspec import RunSpec
from govray.train.trial import (
    Trial,
    defines_sequence_scores,
    defines_tokenize,
    load_trial_class,
    make_trial,
    resolve_trial_routes,
)


class PlanError(GovrayError):
    """A run's recorded inputs are missing: it cannot be planned as it ran."""


@dataclass(frozen=True)
class StartPoint:
    """A verified start checkpoint (fork, ``--from-checkpoint``, ``--from-model``): the trial's
    lineage source."""

    directory: Path
    manifest_sha256: str
    step: int


@dataclass(frozen=True)
class RunPlan:
    """One run of one hyperparameter sample, planned: the experiment's one ``Storage``, the checked
    policy with the trust it was checked against, the trial built once, and the ``RunSpec`` built
    from them (without a run name: :meth:`named` gives each run its own)."""

    config: ExperimentConfig
    storage: Storage
    checked: CheckedPolicy
    shard_root: Path
    trial: Trial  # on this sample's hyperparameters; its model is only ever built on the meta device
    packed: PackedStore | None  # data.packing's windows, else None
    spec: RunSpec
    start: StartPoint | None = None
    code: CodeSnapshot | None = None  # a replay's recorded code, else None (the working directory's)

    @property
    def trust(self) -> TrustConfig:
        """The platform keys whose checkpoints this run accepts: read once, with the policy."""
        return self.checked.trust

    def named_as(self, other: RunSpec) -> RunSpec:
        """This plan's spec under ``other``'s run name, directories and record (a replay segment
        under other hyperparameters than the replay's first)."""
        return self.named(other.run_name, other.reproducibility)

    def named(self, run_name: str, reproducibility: Mapping[str, Any], *, directory: str = "") -> RunSpec:
        """The spec of run ``run_name``, complete: its directories (its Ray Train run and control
        file under ``directory``, default the run's name: a search trial's N-worker run has one
        per life of its Tune trial) and its reproducibility record filled in."""
        root, ray_run = self.storage.root, directory or run_name
        return self.spec.model_copy(
            update={
                "run_name": run_name,
                "run_dir": str(root / "ray" / ray_run),
                "control_file": str(control_path(self.storage, ray_run)),
                "log_dir": str(log_dir(root, run_name)),
                "reproducibility": dict(reproducibility),
            }
        )


def plan_run(
    config: ExperimentConfig,
    checked: CheckedPolicy,
    shard_root: Path,
    *,
    storage: Storage | None = None,
    hparams: dict[str, Any] | None = None,
    trial_seed: int = 0,
    excluded_corpora: tuple[str, ...] = (),
    report_every: int = 20,
    recorded_decisions: tuple[RecordedDecision, ...] | None = None,
    start_checkpoint: Path | None = None,
    start_model: Mapping[str, str] | None = None,
    validation_period: int | None = None,
    code: CodeSnapshot | None = None,
    threads: int | None = None,
    slots_per_step: int | None = None,
) -> RunPlan:
    """Plan one run on ``shard_root`` of ``hparams`` (default: the experiment's defaults), refusing
    what the run could not honour before anything is recorded: a tampered or foreign start
    checkpoint, canaries without ``sequence_scores``, canary rows outside their corpus, a monitored
    corpus with nothing to measure. A searcher may impose a ``validation_period`` when the config
    sets none; ``code`` (a replay's) makes the workers import the trial from that recorded snapshot;
    ``threads`` (a replay's, a search trial's) pins the workers' torch threads (default: their
    CPUs, or ``OMP_NUM_THREADS`` here); ``slots_per_step`` (a replay's: its original's) fixes a
    step's global batch (default: an elastic run's most workers, else the world's size).
    """
    storage = storage if storage is not None else open_storage(config.storage_path)
    start = _verified_start(start_checkpoint, checked.trust)
    values = hparams if hparams is not None else config.default_hparams()
    shards = ShardSet.open(shard_root)
    canaries = _checked_canaries(config, checked, shards)
    settings = config.training.with_hyperparameters(values)
    trial = make_trial(config.trial, values, settings)  # the one build of this sample's trial
    inputs = input_digests(trial)
    packed = packed_store(config, shards, values, trial, inputs)
    policy = checked.policy.policy
    spec = RunSpec(
        **_from_the_experiment_file(config, slots_per_step),
        trial=config.trial,
        hparams=values,
        settings=settings,
        policy=policy,
        # This sample's model (hyperparameters may change its shape), on the meta device.
        routing=resolve_trial_routes(policy, trial),
        shard_root=str(shard_root),
        shards_sha256=file_sha256(shard_root / MANIFEST),
        input_digests=inputs,
        trial_seed=trial_seed,
        packed_root=str(packed.root) if packed is not None else "",
        packed_sha256=file_sha256(packed.root / MANIFEST) if packed is not None else "",
        max_steps=plan_steps(config, shards.manifest, trial.batch_size, trial_seed, packed),
        excluded_corpora=excluded_corpora,
        report_every=report_every,
        threads=threads if threads is not None else default_threads(config.resources.cpus_per_worker),
        code_dir=str(code_directory(storage, code)) if code is not None else os.getcwd(),
        recorded_code=code is not None,
        policy_digest=checked.policy.digest,
        policy_signer=checked.policy_signer,
        policy_trust_sha256=checked.policy_trust_sha256,
        validation_period=config.min_validation_period or validation_period,
        recorded_decisions=recorded_decisions,
        start_checkpoint=str(start_checkpoint) if start_checkpoint is not None else "",
        start_model=dict(start_model or {}),
        canaries=canaries,
    )
    return RunPlan(config, storage, checked, shard_root, trial, packed, spec, start, code)


def _checked_canaries(
    config: ExperimentConfig, checked: CheckedPolicy, shards: ShardSet
) -> dict[str, CanaryProbe]:
    """The experiment's canaries, refused when the trial cannot score them or what memorization
    monitoring needs is missing from the shards."""
    canaries = load_canaries(config)
    if canaries and not defines_sequence_scores(load_trial_class(config.trial)):
        raise ConfigError(
            f"corpora {sorted(canaries)} declare canaries, but trial {config.trial} defines no "
            "sequence_scores(model, texts) to score them"
        )
    check_memorization_inputs(checked, shards.manifest, canaries)
    return canaries


def _from_the_experiment_file(config: ExperimentConfig, slots_per_step: int | None) -> dict[str, Any]:
    """The run spec's fields that the experiment file gives as it is (whatever the sample), and
    the slots per step it implies unless given."""
    return {
        "eval_rows": config.data.eval_rows,
        "seed": config.seed,
        "use_gpu": config.resources.use_gpu,
        "strategy": config.resources.strategy,
        "shard_group": config.resources.shard_group,
        # An elastic run's steps have its most workers' slots from the start (it may start on
        # fewer); a fixed-size run's are its world's (0).
        "slots_per_step": slots_per_step
        if slots_per_step is not None
        else (config.resources.max_workers if config.resources.elastic else 0),
        "checkpoint_period": config.checkpoint.period,
        "config_digest": config_digest(config),
        "experiment": config.name,
        "lr_schedule": config.lr_schedule,
        "early_stopping": config.early_stopping,
        "storage": config.storage_path,
        "objective_metric": config.searcher.metric,
        "smaller_is_better": config.searcher.smaller_is_better,
        "memorization_lambda": config.searcher.memorization_lambda,
    }


@dataclass
class RunPlanner:
    """A ``check`` for ``ingest_experiment`` that plans the run on the ingested shards: what the run
    would refuse is refused before the experiment exists (a refused run leaves only its audit
    events), and the run then runs the plan that was checked (:attr:`plan`)."""

    config: ExperimentConfig
    checked: CheckedPolicy
    start_checkpoint: Path | None = None
    start_model: Mapping[str, str] | None = None
    planned: RunPlan | None = field(default=None, init=False)

    def __call__(self, ingested: IngestResult) -> None:
        self.planned = plan_run(
            self.config,
            self.checked,
            ingested.root,
            start_checkpoint=self.start_checkpoint,
            start_model=self.start_model,
        )

    @property
    def plan(self) -> RunPlan:
        """The plan made when the ingest called this check."""
        if self.planned is None:
            raise PlanError("the run was not planned: pass this planner as ingest_experiment's check")
        return self.planned


def _verified_start(start_checkpoint: Path | None, trust: TrustConfig) -> StartPoint | None:
    if start_checkpoint is None:
        return None
    source = load_checkpoint(start_checkpoint, trust)  # refused, naming the file, if tampered or foreign
    return StartPoint(source.directory, source.manifest_digest, source.state.step)


def plan_steps(
    config: ExperimentConfig,
    manifest: ShardManifest,
    batch_size: int,
    trial_seed: int,
    packed: PackedStore | None = None,
) -> int:
    """Total steps from the searcher's ``max_length`` (batches, or epochs of the schedule: of its
    ``packed`` windows under data.packing)."""
    length = config.searcher.max_length
    if length.batches is not None:
        return length.batches
    assert length.epochs is not None
    schedule = ScheduleSpec.from_manifest(
        manifest,
        seed=derive_seed(config.seed, trial_seed, "schedule"),
        world_size=config.resources.max_workers,
        batch_size=batch_size,
        windows=packed.layouts() if packed is not None else None,
    )
    return length.epochs * schedule.steps_per_epoch


def packed_store(
    config: ExperimentConfig,
    shards: ShardSet,
    hparams: dict[str, Any],
    trial: Trial,
    inputs: Mapping[str, str],
) -> PackedStore | None:
    """Under ``data.packing``, the shards' training rows packed into windows by ``trial``'s
    ``tokenize`` (built once per shards, window length and tokenizer — the trial's class, the
    bytes of its module, the hyperparameters and the digests of the directories it reads, its
    tokenizer's: ``inputs`` — then reused); None otherwise."""
    packing = config.data.packing
    if packing is None:
        return None
    trial_class = type(trial)
    if not defines_tokenize(trial_class):
        raise ConfigError(
            f"data.packing packs tokens, but trial {config.trial} defines no tokenize(rows) to make them"
        )
    source = inspect.getsourcefile(trial_class)
    identity: dict[str, Any] = {
        "trial": config.trial,
        "module": file_sha256(Path(source)) if source else "",
        "hparams": hparams,
    }
    if inputs:  # (absent without: the windows packed before inputs were recorded stay found)
        identity["inputs"] = dict(inputs)
    tokenizer = canonical_json(identity).decode()
    return pack_shards(
        shards,
        seq_len=packing.seq_len,
        tokenize=trial.tokenize,
        tokenizer=tokenizer,
        storage=open_storage(config.storage_path),
    )


def check_memorization_inputs(
    checked: CheckedPolicy, manifest: ShardManifest, canaries: dict[str, CanaryProbe]
) -> None:
    """Refuse, before any worker starts, what the memorization measures cannot honour: canary
    rows outside their corpus, and a monitored corpus with nothing to measure (no training rows,
    or neither held-out rows nor canaries)."""
    summaries = {corpus.corpus_id: corpus for corpus in manifest.corpora}
    for corpus_id, probe in canaries.items():
        rows = summaries[corpus_id].rows
        if outside := sorted(row for c in probe.canaries.canaries for row in c.rows if row >= rows):
            raise ConfigError(
                f"corpus '{corpus_id}' has {rows} rows, but its canaries name rows {outside[:5]}"
            )
    thresholds = checked.policy.policy.memorization
    for corpus_id in (thresholds.monitored_corpora or []) if thresholds else []:
        summary = summaries.get(corpus_id)
        if summary is None:
            raise ConfigError(
                f"the policy monitors corpus '{corpus_id}', which this experiment does not have "
                f"(corpora: {', '.join(sorted(summaries))})"
            )
        if not summary.train_rows or not (summary.holdout_rows or corpus_id in canaries):
            raise ConfigError(
                f"the policy monitors corpus '{corpus_id}', but it has {summary.train_rows} training "
                f"rows, {summary.holdout_rows} held-out rows and no canaries: nothing to measure"
            )


# --- where a run keeps its files in the experiment's storage ------------------------------------


def code_directory(storage: Storage, code: CodeSnapshot) -> Path:
    """Where the experiment keeps a trial's code snapshot: ``STORAGE/code/DIGEST``."""
    return storage.root / "code" / code.digest


def run_spec_path(storage: Storage, run_name: str) -> Path:
    """The run's spec (what ``govray resume`` rebuilds the run from): ``STORAGE/runs/RUN.json``."""
    return storage.root / "runs" / f"{run_name}.json"


def control_path(storage: Storage, run_name: str) -> Path:
    """Where the driver passes a pause/kill request to the run's rank 0 (shared storage)."""
    return storage.root / "control" / run_name


def recorded_trial_code(storage: Storage, trial: TrialRecord) -> CodeSnapshot:
    """Make this process import the trial class from ``trial``'s recorded code snapshot,
    verified against its digests (a changed or missing file is refused, named), whatever the
    working directory: what a replay or a resume of it runs. Call it before anything imports
    the trial (the policy check does)."""
    if trial.reproducibility_json is None:
        raise PlanError(f"trial {trial.id} recorded no code snapshot: it cannot be rerun as it ran")
    code = ReproducibilityRecord.model_validate_json(trial.reproducibility_json).code
    use_recorded_code(code, code_directory(storage, code), storage)
    return code


def recorded_final_folder(store: TrackingStore, storage: Storage, trial: TrialRecord) -> Path:
    """``trial``'s final checkpoint folder as the tracking store recorded it — a run's, or the copy
    Ray Tune keeps of a search trial's (at the step the trial ended: an ASHA stop's, whatever its
    workers did after it) —, fetched when this node lacks it, and unchanged since it was recorded
    (the store vouches for its manifest, the manifest for ``state.json``)."""
    assert trial.id is not None
    record = final_checkpoint_record(store, trial.id)
    if record is None:
        raise PlanError(f"trial {trial.id} has no recorded checkpoint")
    path = Path(record.path)
    if not storage.fetch(path):
        raise PlanError(f"trial {trial.id}'s final checkpoint {path} is missing from storage")
    recorded_state(path, record.manifest_digest)
    return path


def recorded_final_checkpoint(
    store: TrackingStore, storage: Storage, trial: TrialRecord, trust: TrustConfig
) -> Path:
    """``recorded_final_folder``, every file verified against ``trust``: what a replay compares
    with and follows."""
    path = recorded_final_folder(store, storage, trial)
    verify_checkpoint(path, trust)
    return path
