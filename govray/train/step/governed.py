"""The governed step: what every worker does for one step of the schedule.

Read ``GovernedStep.step`` top to bottom: the schedule picks this worker's slot (one route and its
rows; on a world smaller than the run's slots per step several, in rounds: ``train.rounds``);
the trial gives per-example losses (under bf16 autocast when asked), backward runs the governed
allreduce (DDP's comm hook, or FSDP's reduce-scatter: each tensor's gradient masked to
the slots that may update it, scaled by their example count) — after k-1 micro-batches
accumulated under ``no_sync()`` when ``accumulation_steps`` is k (DDP; FSDP reduce-scatters each
micro-batch into its sharded gradients and divides once) — then the parallelism twin
(``train.parallel``: one worker, DDP or FSDP, chosen once) reduces what backward did not (the
adapters, in one flat buffer); the governor clips per route group, the optimizer steps, and the ledger records
what reached which tensor — from the schedule, never from the gradients. Tensors no route may
update are out of autograd; a slot without rows runs a stand-in row whose losses are selected
away (``_selected_away``), so the trial never sees an empty batch.

Nothing in a step waits for the device: the loss sum stays a device tensor and the non-finite
flags stay on the device until the loop's next boundary (``check_finite``).

Example::

    governed = GovernedStep(WorkerContext.of(spec, Worker.detect()), trial)
    loss_sum, examples = governed.step(0)       # loss_sum: a 0-d float64 tensor on the device
    governed.governor.check_finite()            # at a boundary
    validation = governed.evaluate()    # {"validation_loss": ..., "validation_loss/CORPUS": ...}
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from torch import nn

from govray.core.errors import ConfigError
from govray.data.packed import PackedStore
from govray.data.schedule import ScheduleEvent, ScheduleSpec, derive_seed
from govray.data.shard_reader import ShardReader, evaluation_rows
from govray.data.shards import ShardSet
from govray.data.slots import Slot, rank_slots
from govray.data.step_rows import StepRows, step_rows
from govray.governance.adapter_files import load_adapter
from govray.governance.adapters import GovernedModel
from govray.governance.allreduce import parameters_by_name
from govray.governance.memorization import MemorizationReport, MemorizationThresholds, memorization_report
from govray.governance.routing import RoutingTable, resolve_routes
from govray.train.checkpoints.manifest import Manifest
from govray.train.context import WorkerContext
from govray.train.control.probe import MemorizationProbe
from govray.train.parallel.rounds import RoundSums, refuse_rounds
from govray.train.parallel.strategies import Autocast, CleanState, Fp16Scaling, NoScaling
from govray.train.parallel.worker import RouteRows, all_reduce_sums
from govray.train.run.dashboard import GovernanceMetrics
from govray.train.step.batches import MicroBatch, Prefetcher, on_device
from govray.train.step.ledger import Ledger
from govray.train.step.memory_savers import checkpoint_activations
from govray.train.step.scaling import LossScaler
from govray.train.step.trainable import freeze_unroutable, trainable_in_fp32
from govray.train.trial import Trial


def _selected_away(losses: torch.Tensor) -> torch.Tensor:
    """A stand-in's losses replaced by zeros by selection (never multiplied: a non-finite value
    cannot survive), still in the graph so that backward runs every collective it holds.

    Why a stand-in rather than skipping the forward: under DDP and FSDP the forward and backward
    themselves hold the collectives (bucket all-reduces, all-gathers, reduce-scatters), so every
    rank must run them. Its gradients are exact zeros, and a rank whose whole slot is empty has
    no route (``begin_step(route=None)``), so every region it contributes is also zero-filled by
    the governor's masks: its contribution to every tensor is an exact zero, the counts and the
    ledger (from the schedule) do not see it, and removal = replay stays bit-identical."""
    return losses.masked_fill(torch.ones_like(losses, dtype=torch.bool), 0.0)


def allowed_route_sets(model: GovernedModel, table: RoutingTable) -> list[frozenset[str]]:
    """For every trainable tensor of ``model`` (in order), the routes that may update it."""
    by_id: dict[int, frozenset[str]] = {
        id(parameter): frozenset(table.routes_updating(name))
        for name, parameter in model.base_named_parameters()
    }
    for route, adapter in table.adapter_names.items():
        for parameter in model.adapter_parameters(adapter):
            by_id[id(parameter)] = frozenset({route})
    return [by_id[id(parameter)] for _, parameter in parameters_by_name(model)]


class GovernedStep:
    """One worker's model, governor, optimizer, schedule and ledger; ``step()`` is one governed step."""

    def __init__(self, context: WorkerContext, trial: Trial) -> None:
        spec, worker = context.spec, context.worker
        self.spec, self.worker, self.trial = spec, worker, trial
        self.device = worker.device
        settings = trial.settings
        self.micro_batches = settings.accumulation_steps
        # How the workers hold the model (one, DDP, FSDP, HSDP): asked, never a flag.
        self.parallel = context.parallel
        self.autocast = Autocast(self.device, self.parallel.autocast_dtype(settings.precision))
        # Under FSDP the model is built on meta and each rank fills its shards from the seed file
        # rank 0 wrote once (``seed``); otherwise built on the CPU from the seeded generator.
        base, self.seed = self.parallel.build_base(spec, trial, context.storage)
        if settings.activation_checkpointing:  # blocks recompute their activations in the backward
            checkpoint_activations(base, trial.checkpoint_units(base))
        self.routing = resolve_routes(spec.policy, base, trial.layers(base))
        spec.check_routing(self.routing)  # the table the driver planned, attests and looks rows up with
        if not any(parameter.is_meta for parameter in base.parameters()):
            base.to(self.device)
        self.model = GovernedModel(
            base, self.routing, spec.policy.adapters, seed=derive_seed(spec.seed, "adapters")
        )
        self.shards = ShardSet.fetch_manifest(Path(spec.shard_root), context.storage, spec.shards_sha256)
        # Under data.packing a scheduled position is a window of tokens, not a row.
        self.packed = (
            PackedStore.fetch(Path(spec.packed_root), context.storage, sha256=spec.packed_sha256)
            if spec.packed_root
            else None
        )
        # The schedule's slots per step: the run's (an elastic run's most workers, a replay's
        # original's), this world's size for a fixed-size run (0), or a resumed run's
        # (``resume_slots``).
        self.slots_per_step = worker.world_size
        if spec.slots_per_step:
            self.resume_slots(spec.slots_per_step)
        self.schedule = self.scheduled([])
        self.route_names = [layout.route for layout in self.schedule.routes]
        # fp16's per-route loss scales (the trial's controller shares its own: TrialRun).
        scaler = LossScaler(None, next_seq=lambda: len(scaler.skips))
        self.scaling = (
            Fp16Scaling(scaler, worker.distributed) if self.autocast.dtype is torch.float16 else NoScaling()
        )
        # Reads follow the schedule: only the row groups of this worker's slots, prefetched.
        self.rows = RouteRows(ShardReader(self.shards, context.storage), self.packed, trial.pad_id)
        self.batches = Prefetcher(
            self.rows.take,
            trial.collate,
            self._stand_in,
            self.device,
            self.micro_batches,
            split=self.parallel.micro_batches,
        )
        self.counts = self.rows.counts(trial)  # examples and tokens of each position (the ledger's)
        units = self.parallel.layer_units(base, trial)
        freeze_unroutable(self.model, self.routing)
        trainable_in_fp32(self.model)
        self.parallel.shard(self.model, units, settings.precision)  # FSDP2: a shard of every base tensor
        if self.seed is not None:
            self.seed.fill(self.model, self.device)  # to_empty: only this rank's shards, from the seed
        named = parameters_by_name(self.model)
        allowed = allowed_route_sets(self.model, self.routing)
        self.governor = self.parallel.governor(self.model, named, allowed)
        self.forward: nn.Module = self.parallel.wrap(self.model, self.governor)
        # Under FSDP, sharded and whole (adapter) tensors in their own parameter groups.
        self.trainable = self.parallel.optimizer_groups([parameter for _, parameter in named])
        self.optimizer = trial.build_optimizer(self.trainable)
        for group in self.optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])  # decisions scale it
        self.probe = MemorizationProbe(
            trial,
            self.model,
            self.routing,
            self.shards.manifest,
            self.rows,
            spec.policy,
            spec.canaries,
            derive_seed(spec.seed, spec.trial_seed),
            worker,
            split=self.parallel.probe_split,
            autocast=self.autocast,  # measured as trained: under the step's autocast
        )
        self.ledger = Ledger()
        # Rank 0 sees every slot of every step: it alone exports the dashboard's counters.
        run_name = spec.run_name or Path(spec.run_dir).name
        self.exported = GovernanceMetrics(spec.experiment, run_name) if worker.rank == 0 else None

    def step(self, step: int) -> tuple[torch.Tensor, int]:
        """One governed step; returns this worker's loss sum (a float64 device tensor: reading it
        is the caller's choice, at a boundary) and its example count."""
        # This worker's slots, one per round: its own slot when the world is the step's slots.
        rounds = rank_slots(self.schedule, step, self.worker.rank, self.worker.world_size)
        every = step_rows(self.schedule, step)  # every slot of the step, summed by route: O(slots)
        counts = self._divisors(every)
        parts = self.batches.take([mine for _, mine in rounds], self._upcoming(step))  # collated ahead
        if not self.model.training:  # after a validation (train() walks every module)
            self.model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = RoundSums() if len(rounds) > 1 else None  # see train.rounds
        for number, ((index, mine), pieces) in enumerate(zip(rounds, parts, strict=True)):
            # Per-slot seeding: no RNG stream crosses a step, so a resume or a replay needs no RNG state.
            torch.manual_seed(derive_seed(self.spec.seed, self.spec.trial_seed, step, index))
            route = None if mine.empty else mine.route
            # fp16: this slot's loss is multiplied by its route's scale (and unscaled in the hook).
            scale = self.scaling.scale(route)
            if number == 0:
                self.governor.begin_step(step, route, counts, scale)  # the masks and divisors of this step
            else:
                self.governor.begin_round(route, scale)  # this slot's masks, the step's divisors
            adapter = self.routing.adapter_names.get(route) if route is not None else None
            with self.model.active(adapter):  # base weights never see another route's adapter
                loss_sum += self._slot(pieces, scale)
            if sums is not None:  # what this round reduced, set aside (train.rounds)
                sums.set_aside(self.parallel.reduce_round())
        if sums is None:
            self.parallel.reduce()  # what DDP's hook or FSDP's reduce-scatter did not
        else:
            sums.put_back()
            self.parallel.end_rounds()
        # fp16: the routes that overflowed skip their tensors (a recorded decision)
        skip = self.scaling.skipped(step + 1, counts, self.governor, self.route_names)
        # grad None where no slot may update (no momentum, no decay); clip per group; a NaN
        # raises a flag on the device that the next boundary refuses (check_finite).
        self.governor.finish_step(self.trial.max_grad_norm, skip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ledger.record_rows(every, self.routing, self.counts)  # from the schedule, not the gradients
        if self.exported is not None:
            self.exported.record_step(every.corpus_examples(), self.governor.masked_fraction())
        return loss_sum, sum(len(mine.rows) for _, mine in rounds)

    def _slot(self, parts: list[MicroBatch], scale: float | None) -> torch.Tensor:
        """Forward and backward of one slot's micro-batches; returns their counted loss sum.

        The first k-1 micro-batches accumulate locally (forward and backward under no_sync;
        FSDP reduce-scatters each into its shards); after the last one's backward each tensor's
        gradient is masked to the routes that may update it, summed and divided by those
        routes' example count (not the world size)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            with contextlib.nullcontext() if last else self.parallel.no_sync(self.forward):
                with self.autocast():
                    losses = self.trial.loss(self.forward, part.batch)  # one loss per example
                    if not part.counted:
                        losses = _selected_away(losses)
                    total = losses.float().sum()
                (total if scale is None else total * scale).backward()
            if part.counted:
                loss_sum += total.detach().double()
        return loss_sum

    def _divisors(self, every: StepRows) -> dict[str, int]:
        """What each route's summed gradient is divided by: its examples at this step, or under
        data.packing its tokens (per-token normalisation), both from the schedule alone."""
        if self.packed is None:
            return every.route_counts()
        tokens = {route: int(self.packed.tokens(route, rows).sum()) for route, rows in every.rows.items()}
        return {route: count for route, count in tokens.items() if count}  # a 0-token window adds nothing

    def _stand_in(self) -> pa.Table:
        """What runs in place of a slot or micro-batch with no rows: the first training row (or
        packed window) of the first route holding a corpus the run does not exclude — real data
        the trial's ``loss`` accepts, the same on every rank and step."""
        for layout in self.schedule.routes:
            offset = 0
            for corpus, count in layout.corpus_counts:
                if count and corpus not in self.spec.excluded_corpora:
                    return self.rows.take(Slot(layout.route, (offset,), (corpus,)))
                offset += count
        raise ConfigError("no training row outside the excluded corpora")  # the schedule refuses it first

    def _upcoming(self, step: int) -> list[Slot] | None:
        """This worker's slots at the next step (what the prefetcher collates meanwhile)."""
        if step + 1 >= self.spec.max_steps:
            return None
        return [
            mine for _, mine in rank_slots(self.schedule, step + 1, self.worker.rank, self.worker.world_size)
        ]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation metrics of the base model (adapters inactive) over each corpus's held-out
        rows — at most ``eval_rows`` of them, evenly spaced (``evaluation_rows``) — split across
        workers, in batches of the trial's batch size, and summed; also per corpus
        (``validation_loss/CORPUS``)."""
        self.model.eval()
        sums: dict[str, float] = {}
        for corpus in self.shards.manifest.holdout:
            run = self.rows.reader.holdout_files(corpus)
            chosen = evaluation_rows(run.rows, self.spec.eval_rows)
            mine = chosen[self.worker.rank :: self.worker.world_size]
            values: dict[str, list[torch.Tensor]] = {}
            for positions in self.parallel.evaluation_batches(chosen, self.trial.batch_size):
                # Under FSDP a rank out of rows still runs the forward (all-gathers): on the
                # stand-in row, its values dropped.
                rows = self.rows.reader.take_from(run, positions) if len(positions) else self._stand_in()
                with self.autocast():
                    batch = on_device(self.trial.collate(rows), self.device)
                    for name, per_example in self.trial.evaluate(self.model, batch).items():
                        if len(positions):
                            values.setdefault(name, []).append(per_example.double())
            for name, parts in values.items():
                total = float(torch.cat(parts).sum())
                sums[name] = sums.get(name, 0.0) + total
                sums[f"{name}/{corpus}"] = total
            sums["count"] = sums.get("count", 0.0) + len(mine)
            sums[f"count/{corpus}"] = float(len(mine))
        totals = all_reduce_sums(sums, self.worker)
        metrics = {}
        for key, value in totals.items():
            if key.startswith("count"):
                continue
            name, _, corpus = key.partition("/")
            count = totals[f"count/{corpus}"] if corpus else totals["count"]
            metrics[f"validation_{key}"] = value / count if count else float("nan")
        return metrics

    def memorization(self) -> MemorizationReport:
        """This validation's memorization measures (``probe.MemorizationProbe``), scored by the
        policy's thresholds (or the defaults)."""
        thresholds = self.spec.policy.memorization or MemorizationThresholds()
        report = memorization_report(self.probe.measure(), thresholds)
        if self.exported is not None:
            self.exported.record_memorization(report)
        return report

    # -- what decisions change ---------------------------------------------------------------------

    def scheduled(self, events: list[ScheduleEvent]) -> ScheduleSpec:
        """The run's schedule with these gate and rollback events."""
        return ScheduleSpec.from_manifest(
            self.shards.manifest,
            seed=derive_seed(self.spec.seed, self.spec.trial_seed, "schedule"),
            world_size=self.slots_per_step,
            batch_size=self.trial.batch_size,
            excluded_corpora=self.spec.excluded_corpora,
            events=events,
            windows=self.packed.layouts() if self.packed is not None else None,
        )

    def resume_slots(self, slots_per_step: int) -> None:
        """Continue a run whose schedule has ``slots_per_step`` slots per step (its world size
        when it started), whatever this world's size: each rank runs its share of them
        (``train.rounds``); the caller reschedules."""
        refuse_rounds(slots_per_step, self.worker.world_size, self.autocast.dtype is torch.float16)
        self.slots_per_step = slots_per_step

    def set_lr_scale(self, scale: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * scale

    def take_hyperparameters(self) -> None:
        """After a restore: optimizer state from the checkpoint, settings (lr, betas, decay) from
        this trial's hyperparameters — the same values on a plain resume, a PBT clone's mutated
        ones when it continues its donor."""
        fresh = self.trial.build_optimizer(self.trainable)
        for restored, configured in zip(self.optimizer.param_groups, fresh.param_groups, strict=True):
            for name, value in configured.items():
                if name != "params":
                    restored[name] = value
            restored["initial_lr"] = configured["lr"]

    def clean_state(self, steps_done: int) -> CleanState:
        """This step's clean state (a rollback target), as the twin keeps it."""
        return self.parallel.clean_state(self.model, self.optimizer, self.ledger.to_json(), steps_done)

    def load_clean_state(self, clean: CleanState) -> None:
        """Weights, adapters, optimizer state and ledger of a clean state; the LR settings become
        those in force now (``take_hyperparameters``; the caller reapplies its scale)."""
        self.model.load_state_dict(clean.weights, strict=True)
        self.load_optimizer_state(copy.deepcopy(clean.optimizer))
        self.ledger = Ledger.from_json(clean.ledger)
        self.take_hyperparameters()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load an optimizer state (``optimizer.state_dict()``, this rank's shards under FSDP)."""
        self.optimizer.load_state_dict(self.parallel.optimizer_state(self.optimizer, state))

    def load_weights(self, directory: Path, manifest: Manifest, adapters_present_only: bool = False) -> None:
        """Base and adapter weights of a (verified) checkpoint folder (``adapters_present_only``:
        those it has). Under FSDP a rank reads its own shard file; a checkpoint sharded otherwise,
        or not at all (a fork's source), is read whole and each rank keeps its part."""
        self.parallel.load_base(self.model, directory, manifest)
        for adapter in self.model.adapter_names():
            path = directory / f"adapter-{adapter}.safetensors"
            if path.is_file() or not adapters_present_only:
                load_adapter(self.model, adapter, path)
