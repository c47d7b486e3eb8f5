"""A trial's state across its checkpoints: the governed step's weights, optimizer and ledger, the
controller's decisions and clean states, and where the run came from.

``TrialRun.save`` seals a signed checkpoint of all of it; ``restore`` resumes from one (the same
run, or a PBT clone continuing its donor); ``start_from`` begins a new run from another's weights
and ledger (fork, ``--from-checkpoint``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from safetensors.torch import load_file

from govray.core.canonical import file_sha256
from govray.core.keys import SigningKey
from govray.core.storage import open_storage
from govray.governance.adapter_files import load_adapter, save_adapter, save_base_tensors
from govray.governance.memorization import MemorizationReport
from govray.train.base_file import FrozenBase, link_or_copy
from govray.train.checkpoint import (
    MODEL_FILE,
    OPTIMIZER_META,
    REPORT_FILE,
    RUN_SPEC_FILE,
    CheckpointError,
    CheckpointState,
    checkpoint_world_size,
    load_checkpoint,
    optimizer_state_from_files,
    seal_checkpoint,
    shard_file,
    signed_manifest,
    verify_checkpoint,
)
from govray.train.clean_states import clean_name, load_clean_states, save_clean_state
from govray.train.control import Controller
from govray.train.decisions import GateDecision, RollbackDecision
from govray.train.ledger import Ledger
from govray.train.reproducibility import use_deterministic_mode
from govray.train.run_checkpoints import fetch_part, fetch_referenced
from govray.train.runspec import RunSpec
from govray.train.sharding import (
    consolidated,
    load_shards,
    local_optimizer_state,
    write_shards,
)
from govray.train.step import GovernedStep, Snapshot
from govray.train.trial import make_trial
from govray.train.worker import Worker, agreed


class TrialRun:
    """One worker's whole trial: the governed step, its controller, and the run's provenance."""

    def __init__(self, spec: RunSpec, governed: GovernedStep) -> None:
        self.spec = spec
        self.governed = governed
        self.control: Controller[Snapshot] = Controller(
            spec.lr_schedule, spec.early_stopping, spec.policy.memorization, spec.recorded_decisions
        )
        governed.scaler = self.control.scaler  # fp16's skips are the controller's decisions
        # The last checkpoint this run wrote or resumed from: under FSDP it holds the clean states
        # a rollback returns to (its own state, or the copies it carries of earlier ones).
        self.latest: tuple[Path, int] | None = None  # (folder, step)
        self.storage = open_storage(spec.storage) if spec.storage else None
        self.base = FrozenBase(spec.run_dir, self.storage)  # a frozen base is written once per run
        self.source: dict[str, Any] = {}  # the checkpoint a fork started from
        self.restored_from_run = ""  # the run that wrote the checkpoint this one resumed from
        self.last_report: MemorizationReport | None = None
        self.run_name = spec.run_name or Path(spec.run_dir).name

    @classmethod
    def open(cls, spec: RunSpec, worker: Worker) -> TrialRun:
        """The trial ``spec`` names, built for ``worker`` (in deterministic mode if its settings say so)."""
        use_deterministic_mode(spec.settings, worker.device)  # before the model is built
        return cls(spec, GovernedStep(spec, worker, make_trial(spec.trial, spec.hparams, spec.settings)))

    @property
    def cloned_from_run(self) -> str | None:
        """A PBT clone: the run whose state this one continued."""
        return self.restored_from_run if self.restored_from_run not in ("", self.run_name) else None

    # -- decisions carried out ---------------------------------------------------------------------

    def rescheduled(self) -> None:
        self.governed.schedule = self.governed.scheduled(self.control.schedule_events())

    def gate(self, decisions: list[GateDecision]) -> None:
        self.control.gate(decisions)
        self.rescheduled()

    def roll_back(self, decision: RollbackDecision) -> None:
        """Back to the clean state at ``to_step`` (kept in memory, and in every checkpoint written
        since); the LR settings stay those in force now (a plateau cut is not undone)."""
        snapshot = self.control.rollback_snapshot(decision)
        if snapshot.on_storage:
            self._load_clean(snapshot)
        else:
            self.governed.load_snapshot(snapshot)
        if self.control.plateau is not None:
            self.governed.set_lr_scale(self.control.lr_scale)
        self.rescheduled()

    def act_on_memorization(
        self, steps_done: int, report: MemorizationReport
    ) -> list[GateDecision | RollbackDecision]:
        """The controller's memorization decisions after this validation, carried out: roll back
        to the clean state, gate the flagged corpora; then the clean state moves on."""
        self.last_report = report
        gated = {gate.corpus_id for gate in self.control.gates}
        made = self.control.after_memorization(steps_done, report)
        for decision in made:
            if isinstance(decision, RollbackDecision):
                self.roll_back(decision)
        self.gate([d for d in made if isinstance(d, GateDecision)])
        self.control.settle_clean(steps_done, report, gated, made, self.governed.snapshot)
        return made

    def keep_clean(self, steps_done: int) -> None:
        self.control.keep_clean(steps_done, self.governed.snapshot)

    def _load_clean(self, snapshot: Snapshot) -> None:
        """FSDP: back to a clean state from storage (no copy of it was kept in memory): the last
        checkpoint's own state, or the copy of it that checkpoint carries; each rank verifies and
        reads its own shards, and every rank refuses if one does."""
        if self.latest is None:
            raise CheckpointError(f"the clean state of step {snapshot.step} is in no checkpoint of this run")
        (folder, step), governed = self.latest, self.governed
        worker = governed.worker

        def verified() -> None:
            fetch_part(folder, self.storage, worker.rank)
            verify_checkpoint(folder, self.spec.trust, worker.rank)

        agreed(verified, worker, CheckpointError)

        def path(name: str) -> Path:
            return folder / (name if step == snapshot.step else clean_name(snapshot.step, name))

        load_shards(governed.model, path(shard_file("model", worker.rank, worker.world_size)))
        for adapter in governed.model.adapter_names():
            load_adapter(governed.model, adapter, path(f"adapter-{adapter}.safetensors"))
        state = optimizer_state_from_files(
            load_file(str(path(shard_file("optimizer", worker.rank, worker.world_size)))),
            json.loads(path(OPTIMIZER_META).read_text()),
        )
        governed.load_optimizer_state(state)
        governed.ledger = Ledger.from_json(snapshot.ledger)
        governed.take_hyperparameters()

    def _carry_clean(self, directory: Path, steps_done: int, names: list[str]) -> dict[str, str]:
        """FSDP: into a new checkpoint, these files of every earlier clean state, hard-linked (or
        copied) from the last checkpoint, which holds each (its own, or carried), each checked
        against that checkpoint's signed manifest (a tampered file is never signed again);
        returns the copies' sha256 by name."""
        carried: dict[str, str] = {}
        earlier = self.control.earlier_snapshots(steps_done)
        if not earlier:
            return carried
        if self.latest is None:
            raise CheckpointError(f"the clean state of step {earlier[0][0]} is in no checkpoint of this run")
        source, source_step = self.latest
        fetch_part(source, self.storage, self.governed.worker.rank)
        signed = signed_manifest(source, self.spec.trust)[0].files
        for step, _ in earlier:
            for name in names:
                origin = source / (name if step == source_step else clean_name(step, name))
                target = directory / clean_name(step, name)
                target.unlink(missing_ok=True)  # (a killed attempt's): never write through a link
                link_or_copy(origin, target)
                carried[target.name] = file_sha256(target)
                if carried[target.name] != signed.get(origin.name):
                    raise CheckpointError(f"{origin}: sha256 does not match its signed manifest (tampered)")
        return carried

    # -- checkpoints -------------------------------------------------------------------------------

    def checkpoint_state(self, steps_done: int) -> CheckpointState:
        schedule = self.governed.schedule
        return CheckpointState(
            step=steps_done,
            epoch=schedule.locate(steps_done)[0],
            seed=self.spec.seed,
            trial_seed=self.spec.trial_seed,
            schedule=schedule.to_json(),
            schedule_digest=schedule.digest(),
            policy_digest=self.spec.policy_digest,
            config_digest=self.spec.config_digest,
            ledger=self.governed.ledger.to_json(),
            adapters=list(self.governed.model.adapter_names()),
            reproducibility=self.spec.reproducibility,
            sharding={"world_size": self.governed.worker.world_size} if self.governed.sharded else {},
            **self.control.state(),
            clean_ledgers={
                str(step): snap.ledger for step, snap in self.control.earlier_snapshots(steps_done)
            },
            memorization=self.last_report.model_dump(mode="json") if self.last_report else {},
            source=self.source,
            run=self.run_name,
        )

    def save(
        self, directory: Path, steps_done: int, key: SigningKey | None, report: Mapping[str, Any]
    ) -> None:
        """Base and adapter weights, optimizer and governance state, and the ``report`` this
        checkpoint goes with, signed by the platform key (rank 0's ``key``). Under FSDP every
        rank calls it: each writes and hashes its own shard files, rank 0 the rest and the
        manifest over all of them, and every rank raises if any rank failed."""
        directory.mkdir(parents=True, exist_ok=True)
        if not self.governed.sharded:
            assert key is not None
            self._seal(directory, steps_done, key, report, None)
        else:
            digests = self._save_shards(directory, steps_done)
            worker = self.governed.worker
            agreed(lambda: self._seal(directory, steps_done, key, report, digests), worker, CheckpointError)
        self.latest = (directory, steps_done)

    def _seal(
        self,
        directory: Path,
        steps_done: int,
        key: SigningKey | None,
        report: Mapping[str, Any],
        shard_digests: Mapping[str, str] | None,
    ) -> None:
        """Rank 0 (``key``): everything but the shards, then the signed manifest."""
        if key is None:
            return
        model = self.governed.model
        referenced = None
        if shard_digests is None:
            referenced = self.base.save(model, directory)  # or a reference to the run's frozen base
        elif "objective" in report.get("metrics", {}) or report.get("ledger") is not None:
            # A validation's or the trial's last checkpoint also holds the whole base model (what
            # the registry, attestations and exports read), put together from the shard files.
            self._consolidate(directory, shard_digests)
        for adapter in model.adapter_names():
            save_adapter(model, adapter, directory / f"adapter-{adapter}.safetensors")
        if shard_digests is None:  # rollback targets survive a resume
            for step, snapshot in self.control.earlier_snapshots(steps_done):
                save_clean_state(directory, step, snapshot.weights, snapshot.optimizer)
        else:  # the clean states' shared files (the shards are carried by their ranks)
            adapters = [f"adapter-{adapter}.safetensors" for adapter in model.adapter_names()]
            self._carry_clean(directory, steps_done, [OPTIMIZER_META, *adapters])
        (directory / RUN_SPEC_FILE).write_text(self.spec.model_dump_json(indent=1))
        (directory / REPORT_FILE).write_text(json.dumps(dict(report), indent=1, sort_keys=True))
        optimizer = self.governed.optimizer.state_dict()
        if shard_digests is not None:
            optimizer = local_optimizer_state(optimizer)
        seal_checkpoint(
            directory, optimizer, self.checkpoint_state(steps_done), key, shard_digests, referenced
        )

    def _save_shards(self, directory: Path, steps_done: int) -> dict[str, str]:
        """Every rank's shard files written (and on object storage) and hashed, all ranks' digests
        gathered (every rank raises if any failed)."""
        governed, worker = self.governed, self.governed.worker

        def write() -> dict[str, str]:
            rank, world = worker.rank, worker.world_size
            written = write_shards(directory, governed.model, governed.optimizer, rank, world)
            own = [shard_file(kind, rank, world) for kind in ("model", "optimizer")]
            written |= self._carry_clean(directory, steps_done, own)
            if self.storage is not None and directory.is_relative_to(self.storage.root):
                self.storage.upload(*(directory / name for name in written))  # before rank 0 seals
            return written

        written = agreed(write, worker, CheckpointError)
        gathered: list[Any] = [None] * worker.world_size
        dist.all_gather_object(gathered, written, group=worker.host_group)
        return {name: digest for part in gathered for name, digest in part.items()}

    def _fits_world(self, directory: Path) -> None:
        """Refuse a checkpoint sharded over another world size (read unverified from its state:
        a refusal only; what is loaded is verified)."""
        fetch_part(directory, self.storage, self.governed.worker.rank)
        try:
            written_by = checkpoint_world_size(directory)
        except (OSError, ValueError):
            return  # unreadable (tampered, truncated): the verified load refuses it, naming the file
        self._refuse_other_world(directory, written_by)

    def _refuse_other_world(self, directory: Path, written_by: int | None) -> None:
        world = self.governed.worker.world_size
        if written_by != world:
            raise CheckpointError(
                f"{directory}: written by {written_by or 'an unsharded run of'} worker(s), resumed by "
                f"{world} sharded workers: a governed run resumes on the world size it started with "
                "(its schedule gives each worker its slots)"
            )

    def _consolidate(self, directory: Path, shard_digests: Mapping[str, str]) -> None:
        """Rank 0: ``model.safetensors`` from every rank's model shard file (those written on
        other nodes fetched from the object storage), each checked against its rank's digest."""
        world = self.governed.worker.world_size
        for rank in range(world):
            path = directory / shard_file("model", rank, world)
            if self.storage is not None and not path.exists():
                self.storage.fetch(path)
            if rank != 0 and file_sha256(path) != shard_digests[path.name]:
                raise CheckpointError(f"{path}: changed after its rank wrote it (sha256 differs)")
        save_base_tensors(consolidated(directory, world), directory / MODEL_FILE)

    def _check_schedule(self, directory: Path, state: CheckpointState) -> None:
        schedule = self.governed.schedule
        if state.schedule.get("version") != schedule.version:
            raise CheckpointError(
                f"{directory}: written on schedule version {state.schedule.get('version')}, this run "
                f"is on version {schedule.version} (its run spec's schedule_version)"
            )
        if state.schedule_digest != schedule.digest():
            raise CheckpointError(
                f"{directory}: its schedule inputs differ from this run's (a different run?)"
            )

    def restore(self, directory: Path) -> int:
        """Resume from a verified checkpoint; returns the number of steps it had completed. Under
        FSDP each rank verifies and reads what it needs (the shared files, its own shards), and
        every rank refuses if any rank did, naming the files."""
        worker, sharded = self.governed.worker, self.governed.sharded
        if sharded:  # refused before any rank looks for its shards (its file may not exist)
            agreed(lambda: self._fits_world(directory), worker, CheckpointError)
        else:
            fetch_referenced(directory, self.storage)
        loaded = agreed(
            lambda: load_checkpoint(directory, self.spec.trust, worker.rank if sharded else None),
            worker if sharded else None,
            CheckpointError,
        )
        written_by = loaded.state.sharding.get("world_size")
        if sharded:
            self._refuse_other_world(directory, written_by)  # (again, now that the state is verified)
        if written_by is not None and not sharded:
            raise CheckpointError(
                f"{directory}: sharded over {written_by} ranks (strategy fsdp); this run is not sharded"
            )
        self.control.restore(loaded.state)
        self.rescheduled()
        self._check_schedule(directory, loaded.state)
        governed = self.governed
        governed.load_weights(directory)
        self.base.resumed(directory, governed.model)
        governed.load_optimizer_state(loaded.optimizer_state)
        governed.take_hyperparameters()
        governed.ledger = Ledger.from_json(loaded.state.ledger)
        self.source = loaded.state.source
        self.restored_from_run = loaded.state.run
        if self.control.plateau is not None and loaded.state.plateau:
            governed.set_lr_scale(self.control.lr_scale)
        if loaded.state.memorization:
            self.last_report = MemorizationReport.model_validate(loaded.state.memorization)
        self.latest = (directory, loaded.state.step)
        if sharded:  # the clean states stay on storage: this checkpoint carries them
            self.control.snapshots = {
                int(step): Snapshot(int(step), {}, {}, ledger, on_storage=True)
                for step, ledger in loaded.state.clean_ledgers.items()
            }
        else:
            self.control.snapshots = {
                step: Snapshot(step, weights, optimizer, loaded.state.clean_ledgers[str(step)])
                for step, (weights, optimizer) in load_clean_states(loaded).items()
            }
        if self.control.clean_step == loaded.state.step or self.control.replayed_rollbacks is not None:
            self.keep_clean(loaded.state.step)  # this checkpoint is itself the (or a recorded) target
        return loaded.state.step

    def start_from(self, directory: Path) -> None:
        """Begin at step 0 from another run's verified checkpoint: its weights (base, and adapters
        both runs have) and its ledger — what reached the weights stays on the record. The
        optimizer starts fresh; the source is kept in every checkpoint of this run."""
        fetch_referenced(directory, self.storage)
        loaded = load_checkpoint(directory, self.spec.trust)
        try:
            self.governed.load_weights(directory, adapters_present_only=True)
        except RuntimeError as error:
            raise CheckpointError(
                f"{directory / MODEL_FILE} does not fit this trial's model: {error}"
            ) from None
        self.governed.ledger = Ledger.from_json(loaded.state.ledger)
        self.source = {
            "path": str(directory),
            "manifest_sha256": loaded.manifest_digest,
            "signer": loaded.signer,
            "step": loaded.state.step,
            "config_digest": loaded.state.config_digest,
            "policy_digest": loaded.state.policy_digest,
            **self.spec.start_model,
        }
