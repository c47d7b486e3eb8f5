"""Governed FSDP2 (``resources.strategy: fsdp``): the model sharded across the workers, every
promise of the governed allreduce kept.

Each rank holds 1/N of every base tensor, of its gradient and of its optimizer state (FSDP2's
``fully_shard`` per layer unit, then the root). One step, as :class:`ShardedGovernor` runs it:

- forward and backward as FSDP2 runs them (an all-gather per unit before its forward, a
  reduce-scatter per unit after its backward) — after **every** micro-batch under gradient
  accumulation, never ``set_requires_gradient_sync(False)``: FSDP2 adds each reduce-scattered
  sum into the sharded ``.grad`` (in fp32, the parameters' dtype, under bf16 mixed precision
  too), so no rank keeps an unsharded gradient of the model between micro-batches;
- **before** a unit's reduce-scatter, each rank zero-fills (selection, never a product) the
  gradient of every tensor its slot's route may not update: a hook on FSDP's unsharded
  parameter, run when autograd has accumulated its gradient;
- the reduce-scatter sums (divide factor 1, sum reduction); after the slot's last micro-batch
  each rank divides its shard of a tensor by that tensor's example count from the schedule,
  raising the route group's flag on a non-finite value (no host sync);
- clipping is per route group, from one all-reduce of the groups' squared norms;
- tensors no slot may update get ``grad = None`` (no step, no momentum, no decay);
- at a boundary the non-finite flags are all-reduced, so every rank stops at the same step
  naming the same tensors.

Adapters are not sharded: an adapter runs only on its route's slots, so a unit of its own would
enter its all-gather and reduce-scatter on some ranks only, in a different order on each. They
are kept whole on every rank (FSDP's ``ignored_params``, their own optimizer parameter group) and
reduced after backward in one flat buffer, masked and averaged exactly as DDP's comm hook does.
An adapter is small (rank times width per target).

Under ``precision: bf16`` FSDP2's ``MixedPrecisionPolicy`` computes in bf16 and reduces in fp32;
parameters and optimizer state stay fp32.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from govray.config.training import Precision
from govray.core.storage import as_created
from govray.governance.adapters import GovernedModel
from govray.governance.allreduce import GradientGovernor
from govray.train.checkpoints.files import CheckpointError, shard_file, split_optimizer_state

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

_NONE = torch.iinfo(torch.int64).max  # "no flagged step" while all-reducing the first flagged steps


def layer_units(base: nn.Module, names: Sequence[str] | None) -> list[nn.Module]:
    """The modules FSDP shards as units, in order: the named ones (default: the model's top-level
    children), frozen ones too (a LoRA run's base blocks: one block gathered at a time, never the
    whole base in the root unit), leaving to the root unit a module whose tensors another unit
    shares (tied embedding and head: FSDP2 needs a shared tensor in one unit) and any name that
    is not a module."""
    chosen = list(names) if names is not None else [name for name, _ in base.named_children()]
    modules: list[nn.Module] = []
    for name in chosen:
        try:
            module = base.get_submodule(name)
        except AttributeError:
            continue  # a tensor, not a module: it stays in the root unit
        if module is not base and next(module.parameters(), None) is not None:
            modules.append(module)
    owners: dict[int, list[int]] = {}
    for position, module in enumerate(modules):
        for parameter in module.parameters():
            owners.setdefault(id(parameter), []).append(position)
    shared = {position for places in owners.values() if len(places) > 1 for position in places}
    return [module for position, module in enumerate(modules) if position not in shared]


def shard_model(
    model: GovernedModel,
    units: Sequence[nn.Module],
    precision: Precision,
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> None:
    """``fully_shard`` each unit, then the root, with adapter tensors left whole; gradients are
    summed by the reduce-scatter (the governor divides by the counts). ``mesh``: every rank in
    one shard group (default), or HSDP's 2-D mesh (``train.hybrid``), whose all-reduce across
    the groups sums too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == Precision.BF16
        else MixedPrecisionPolicy()
    )
    ignored = {
        parameter for adapter in model.adapter_names() for parameter in model.adapter_parameters(adapter)
    }
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
        unit.register_forward_pre_hook(_backward_through, prepend=True, with_kwargs=True)  # before FSDP's
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _backward_through(
    _unit: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Make a unit's input (its first argument, or ``hidden_states``) require a gradient, so that
    every rank's backward runs through every unit (and all-gathers it) whichever adapter its
    route has active: under LoRA a frozen block's backward runs only on the ranks whose adapter
    is at or below it, and a unit all-gathered in backward on some ranks only hangs the others.
    (The cost: the activations' gradients of the frozen blocks below a rank's adapter.)"""
    first = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(first, torch.Tensor) or not torch.is_grad_enabled():
        return None
    if first.is_floating_point() and not first.requires_grad:
        first.requires_grad_(True)
    return None


def is_sharded(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is an FSDP shard (a DTensor). A process that never sharded anything has
    not imported ``torch.distributed.tensor`` (about a second per worker), so nothing is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def optimizer_groups(parameters: Sequence[nn.Parameter]) -> list[nn.Parameter] | list[dict[str, Any]]:
    """The optimizer's parameters: as they are; under FSDP the sharded tensors and the whole
    (adapter) tensors in their own parameter groups (foreach kernels take one kind at a time)."""
    sharded = [p for p in parameters if is_sharded(p)]
    whole: list[nn.Parameter] = [p for p in parameters if not is_sharded(p)]
    if not sharded or not whole:
        return list(parameters)
    groups: list[dict[str, Any]] = [{"params": sharded}, {"params": whole}]
    return groups


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a view: writing it writes the shard); a whole
    tensor as it is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


class ShardedGovernor(GradientGovernor):
    """The governed allreduce's semantics under FSDP2 (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        named_parameters: Sequence[tuple[str, nn.Parameter]],
        allowed_routes: Sequence[frozenset[str]],
        device: torch.device,
    ) -> None:
        super().__init__(named_parameters, allowed_routes)
        self.rank = dist.get_rank()
        # Whether this rank's shards enter the clipping norm: under HSDP only the first replica
        # group's do (the other groups hold the same shards).
        self.counts_its_shards = True
        self._replicated = [
            index for index, parameter in enumerate(self.parameters) if not is_sharded(parameter)
        ]
        self.flags(device)  # every rank joins the boundary's all-reduce, stepped or not
        self._attach(model)

    def _attach(self, model: nn.Module) -> None:
        """Zero-fill hooks on FSDP's unsharded parameters, created by an unshard of each unit in
        turn (one unit whole at a time) and kept across steps: FSDP frees and refills their
        storage, never replaces them."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            module.unshard()
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for record in group.fsdp_params:
                    index = self._index.get(id(record.sharded_param))
                    if index is not None:  # (None: frozen, no gradient)
                        record._unsharded_param.register_post_accumulate_grad_hook(self._zero_fill(index))
            module.reshard()

    def _zero_fill(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(parameter: torch.Tensor) -> None:
            if parameter.grad is not None and not self.contributes(index):
                parameter.grad.zero_()  # selection: a NaN there is replaced, never multiplied

        return hook

    def govern_sharded(self) -> None:
        """After backward (the reduce-scatters done): reduce the whole (adapter) tensors in one
        flat buffer as DDP's hook does, and divide each rank's shards by their counts."""
        self.reduce_replicated()
        self.divide_shards()

    @property
    def replicated(self) -> list[nn.Parameter]:
        """The tensors every rank holds whole (adapters)."""
        return [self.parameters[index] for index in self._replicated]

    def reduce_replicated(self) -> None:
        """The whole (adapter) tensors masked by this slot's route, summed and averaged."""
        if self._replicated:
            self.reduce_whole(self.replicated)

    def divide_shards(self) -> None:
        """Each rank's shards (the reduce-scatters' sums of every slot of the step) divided by
        their counts, flagging a non-finite value."""
        by_key: dict[tuple[int, int], list[torch.Tensor]] = {}
        for index, parameter in enumerate(self.parameters):
            if parameter.grad is None or not is_sharded(parameter):
                continue
            group = self._group_of[index]
            count = self.group_counts[group]
            if count:
                by_key.setdefault((group, count), []).append(local(parameter.grad))
        for (group, _count), shards in by_key.items():
            found = self.flags(shards[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                shards, found[group : group + 1], self._inverse_of(group, shards[0].device)
            )

    def _clip_groups(self, groups: Sequence[int], max_grad_norm: float) -> None:
        """Per route group, from one all-reduce of every group's squared norm: a shard's square
        counted on its rank (one replica of it under HSDP), a whole tensor's on rank 0 only."""
        members = [
            [
                local(p.grad)
                for p in self._members[group]
                if p.grad is not None and (self.counts_its_shards if is_sharded(p) else self.rank == 0)
            ]
            for group in groups
        ]
        whole = [[local(p.grad) for p in self._members[group] if p.grad is not None] for group in groups]
        device = next((grads[0].device for grads in whole if grads), None)
        if device is None:
            return
        squares = torch.stack(
            [
                torch.stack([norm.float() for norm in torch._foreach_norm(grads)]).square().sum()
                if grads
                else torch.zeros((), device=device)
                for grads in members
            ]
        )
        dist.all_reduce(squares)
        coefficients = (max_grad_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
        for position, grads in enumerate(whole):
            if grads:
                torch._foreach_mul_(grads, coefficients[position])

    def _agree_on_flags(
        self, raised: torch.Tensor, firsts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each rank flagged its own shards: the flags (max) and first flagged steps (min) of all."""
        device = next(iter(self._found))  # NCCL reduces device tensors only
        raised = raised.to(device)
        firsts = torch.where(firsts < 0, torch.full_like(firsts, _NONE), firsts).to(device)
        dist.all_reduce(raised, op=dist.ReduceOp.MAX)
        dist.all_reduce(firsts, op=dist.ReduceOp.MIN)
        return raised.cpu(), torch.where(firsts == _NONE, torch.full_like(firsts, -1), firsts).cpu()

    def _non_finite(self, indices: Sequence[int]) -> list[bool]:
        flags = torch.tensor(
            [not bool(torch.isfinite(local(self.parameters[index].detach())).all()) for index in indices],
            dtype=torch.int64,
            device=next(iter(self._found)),
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [bool(flag) for flag in flags.tolist()]


# -- sharded checkpoints ---------------------------------------------------------------------------

SHARDS_KEY = "govray.shards"  # a shard file's metadata: name → [global shape, offset along dim 0]


def _file_tensors(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's part of each tensor, on the CPU, contiguous and storage-disjoint (safetensors
    refuses shared storage: a tied tensor is stored under each name), and where each shard lies."""
    tensors: dict[str, torch.Tensor] = {}
    placement: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        part = local(tensor).detach()
        if is_sharded(tensor):
            _, offset = _local_box(tensor)
            placement[name] = [list(tensor.shape), list(offset)]
        stored = part.cpu()
        if stored.untyped_storage().data_ptr() in seen or not stored.is_contiguous() or stored is part:
            stored = stored.clone(memory_format=torch.contiguous_format)
        seen.add(stored.untyped_storage().data_ptr())
        tensors[name] = stored
    return tensors, placement


def _local_box(tensor: DTensor) -> tuple[Sequence[int], Sequence[int]]:
    """Where this rank's shard of ``tensor`` lies in it: (shape, offset)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)


def local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each sharded tensor replaced by this rank's shard."""
    return {
        "state": {
            index: {
                name: local(value) if isinstance(value, torch.Tensor) else value
                for name, value in values.items()
            }
            for index, values in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def write_shards(
    directory: Path, model: GovernedModel, optimizer: torch.optim.Optimizer, rank: int, world_size: int
) -> list[str]:
    """Write this rank's shard files (base model, optimizer tensors); returns their names (the
    signer hashes them, and their block digests, when rank 0 seals the checkpoint)."""
    tensors, placement = _file_tensors(model.base_state())
    optimizer_tensors, _ = split_optimizer_state(local_optimizer_state(optimizer.state_dict()))
    optimizer_tensors = {name: tensor.cpu().contiguous() for name, tensor in optimizer_tensors.items()}
    written: list[str] = []
    for kind, contents, layout in (("model", tensors, placement), ("optimizer", optimizer_tensors, {})):
        name = shard_file(kind, rank, world_size)
        (directory / name).unlink(missing_ok=True)  # (a killed attempt's): never write through a link
        save_file(contents, str(directory / name), metadata={SHARDS_KEY: json.dumps(layout, sort_keys=True)})
        as_created(directory / name)  # (safetensors writes 0600)
        written.append(name)
    return written


def load_shards(model: GovernedModel, path: Path) -> None:
    """Load this rank's model shard file into the sharded model (every base tensor, by the user's
    names), refusing a file that does not fit, naming the tensor."""
    shards = load_file(str(path))
    copy_in(model, shards.keys(), path, lambda name, _target: shards[name])


def load_whole(model: GovernedModel, whole: Mapping[str, torch.Tensor], source: Path) -> None:
    """Load whole tensors (an unsharded checkpoint's base model, or a sharded one put together)
    into the sharded model: each rank copies its part."""

    def part(name: str, target: torch.Tensor) -> torch.Tensor:
        tensor = whole[name]
        if not is_sharded(target) or tuple(tensor.shape) != tuple(target.shape):
            return tensor  # (a shape that does not fit is refused by the caller)
        shape, offset = _local_box(target)
        return tensor[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]

    copy_in(model, whole.keys(), source, part)


def copy_in(
    model: GovernedModel,
    names: Iterable[str],
    source: Path,
    part: Callable[[str, torch.Tensor], torch.Tensor],
) -> None:
    """Copy ``part(name, tensor)`` into this rank's part of each base tensor; names or shapes that
    do not fit the model are refused, naming the tensors."""
    state = model.base_state()
    missing, unexpected = sorted(set(state) - set(names)), sorted(set(names) - set(state))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not fit this trial's model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, target in state.items():
            mine, value = local(target), part(name, target)
            if tuple(mine.shape) != tuple(value.shape):
                found, expected = tuple(value.shape), tuple(mine.shape)
                raise CheckpointError(f"{source}: {name} has shape {found}, this rank's part {expected}")
            mine.copy_(value)


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A rank's optimizer state as read from its shard file, its shards made sharded tensors
    again (laid out as their parameters), ready for ``optimizer.load_state_dict``."""
    from torch.distributed.tensor import DTensor

    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    restored: dict[int, dict[str, Any]] = {}
    for index, values in state["state"].items():
        parameter = parameters[int(index)]
        restored[index] = {
            name: DTensor.from_local(
                value.to(parameter.device),
                parameter.device_mesh,
                parameter.placements,
                run_check=False,
                shape=parameter.shape,
                stride=parameter.stride(),
            )
            if is_sharded(parameter)
            and isinstance(value, torch.Tensor)
            and value.shape == local(parameter).shape
            and value.dim() > 0
            else value
            for name, value in values.items()
        }
    return {"state": restored, "param_groups": state["param_groups"]}
