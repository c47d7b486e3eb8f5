"""The memory plan: one rank's peak memory for a run as configured, measured before it is queued.

One governed training step runs on fake tensors (shapes and dtypes, no storage) with a fake
process group of the run's world size, under torch's memory tracker, so an 8B model is planned
on a CPU in about 15 s of CPU time. The step is govray's: the trial's model built on the ``meta``
device, routes resolved on it (``resolve_routes``), adapters injected by ``GovernedModel``, the
governor's masks, divisors and per-route-group clipping (``GradientGovernor``), the trial's
optimizer. What the step assumes of the engine:

- every tensor no route may update is frozen (``requires_grad`` False) and kept in the compute
  dtype under bf16/fp16 (fp32 otherwise); trainable tensors, their gradients and optimizer state
  are fp32;
- base tensors a route may update are reduced by DDP (its buckets: a second fp32 copy of their
  gradients); adapters are reduced outside DDP in one flat fp32 buffer (no DDP at all when no
  base tensor is trainable); masks are ranges (no device bytes);
- blocks (the trial's layers that are items of an ``nn.ModuleList``) are checkpointed when asked;
  the LM loss is chunked (``LOSS_CHUNK`` positions at a time: fp32 logits never exist for the
  whole sequence);
- the step measured is the one of the route whose slot updates the most bytes, with the optimizer
  state of every trainable tensor already there (the state after each route has stepped once).

Two pieces are counted by hand, each in one function: DDP's buckets (:func:`ddp_buckets_by_hand`:
DDP cannot be built on fake tensors, it refuses tensors without storage; a stand-in of their size
is tracked) and the governance scalars the engine keeps on the device
(:func:`governance_buffers_by_hand`: named apart, a few kB).
Example::

    plan = plan_governed(trial, policy, PlanSetup(world_size=8, micro_batch=1, seq_len=4096))
    print(plan.total / 2**30)        # GiB per rank at its peak
    plan.at_peak.activations         # bytes of activations then; plan.largest.grads: most gradients
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.utils.checkpoint import checkpoint

from govray.config.training import Precision
from govray.core.errors import ConfigError, GovrayError
from govray.governance.adapters import GovernedModel
from govray.governance.allreduce import GradientGovernor
from govray.governance.policy import DepthPolicy
from govray.governance.routing import RoutingTable, resolve_routes
from govray.train.trial import Trial

LOSS_CHUNK = 1024  # positions whose fp32 logits exist at once in the chunked LM loss
ALLOCATION = 512  # the CUDA caching allocator's smallest block (bytes)
HALF = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


class MemoryPlanError(GovrayError):
    """A run does not fit the GPU memory it is planned for (names what and by how much)."""

    exit_code = 23


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory in a step: ``at_peak`` what holds it at its peak (``total``), and
    ``largest`` the most each kind holds at any time of the step (their sum exceeds the peak
    when, as usual, activations peak before gradients do)."""

    at_peak: MemoryBreakdown
    largest: MemoryBreakdown

    @property
    def total(self) -> int:
        return self.at_peak.total


@dataclass(frozen=True)
class PlanSetup:
    """What a rank's memory depends on besides the model and the policy."""

    world_size: int
    micro_batch: int  # rows per micro-batch (the slot's batch size / accumulation steps)
    seq_len: int  # tokens per row
    precision: Precision = Precision.FP32
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's memory at its peak, in bytes, by what holds it."""

    params: int  # parameters and module buffers
    grads: int
    optimizer: int  # its state (in ``largest``: as held before the step's temporaries)
    activations: int  # saved for backward, and temporaries
    governance: int  # masks, divisors, non-finite flags
    communication: int  # DDP buckets, the adapters' flat reduction buffer

    @property
    def total(self) -> int:
        return sum(getattr(self, field.name) for field in fields(self))

    def items(self) -> list[tuple[str, int]]:
        return [(field.name, getattr(self, field.name)) for field in fields(self)]


class _PeakTracker(MemTracker):
    """torch's ``MemTracker`` with two changes that an 8B plan needs: frozen parameters are
    tracked without a gradient hook (torch 2.13 registers one on every parameter, which a tensor
    without ``requires_grad`` refuses), and only the global peak is kept (torch updates every
    module's peak on every op: minutes instead of seconds for 32 blocks). ``largest`` keeps each
    kind's own maximum (summed over devices: there is one, the fake CPU)."""

    largest: dict[Any, int]

    def __init__(self) -> None:
        super().__init__()
        self.largest = {}

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        def grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        params = buffers = 0
        for parameter in module.parameters():
            infos = self._update_and_maybe_create_winfos(parameter, _MemRefType.PARAM)
            params += sum(info.mem_consumed for info in infos)
            if parameter.grad is not None:
                self._update_and_maybe_create_winfos(parameter.grad, _MemRefType.GRAD)
            hooked = self._param_to_grad_hook_handles.get(parameter) is not None
            if install_grad_hooks and parameter.requires_grad and not hooked:
                self._param_to_grad_hook_handles[parameter] = (
                    parameter.register_hook(grad_hook),
                    parameter.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)),
                )
        for buffer in module.buffers():
            infos = self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
            buffers += sum(info.mem_consumed for info in infos)
        return params, buffers

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        # torch refuses a module called again from the top level (it takes it for a second
        # iteration); a chunked loss's head and each micro-batch are such calls. Only the global
        # peak is kept: the module's call is tracked afresh.
        name = self._mod_tracker.get_known_fqn(module)
        if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) - {name} == {"Global"}:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            for kind, size in snapshot.items():
                self.largest[kind] = max(self.largest.get(kind, 0), size)
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks (this process is rank 0; collectives do
    nothing) for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("a memory plan needs its own (fake) process group: this process already has one")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def trainable_names(model: GovernedModel, table: RoutingTable) -> dict[str, frozenset[str]]:
    """Every tensor some route may update (module name in ``model``) → the routes that may."""
    ids: dict[int, frozenset[str]] = {
        id(parameter): frozenset(table.routes_updating(name))
        for name, parameter in model.base_named_parameters()
    }
    for route, adapter in table.adapter_names.items():
        for parameter in model.adapter_parameters(adapter):
            ids[id(parameter)] = frozenset({route})
    return {name: ids[id(p)] for name, p in model.named_parameters() if ids.get(id(p))}


def materialize_fake(model: nn.Module, trainable: set[str], frozen_dtype: torch.dtype) -> None:
    """Replace every ``meta`` tensor of ``model`` by a fake CPU tensor (call inside the fake mode):
    tensors in ``trainable`` fp32 with gradients, the others in ``frozen_dtype`` without."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, parameter in list(module._parameters.items()):
            if parameter is None or not parameter.is_meta:
                continue  # a tied tensor: replaced once, under its first name
            full = f"{prefix}.{name}" if prefix else name
            learn = full in trainable
            dtype = (
                torch.float32
                if learn
                else (frozen_dtype if parameter.is_floating_point() else parameter.dtype)
            )
            fake = nn.Parameter(torch.empty(parameter.shape, dtype=dtype), requires_grad=learn)
            for owner in model.modules():  # keep tied tensors tied
                for key, value in owner._parameters.items():
                    if value is parameter:
                        owner._parameters[key] = fake
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)


def checkpoint_blocks(model: nn.Module, layers: Sequence[str]) -> None:
    """Per-block activation checkpointing (non-reentrant): each of ``layers`` that is an item of
    an ``nn.ModuleList`` keeps only its input for backward and recomputes the rest."""
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.ModuleList):
            block = parent[int(child)]
            forward = block.forward

            def recomputed(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            block.forward = recomputed


def chunked_lm_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The summed next-token NLL of a transformers causal LM, its head and fp32 cross-entropy
    run ``LOSS_CHUNK`` positions at a time under checkpointing (no whole-sequence fp32 logits).

    A plain ``nn.Linear`` head runs as ``F.linear`` on its tensors (the tracker refuses a module
    called several times in one forward); a head wrapped by an adapter runs once, unchunked."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    hidden = model.get_decoder()(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    linear = type(head) is nn.Linear
    chunk = LOSS_CHUNK if linear else ids.shape[1]

    def chunk_loss(states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(states, head.weight, head.bias) if linear else head(states)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, ids.shape[1] - 1, chunk):
        end = min(start + chunk, ids.shape[1] - 1)
        total = total + checkpoint(
            chunk_loss, hidden[:, start:end], ids[:, start + 1 : end + 1], use_reentrant=False
        )
    return total


def ddp_buckets_by_hand(parameters: Sequence[nn.Parameter]) -> int:
    """Bytes of DDP's buckets (its reducer cannot be built on fake tensors): a flat copy of the
    gradient of every trainable tensor it reduces (``gradient_as_bucket_view`` off, as govray
    and torch default)."""
    return sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)


def governance_buffers_by_hand(route_groups: int) -> int:
    """Bytes on the device that govern a step, counted by hand so the plan names them: per route
    group a non-finite flag (fp32), the step it was first raised (int64) and its divisor's
    inverse (fp32), each its own allocator block. Masks are ranges: no device bytes. (The
    governor creates its own lazily inside the measured step, where the tracker also counts them
    among temporaries: a few hundred bytes each.)"""
    return 3 * route_groups * ALLOCATION


def measure_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], None],
    communication: Sequence[torch.Tensor],
    governance: int,
) -> MemoryPlan:
    """Run ``step`` (one training step on fake tensors) under the memory tracker, the optimizer
    state of every trainable tensor already there; ``communication`` are the reduction's persistent
    buffers (stand-ins allocated by the caller), ``governance`` the bytes counted by hand."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:  # steady state: every trainable tensor has its optimizer state
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracker = _PeakTracker()
    tracker.track_external(model, optimizer, *communication)
    # The optimizer's state, before the step: the tracker counts the step's temporaries as state too.
    state = sum(snapshot.get(_MemRefType.OPT, 0) for snapshot in tracker.get_tracker_snapshot().values())
    with tracker:
        step()
    peak: dict[Any, int] = {}
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        for kind, size in snapshot.items():
            peak[kind] = peak.get(kind, 0) + size
    largest = replace(_breakdown(tracker.largest, governance), optimizer=state)
    return MemoryPlan(_breakdown(peak, governance), largest)


def _breakdown(sizes: dict[Any, int], governance: int) -> MemoryBreakdown:
    return MemoryBreakdown(
        params=sizes.get(_MemRefType.PARAM, 0) + sizes.get(_MemRefType.BUFFER, 0),
        grads=sizes.get(_MemRefType.GRAD, 0),
        optimizer=sizes.get(_MemRefType.OPT, 0),
        activations=sizes.get(_MemRefType.ACT, 0) + sizes.get(_MemRefType.TEMP, 0),
        governance=governance,
        communication=sizes.get(_MemRefType.OTH, 0),
    )


def heaviest_route(routes: dict[str, frozenset[str]], sizes: dict[str, int]) -> str:
    """The route whose slot updates the most bytes (its step holds the most gradients)."""
    weight: dict[str, int] = {}
    for name, allowed in routes.items():
        for route in allowed:
            weight[route] = weight.get(route, 0) + sizes[name]
    return max(sorted(weight), key=lambda route: weight[route])


def governed_meta_model(
    trial: Trial, policy: DepthPolicy
) -> tuple[Any, list[str], RoutingTable, GovernedModel, dict[str, frozenset[str]], str]:
    """The trial's transformers causal LM built on meta and governed by ``policy``: (base, its
    layers, the routing table, the governed model, each trainable tensor's routes, the route
    that trains the most bytes: the one a plan measures)."""
    from govray.train.decoder import is_transformers_model

    base: Any = trial.build_meta_model()  # a transformers model (checked): its own methods
    if not is_transformers_model(base) or base.get_output_embeddings() is None:
        raise ConfigError(
            f"govray plan measures transformers causal LMs; trial {type(trial).__name__} builds "
            f"{type(base).__name__}"
        )
    layers = list(trial.layers(base) or [name for name, _ in base.named_children()])
    table = resolve_routes(policy, base, layers)
    model = GovernedModel(base, table, policy.adapters, seed=0)
    routes = trainable_names(model, table)
    sizes = {name: p.numel() * 4 for name, p in model.named_parameters() if name in routes}
    return base, layers, table, model, routes, heaviest_route(routes, sizes)


def plan_governed(
    trial: Trial, policy: DepthPolicy, setup: PlanSetup, frozen_dtype: torch.dtype | None = None
) -> MemoryPlan:
    """One rank's peak memory for a governed step of ``trial`` under ``policy`` (a transformers
    causal LM: its rows are ``setup.seq_len`` tokens). ``frozen_dtype``: the dtype of tensors no
    route may update (default: the compute dtype of ``setup.precision``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    base, layers, table, model, routes, route = governed_meta_model(trial, policy)
    adapter = table.adapter_names.get(route)
    frozen = frozen_dtype or HALF.get(setup.precision, torch.float32)
    with fake_world(setup.world_size), FakeTensorMode(allow_non_fake_inputs=True):
        materialize_fake(model, set(routes), frozen)
        if setup.activation_checkpointing:
            checkpoint_blocks(base, layers)
        named = [(name, p) for name, p in model.named_parameters() if name in routes]
        governor = GradientGovernor(named, [routes[name] for name, _ in named])
        adapter_ids = {id(p) for name in table.adapter_names.values() for p in model.adapter_parameters(name)}
        in_ddp = [p for _, p in named if id(p) not in adapter_ids]
        adapters = [p for _, p in named if id(p) in adapter_ids]
        distributed = setup.world_size > 1
        buckets = (
            [torch.empty(ddp_buckets_by_hand(in_ddp), dtype=torch.uint8)] if distributed and in_ddp else []
        )
        flat = torch.empty(sum(p.numel() for p in adapters)) if distributed and adapters else None
        optimizer = trial.build_optimizer([p for _, p in named])
        ids = torch.zeros(setup.micro_batch, setup.seq_len, dtype=torch.long)
        counts = {name: setup.micro_batch * setup.world_size for name in table.routes}

        def step() -> None:
            governor.begin_step(0, route, counts)
            with model.active(adapter):  # backward too: checkpointed blocks recompute with it
                with _autocast(setup.precision):
                    loss = chunked_lm_loss(base, ids)
                loss.backward()
            governor.govern_local()  # the masks and divisors the reduction applies, on each grad
            if flat is not None:
                _reduce_flat(flat, adapters)
            governor.finish_step(trial.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        communication = [*buckets, *([flat] if flat is not None else [])]
        return measure_step(
            model, optimizer, step, communication, governance_buffers_by_hand(len(governor.groups))
        )


def _reduce_flat(flat: torch.Tensor, parameters: Sequence[nn.Parameter]) -> None:
    """The adapters' reduction outside DDP: their gradients packed in one flat buffer, summed
    over the (fake) group, unpacked (an adapter without a gradient this step contributes zeros)."""
    offset = 0
    for parameter in parameters:
        part = flat.narrow(0, offset, parameter.numel())
        if parameter.grad is None:
            part.zero_()
        else:
            part.copy_(parameter.grad.flatten())
        offset += parameter.numel()
    dist.all_reduce(flat)
    offset = 0
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.copy_(flat.narrow(0, offset, parameter.numel()).view_as(parameter.grad))
        offset += parameter.numel()


def _autocast(precision: Precision) -> contextlib.AbstractContextManager[object]:
    dtype = HALF.get(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
