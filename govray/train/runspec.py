"""What a trial's workers run: the one JSON document that crosses from the driver to every
worker (and is kept in every checkpoint as ``run.json``), and the ``Attempt`` that carries it.

The driver builds it (``govray.platform.run.plan.plan_run``), complete: nothing edits it after
planning, so what a run's workers train is the spec its driver planned and recorded
(``runs/RUN.json``), and every checkpoint's ``run.json`` is that document (a replay along a PBT
lineage trains each lineage entry's own plan, recorded in the checkpoints of its segment). What
differs between fits of one run (where this one resumes or pauses, whom it reports to, which copy
of the trial's code it imports) is the ``Attempt``'s.
Attestation, row lookup and search read the spec without importing the training loop. It
carries the run's routing table, resolved by the driver on a meta-device model: readers take it
from here instead of building the model, and every worker checks that its own model resolves to
the same table.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from govray.config.experiment import EarlyStoppingPolicy, PlateauSchedule
from govray.config.resources import ParallelStrategy
from govray.config.training import TrainingSettings
from govray.core.errors import RoutingError, describe_validation_error
from govray.core.formats import RUN_SPEC_FORMAT, known_format
from govray.core.keys import TrustConfig
from govray.governance.canaries import CanaryProbe
from govray.governance.policy import DepthPolicy
from govray.governance.routing import RoutingTable
from govray.train.checkpoints.manifest import CheckpointError
from govray.train.checkpoints.signer import SignerChannel
from govray.train.control.decisions import RecordedDecision

RUN_SPEC_FILE = "run.json"  # the spec's file name in every checkpoint


class RunSpec(BaseModel):
    """Everything a worker needs, as JSON (it crosses process and node boundaries)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = RUN_SPEC_FORMAT
    trial: str
    hparams: dict[str, Any]
    settings: TrainingSettings  # the experiment's training settings with hparams applied
    policy: DepthPolicy
    routing: RoutingTable  # the policy resolved against the trial's model (by the driver, on meta)
    shard_root: str
    shards_sha256: str  # of the shard manifest (whose per-file digests every read is checked against)
    # data.packing: the packed token store the schedule reads windows from, and its manifest's
    # sha256 ("": rows are read, not windows).
    packed_root: str = ""
    packed_sha256: str = ""
    eval_rows: int  # held-out rows per corpus a validation evaluates (evenly spaced: data.eval_rows)
    # The digest of each local directory the trial reads besides its rows (``Trial.input_directories``:
    # a tokenizer's), by the hyperparameter naming it.
    input_digests: dict[str, str] = Field(default_factory=dict)
    seed: int
    trial_seed: int
    max_steps: int
    report_every: int
    threads: int = 1
    use_gpu: bool = False  # each worker trains on its GPU (resources.use_gpu)
    strategy: ParallelStrategy = (
        ParallelStrategy.DDP
    )  # resources.strategy: a full model per worker, or FSDP2 shards
    shard_group: int | None = None  # resources.shard_group (strategy hsdp; None: workers per node)
    # The schedule's slots per step (a step's global batch) when the run starts: an elastic run's
    # most workers, whatever the world's size; 0 (a fixed-size run): the world's size; a replay's:
    # its original's. A resume continues its checkpoint's, whatever this is.
    slots_per_step: int = 0
    excluded_corpora: tuple[str, ...] = ()
    code_dir: str = ""  # where the run was planned: the driver's working directory, or ...
    recorded_code: bool = False  # ... the recorded code snapshot of the trial it replays
    checkpoint_period: int = 100  # steps between signed checkpoints (and one at the end)
    config_digest: str = ""
    policy_digest: str = ""
    # Who vouched for the policy: its envelope's signer keyid, or ``unsigned`` (allowed at
    # preflight, audited); and the sha256 of the trust file it was checked against ("": none).
    policy_signer: str
    policy_trust_sha256: str
    run_dir: str = ""  # in local mode (no Ray Train controller) checkpoints are written here
    reproducibility: dict[str, Any] = {}  # the trial's ReproducibilityRecord, kept in every checkpoint
    validation_period: int | None = None  # steps between validations (each saves a checkpoint)
    lr_schedule: PlateauSchedule | None = None
    # A replay applies its source trial's decisions instead of taking its own.
    recorded_decisions: tuple[RecordedDecision, ...] | None = None
    early_stopping: EarlyStoppingPolicy | None = None
    # Rank 0 reads a pause/kill request from this file at every step boundary (the driver writes it).
    control_file: str = ""
    control_period: int = 5  # steps between looks (a broadcast costs ~0.3 ms on 2 CPU workers)
    # Start (not resume) from this checkpoint's weights and ledger: fork / --from-checkpoint.
    start_checkpoint: str = ""
    # ... when that checkpoint is a registered model version: its uri, and its provenance
    # attestation's file name and sha256 (the run's attestation lists it as a dependency).
    start_model: dict[str, str] = {}
    log_dir: str = ""  # each rank appends to LOG_DIR/rank-N.log
    # The experiment's storage_path (``govray.core.storage``): a local directory, or object storage
    # (s3://...) whose node-local cache holds shard_root, run_dir and control_file: workers fetch
    # from it what their node lacks, and upload what they write.
    storage: str
    run_name: str = ""  # the trial's run (a search trial's segments and scratch dirs share it)
    experiment: str = ""  # the experiment's name (a tag of the exported governance metrics)
    # The search objective, reported at every validation: metric + lambda * memorization_score.
    objective_metric: str = "validation_loss"
    smaller_is_better: bool = True
    memorization_lambda: float = 0.0
    canaries: dict[str, CanaryProbe] = Field(default_factory=dict)  # corpus → its canaries

    def file_bytes(self) -> bytes:
        """The spec as every checkpoint holds it (``run.json``): what the launch binds a run's
        signer capability to (``sha256``) and rank 0 writes."""
        return self.model_dump_json(indent=1).encode()

    def sha256(self) -> str:
        """The sha256 of ``file_bytes``: the run spec a run's checkpoints must hold to be sealed."""
        return hashlib.sha256(self.file_bytes()).hexdigest()

    @field_validator("format")
    @classmethod
    def _known_format(cls, found: str) -> str:
        return known_format(found, RUN_SPEC_FORMAT, "run.json")

    @model_validator(mode="before")
    @classmethod
    def _no_key_path(cls, document: Any) -> Any:
        """A spec written before the platform's signer ran apart named the platform key's path
        (``platform_key``): read, and dropped (nothing reads a key through a spec now)."""
        if isinstance(document, dict) and "platform_key" in document:
            return {name: value for name, value in document.items() if name != "platform_key"}
        return document

    def check_routing(self, resolved: RoutingTable) -> None:
        """Refuse a worker whose model resolves to another routing table than the one the run was
        planned, attested and looked up with (the trial's code changed since)."""
        if resolved == self.routing:
            return
        planned = self.routing
        compared = {
            "layers": (planned.layers, resolved.layers),
            "parameters": (_shapes(planned), _shapes(resolved)),
            "routes": (planned.routes, resolved.routes),
            "masks": (planned.masks, resolved.masks),
            "adapter targets": (planned.adapter_targets, resolved.adapter_targets),
        }
        differing = [what for what, (mine, theirs) in compared.items() if mine != theirs]
        first = _first_difference(_shapes(planned), _shapes(resolved))
        raise RoutingError(
            f"trial {self.trial}: the model built here resolves policy '{self.policy.name}' "
            f"v{self.policy.version} to another routing table than the run's (run.json): the "
            f"trial's code changed since the run was planned; {', '.join(differing) or 'tables'} "
            f"differ{f' (parameters: {first})' if first else ''}"
        )


class Attempt(BaseModel):
    """One fit of a planned run, as its workers receive it (``train_loop_config``): the run's spec,
    unchanged, and what this fit alone asks. Nothing here is recorded as the run: a run resumed,
    paused at a replay segment's end or continued by a PBT clone is the same planned run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: RunSpec
    # The platform keys (and revocations) whose checkpoints this fit accepts: the operator's, as
    # the driver read them when it started the fit (``operator_trust``), never the spec's file.
    trust: TrustConfig
    code_dir: str  # where this fit's workers import the trial from: the plan's, or ...
    recorded_code: bool  # ... the run's recorded code snapshot (a resume): verified, imported from there
    # Start from this verified checkpoint's full state when the run directory holds none (Ray's own
    # checkpoint comes first): a Tune trial restored, or a PBT clone continuing its donor.
    resume_checkpoint: str = ""
    # Pause after this step with a checkpoint, as on a pause request: a replay's segment ends
    # there, and the next resumes on the world size the replayed run had from that step.
    pause_at: int | None = None
    # The driver's ReportSink actor (``govray.train.run.session``): where rank 0 sends its reports
    # without waiting (a run on Ray Train workers; empty in-process).
    report_sink: str = ""
    # The run's channel to the platform's signer (its socket and the capability the launch opened
    # for the directory this fit writes its checkpoints in); None: this fit seals nothing.
    signer: SignerChannel | None = None

    @classmethod
    def of(
        cls,
        spec: RunSpec,
        *,
        trust: TrustConfig | None = None,
        resume_checkpoint: str = "",
        pause_at: int | None = None,
        report_sink: str = "",
        recorded_code_dir: str = "",
        signer: SignerChannel | None = None,
    ) -> Attempt:
        """A fit of ``spec`` importing the trial as planned, or from ``recorded_code_dir`` (the
        run's recorded code snapshot: a resume runs the code the run started with). ``trust``: the
        operator's (``operator_trust``) unless given (the trust a run's policy check read).
        ``signer``: the channel the launch opened (``govray.signer.local.open_channel``)."""
        from govray.core.settings import operator_trust

        return cls(
            spec=spec,
            trust=trust if trust is not None else operator_trust(),
            code_dir=recorded_code_dir or spec.code_dir,
            recorded_code=bool(recorded_code_dir) or spec.recorded_code,
            resume_checkpoint=resume_checkpoint,
            pause_at=pause_at,
            report_sink=report_sink,
            signer=signer,
        )


# ``train_loop_config``'s key for the Ray object holding the attempt's signer capability.
CAPABILITY_REF = "signer_capability"


def train_loop_config(attempt: Attempt) -> dict[str, Any]:
    """``attempt`` as Ray Train's ``train_loop_config``, its signer capability out of band: Ray
    Train hands that config to whoever reads its state (its state actor, which the dashboard's
    Train page and export events serve), so the capability travels as a Ray object the config
    names only by its reference, and each worker fetches it (:func:`attempt_of`). Reading it takes
    a connection to the cluster, not a look at the dashboard."""
    import ray

    config = attempt.model_dump(mode="json")
    if attempt.signer is not None:
        config["signer"]["capability"] = ""
        config[CAPABILITY_REF] = ray.put(attempt.signer.capability)
    return config


def attempt_of(config: dict[str, Any]) -> Attempt:
    """The ``Attempt`` a ``train_loop_config`` (:func:`train_loop_config`) or an attempt's JSON
    carries, its signer capability fetched from the object the config refers to."""
    import ray

    fields = dict(config)
    reference = fields.pop(CAPABILITY_REF, None)
    attempt = Attempt.model_validate(fields)
    if reference is None or attempt.signer is None:
        return attempt
    channel = attempt.signer.model_copy(update={"capability": ray.get(reference)})
    return attempt.model_copy(update={"signer": channel})


def _shapes(table: RoutingTable) -> tuple[str, ...]:
    return tuple(f"{info.name} ({info.numel} elements)" for info in table.parameters)


def _first_difference(planned: tuple[str, ...], found: tuple[str, ...]) -> str:
    for index, (mine, theirs) in enumerate(zip(planned, found, strict=False)):
        if mine != theirs:
            return f"#{index} is {mine} in run.json, {theirs} here"
    if len(planned) != len(found):
        return f"run.json lists {len(planned)}, the model has {len(found)}"
    return ""


def read_run_spec(path: Path) -> RunSpec:
    """The run spec in ``path`` (a checkpoint's or a run's ``run.json``): the one reader of the
    file. A missing file, or one that is not a run spec this govray writes (a pre-release one, an
    edited one), is a ``CheckpointError`` naming the file and what is wrong."""
    try:
        text = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"{path}: no run spec ({error.strerror})") from None
    return parse_run_spec(text, path)


def parse_run_spec(text: bytes, path: Path) -> RunSpec:
    """The run spec in ``text``, read from ``path`` (``CheckpointError`` naming it otherwise)."""
    try:
        return RunSpec.model_validate_json(text)
    except ValidationError as error:
        raise CheckpointError(
            f"{path}: not a run spec this govray reads: {describe_validation_error(error)}"
        ) from None
