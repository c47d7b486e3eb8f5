"""How a run's workers hold the model, as twins of one ``Parallelism``, chosen once.

``parallelism(strategy, worker)`` picks the twin from the experiment's ``resources.strategy`` and
the worker's world size; the governed step, the trial's checkpoints and the session ask it and
never test a flag (torchtitan's ``ParallelDims`` + ``parallelize`` idea):

- ``Single``: one worker, no process group: the governor masks and averages each ``.grad``.
- ``Replicated`` (DDP): the whole model on every rank. DDP reduces the trainable base tensors
  through the governed comm hook; adapters, kept out of DDP's reducer, are reduced after backward
  in one flat buffer; a LoRA-only run has no DDP at all (the flat reduction is its only collective).
- ``Sharded`` (FSDP2): each rank holds a shard of every base tensor (``train.sharding``) and
  reduce-scatters after every micro-batch (no ``no_sync``: an unsharded gradient of the model
  is never kept); its checkpoints are shard files written and verified by every rank, and its
  clean states live in checkpoints, not in memory.
- ``Hybrid`` (HSDP, ``train.hybrid``): ``Sharded`` within each shard group, the groups replicas
  of one another (a 2-D device mesh).

Each twin owns what differs: wrapping, ``no_sync``, the reduction after backward, optimizer
groups, clean states (rollback targets), weight and optimizer-state loading, and the checkpoint layout.
Precision has the same shape: ``Autocast`` and ``Fp16Scaling`` do nothing when off.

Example::

    parallel = parallelism(spec.strategy, worker)
    parallel.shard(model, units, precision)          # FSDP only: before the governor is made
    governor = parallel.governor(model, named, allowed)
    forward = parallel.wrap(model, governor)          # DDP where there is something to reduce
    with parallel.no_sync(forward): ...               # the first k-1 micro-batches (DDP)
    parallel.reduce()                                 # after the last backward (its own governor)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from govray.config.resources import ParallelStrategy
from govray.config.training import Precision
from govray.core.errors import ConfigError
from govray.core.storage import Storage
from govray.governance.adapters import GovernedModel
from govray.governance.allreduce import GradientGovernor, governed_allreduce_hook
from govray.train.checkpoints.files import (
    MODEL_FILE,
    CheckpointError,
    Manifest,
    checkpoint_sharding,
    model_file,
    shard_file,
    sharding_layout,
)
from govray.train.checkpoints.reshard import load_model_part
from govray.train.checkpoints.seed import SeedCheckpoint, initial_model
from govray.train.parallel.fsdp import (
    ShardedGovernor,
    layer_units,
    load_shards,
    load_whole,
    optimizer_groups,
    shard_model,
    sharded_optimizer_state,
)
from govray.train.parallel.hsdp import first_replica, hybrid_mesh, shard_group_size
from govray.train.parallel.layouts import CleanState, ShardedLayout, WholeLayout
from govray.train.parallel.worker import Worker, agreed
from govray.train.runspec import RunSpec
from govray.train.step.batches import micro_batches, row_batches
from govray.train.step.scaling import LossScaler
from govray.train.trial import Trial

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _on_host(value: Any, pinned: bool) -> Any:
    """A copy of ``value`` (a tensor, or a state dict's nesting of them) in host memory, pinned
    if asked (tensors copied with ``non_blocking``: the caller waits once)."""
    if isinstance(value, torch.Tensor):
        host = torch.empty_like(value, device="cpu", pin_memory=pinned and value.device.type == "cuda")
        return host.copy_(value.detach(), non_blocking=pinned)
    if isinstance(value, dict):
        return {key: _on_host(item, pinned) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_host(item, pinned) for item in value)
    return copy.deepcopy(value)


@functools.cache
def rank_local_buffers() -> dict[str, Any]:
    """The ``DistributedDataParallel`` keyword that keeps buffers rank-local in the forward (govray's
    routing refuses running statistics, so none is ever synced). torch 2.13, which govray pins, calls
    it ``forward_sync_buffers`` and deprecates ``broadcast_buffers``; older torch (a GPU image's own
    2.11, say) knows only ``broadcast_buffers``."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class Single:
    """One worker, no process group: nothing is wrapped, the governor governs each ``.grad``."""

    layout: ClassVar[WholeLayout] = WholeLayout()  # who writes a checkpoint, and what it holds
    # Every forward holds a collective (FSDP's all-gathers): every rank runs as many of them. Read
    # inside this package only: the step asks the questions below.
    collective_forward: ClassVar[bool] = False
    governing: GradientGovernor  # the governor this twin made (``governor``), which it reduces with

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.device = worker.device
        self.whole: list[nn.Parameter] = []  # reduced after backward in one flat buffer (adapters)

    def build_base(
        self, spec: RunSpec, trial: Trial, storage: Storage
    ) -> tuple[nn.Module, SeedCheckpoint | None]:
        """The trial's base model as this twin starts it: built whole on the CPU from the seeded
        generator (FSDP: see ``Sharded``), and no seed checkpoint."""
        return initial_model(spec, trial), None

    def layer_units(self, base: nn.Module, trial: Trial) -> list[nn.Module]:
        """The modules sharded as units (FSDP: the trial's ``fsdp_units``); none here."""
        return []

    def micro_batches(self, rows: pa.Table, parts: int) -> list[pa.Table]:
        """A slot's rows in ``parts`` micro-batches (at most: a short slot is fewer; FSDP: always
        ``parts``, empty ones last, as every forward is a collective)."""
        return micro_batches(rows, parts, exactly=self.collective_forward)

    def evaluation_batches(self, chosen: np.ndarray, size: int) -> list[np.ndarray]:
        """This rank's share of the evaluation positions ``chosen`` (every ``world``-th from its
        rank), in batches of ``size``: only those holding rows (a forward here holds no
        collective; FSDP: as many on every rank, empty ones last)."""
        rank, world = self.worker.rank, self.worker.world_size
        mine = chosen[rank::world]
        if not self.collective_forward:
            return [batch for batch in row_batches(mine, size) if len(batch)]
        forwards = max(1, -(-len(chosen[::world]) // size))
        return row_batches(mine, size, forwards)

    @property
    def probe_split(self) -> bool:
        """Whether the memorization probe splits its rows over the ranks (not when every forward
        is a collective: every rank runs the same forwards and rank 0's values count)."""
        return not self.collective_forward

    def autocast_dtype(self, precision: Precision) -> torch.dtype | None:
        """What the step's forward and backward autocast to (None: fp32)."""
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(precision)

    def shard(self, model: GovernedModel, units: Sequence[nn.Module], precision: Precision) -> None:
        """Shard the model across the workers (FSDP only)."""

    def governor(
        self,
        model: GovernedModel,
        named: Sequence[tuple[str, nn.Parameter]],
        allowed: Sequence[frozenset[str]],
    ) -> GradientGovernor:
        self.whole = [p for a in model.adapter_names() for p in model.adapter_parameters(a)]
        self.governing = GradientGovernor(named, allowed)
        return self.governing

    def wrap(self, model: GovernedModel, governor: GradientGovernor) -> nn.Module:
        """The module the trial's ``loss`` calls."""
        return model

    def no_sync(self, forward: nn.Module) -> contextlib.AbstractContextManager[object]:
        """Around the first k-1 micro-batches of a slot: gradients accumulate locally (DDP only;
        FSDP reduce-scatters every micro-batch into its sharded gradients)."""
        return contextlib.nullcontext()

    def reduce(self) -> None:
        """After the slot's last backward: every gradient masked, reduced and divided (by the
        governor this twin made: ``governor``)."""
        self.governing.govern_local()

    def reduce_round(self) -> list[nn.Parameter]:
        """A step where this rank runs several slots (``train.rounds``), after a slot's last
        backward: reduce what its route settles and return those tensors (their reduced
        gradients are set aside and summed over the rounds)."""
        self.reduce()
        return self.governing.parameters

    def end_rounds(self) -> None:
        """After the last round, the rounds' sums back in place: what is reduced once per step."""

    def optimizer_groups(self, parameters: Sequence[nn.Parameter]) -> list[Any]:
        return list(parameters)

    def clean_state(
        self, model: GovernedModel, optimizer: torch.optim.Optimizer, ledger: dict[str, Any], steps_done: int
    ) -> CleanState:
        """A clean state in host memory, not a second copy on the device: pinned on a GPU, the
        copies queued without waiting and waited for once (a clean state is taken at a boundary)."""
        pinned = self.device.type == "cuda"
        clean = CleanState(
            step=steps_done,
            weights={name: _on_host(tensor, pinned) for name, tensor in model.state_dict().items()},
            optimizer=_on_host(optimizer.state_dict(), pinned),
            ledger=ledger,
        )
        if pinned:
            torch.cuda.current_stream(self.device).synchronize()
        return clean

    def load_base(self, model: GovernedModel, directory: Path, manifest: Manifest) -> None:
        """The base weights of a verified checkpoint folder (``manifest``: its verified manifest,
        whose block digests a ranged read checks): its whole model, or a sharded checkpoint's
        shards put together."""
        world, group = checkpoint_sharding(directory)
        if world is not None:  # FSDP/HSDP -> DDP: every tensor whole, read by verified ranges
            self._load_part(model, directory, manifest, world, group)
            return
        whole = load_file(str(model_file(directory)))
        model.load_base_state({name: tensor.to(self.device) for name, tensor in whole.items()})

    def _load_part(
        self, model: GovernedModel, directory: Path, manifest: Manifest, world: int | None, group: int | None
    ) -> None:
        """This rank's part of the base tensors by verified ranges, every rank refusing if one
        read a tampered block (naming the file)."""
        agreed(
            lambda: load_model_part(model, directory, manifest, world, group), self.worker, CheckpointError
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state as read from a checkpoint, ready for ``load_state_dict``."""
        return state

    def sharding(self) -> dict[str, Any]:
        """What a checkpoint's state records of its layout (``CheckpointState.sharding``)."""
        return {}


class Replicated(Single):
    """DDP: the trainable base tensors reduced by DDP's governed comm hook, adapters after backward."""

    def wrap(self, model: GovernedModel, governor: GradientGovernor) -> nn.Module:
        """DDP over the trainable base tensors only. Adapters never enter DDP's reducer: an
        inactive one gets no gradient, which DDP could only allow with find_unused_parameters (a
        graph walk, an all-reduce and a host wait per step). Without trainable base tensors
        (LoRA only) there is no DDP: the flat reduction is the step's only collective."""
        if len(governor.parameters) == len(self.whole):
            return model
        adapter_ids = {id(parameter) for parameter in self.whole}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, p in model.named_parameters() if id(p) in adapter_ids]
        )
        ddp = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            **rank_local_buffers(),
        )
        ddp.register_comm_hook(governor, governed_allreduce_hook)
        return ddp

    def no_sync(self, forward: nn.Module) -> contextlib.AbstractContextManager[object]:
        if isinstance(forward, DistributedDataParallel):
            return forward.no_sync()
        return contextlib.nullcontext()

    def reduce(self) -> None:
        if self.whole:  # DDP's hook reduced the base tensors during backward
            self.governing.reduce_whole(self.whole)


class Sharded(Single):
    """FSDP2 (``train.sharding``): shards of every base tensor, adapters whole on every rank."""

    layout: ClassVar[WholeLayout] = ShardedLayout()
    collective_forward: ClassVar[bool] = True
    sharded: ShardedGovernor  # ``governing``, as the sharded governor it is

    def build_base(
        self, spec: RunSpec, trial: Trial, storage: Storage
    ) -> tuple[nn.Module, SeedCheckpoint | None]:
        """Rank 0 writes the seed checkpoint once; the model is built on meta where it can be, and
        each rank fills its own shards from the seed (``SeedCheckpoint.fill``)."""
        seed = SeedCheckpoint.agree(spec, self.worker, storage, trial)
        return seed.skeleton(), seed

    def layer_units(self, base: nn.Module, trial: Trial) -> list[nn.Module]:
        return layer_units(base, trial.fsdp_units(base))

    def autocast_dtype(self, precision: Precision) -> torch.dtype | None:
        return None  # bf16 is FSDP2's mixed precision (bf16 compute, fp32 reduction), not autocast

    def shard(self, model: GovernedModel, units: Sequence[nn.Module], precision: Precision) -> None:
        shard_model(model, units, precision, self.device)

    def governor(
        self,
        model: GovernedModel,
        named: Sequence[tuple[str, nn.Parameter]],
        allowed: Sequence[frozenset[str]],
    ) -> GradientGovernor:
        self.governing = self.sharded = ShardedGovernor(model, named, allowed, self.device)
        return self.sharded

    def reduce(self) -> None:
        self.sharded.govern_sharded()  # each rank divides its shards; adapters reduced whole

    def reduce_round(self) -> list[nn.Parameter]:
        """The adapters, reduced under this slot's route; the shards keep summing every round's
        reduce-scatters (each masked by its own round's route) until ``end_rounds``."""
        self.sharded.reduce_replicated()
        return self.sharded.replicated

    def end_rounds(self) -> None:
        self.sharded.divide_shards()  # once per step: by the step's counts

    def optimizer_groups(self, parameters: Sequence[nn.Parameter]) -> list[Any]:
        return optimizer_groups(parameters)

    def clean_state(
        self, model: GovernedModel, optimizer: torch.optim.Optimizer, ledger: dict[str, Any], steps_done: int
    ) -> CleanState:
        """No second copy in memory: the checkpoint of this step holds it."""
        return CleanState(steps_done, {}, {}, ledger, on_storage=True)

    def load_base(self, model: GovernedModel, directory: Path, manifest: Manifest) -> None:
        """A rank reads its own shard file; of a checkpoint sharded otherwise (another world
        size, other HSDP shard groups), or not at all (DDP, a fork's source), each rank reads
        only its rows, by verified ranges. (A base file referred to by digest, a frozen base, is
        read whole and each rank keeps its part.)"""
        (world, group), rank, ranks = checkpoint_sharding(directory), self.worker.rank, self.worker.world_size
        if (world, group) == sharding_layout(self.sharding()):
            load_shards(model, directory / shard_file("model", rank, ranks))
        elif world is not None or model_file(directory) == directory / MODEL_FILE:
            self._load_part(model, directory, manifest, world, group)
        else:
            load_whole(model, load_file(str(model_file(directory))), directory)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return sharded_optimizer_state(optimizer, state)

    def sharding(self) -> dict[str, Any]:
        return {"world_size": self.worker.world_size}


class Hybrid(Sharded):
    """HSDP (``train.hybrid``): FSDP2 within each shard group, the groups replicas of one another;
    FSDP's governor, its clipping norm counting one replica of each shard."""

    def __init__(self, worker: Worker, shard_group: int | None) -> None:
        super().__init__(worker)
        self.configured = shard_group  # None: the workers per node, settled when sharding
        self.mesh: DeviceMesh | None = None  # (replicas, shard_group), made by ``shard``

    def shard(self, model: GovernedModel, units: Sequence[nn.Module], precision: Precision) -> None:
        self.mesh = hybrid_mesh(self.worker, shard_group_size(self.configured, self.worker))
        shard_model(model, units, precision, self.device, self.mesh)

    def governor(
        self,
        model: GovernedModel,
        named: Sequence[tuple[str, nn.Parameter]],
        allowed: Sequence[frozenset[str]],
    ) -> GradientGovernor:
        assert self.mesh is not None, "sharded first"
        governor = super().governor(model, named, allowed)
        self.sharded.counts_its_shards = first_replica(self.mesh)
        return governor

    def sharding(self) -> dict[str, Any]:
        assert self.mesh is not None, "sharded first"
        return {"world_size": self.worker.world_size, "shard_group": self.mesh.size(1)}


def refuse_unplanned(strategy: ParallelStrategy, experiment: str) -> None:
    """``govray plan`` measures the step of strategy ddp (one worker's copy of the model) only."""
    if strategy != ParallelStrategy.DDP:
        raise ConfigError(f"{experiment}: govray plan measures strategy ddp runs (this one is {strategy})")


def parallelism(
    strategy: ParallelStrategy,
    worker: Worker,
    precision: Precision | None = None,
    shard_group: int | None = None,
) -> Single:
    """The twin for ``resources.strategy`` on ``worker``'s world (refusing what cannot run);
    ``shard_group``: ``resources.shard_group`` (strategy hsdp)."""
    if strategy in (ParallelStrategy.FSDP, ParallelStrategy.HSDP):
        if not worker.distributed:
            raise ConfigError(f"strategy {strategy} shards the model across workers: it needs workers >= 2")
        if precision == Precision.FP16:
            raise ConfigError(f"precision fp16 with strategy {strategy}: use bf16 (FSDP2's mixed precision)")
        return Sharded(worker) if strategy == ParallelStrategy.FSDP else Hybrid(worker, shard_group)
    return Replicated(worker) if worker.distributed else Single(worker)


class Autocast:
    """The step's autocast context: a no-op when the run computes in fp32."""

    def __init__(self, device: torch.device, dtype: torch.dtype | None) -> None:
        self.device_type, self.dtype = device.type, dtype

    def __call__(self) -> contextlib.AbstractContextManager[object]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


class NoScaling:
    """fp16's per-route loss scaling when the run is not fp16: every call does nothing."""

    scaler: LossScaler | None = None

    def scale(self, route: str | None) -> float | None:
        """The factor the slot's loss is multiplied by before backward (None: none)."""
        return None

    def skipped(
        self, steps_done: int, counts: Collection[str], governor: GradientGovernor, routes: Sequence[str]
    ) -> frozenset[str]:
        """After backward: the routes whose tensors skip this step."""
        return frozenset()


class Fp16Scaling(NoScaling):
    """fp16: each route's loss scale (``train.scaling.LossScaler``, the trial controller's, whose
    skips are recorded decisions); an overflow skips only its route's tensors."""

    def __init__(self, scaler: LossScaler, distributed: bool) -> None:
        self.scaler, self.distributed = scaler, distributed

    def scale(self, route: str | None) -> float | None:
        assert self.scaler is not None
        return self.scaler.scale(route)

    def skipped(
        self, steps_done: int, counts: Collection[str], governor: GradientGovernor, routes: Sequence[str]
    ) -> frozenset[str]:
        assert self.scaler is not None
        found = governor.overflowed_routes(routes, self.distributed)
        return self.scaler.settle(steps_done, counts, found)
