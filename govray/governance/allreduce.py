"""The governance-aware allreduce: each parameter receives the masked per-example mean.

For parameter tensor p at a step, let S be the slots (one per worker) whose route may update p.
The applied gradient is the sum over S of per-example gradients divided by the number of examples
in S; slots outside S contribute exactly zero. Every worker knows S and its size from the
schedule, so nothing extra is communicated: before the (otherwise plain DDP) allreduce, each worker
overwrites the regions of the flat bucket its route may not update with zeros (selection, so a NaN
there cannot leak); after it, each region is divided by ``|S|`` in one fused pass that also flags
any non-finite value (what plain DDP spends on dividing by the world size).

A parameter with empty S gets ``grad = None``: no optimizer step, no momentum, no weight decay.
A non-finite value that survives masking came from an allowed slot, so every rank sees it after
the reduction: it raises its route group's flag on the device, and the next boundary
(``check_finite``: before any report, snapshot or checkpoint leaves the worker) stops every rank
with :class:`NonFiniteGradientError` naming the tensors and routes. No step waits on the device.

Example (inside a worker, around ``loss.backward()``)::

    governor = GradientGovernor(named_parameters, allowed_routes)
    ddp.register_comm_hook(governor, governed_allreduce_hook)
    governor.begin_step(step=t, local_route="public", route_counts={"public": 64, "licensed": 32})
    losses.sum().backward()
    governor.finish_step()           # grad None where S is empty; clip per route group
    governor.check_finite()          # at a boundary: raises on an allowed NaN since the last check
"""

# No ``from __future__ import annotations``: DDP checks the comm hook's annotations at runtime.
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from govray.core.errors import GovrayError


class NonFiniteGradientError(GovrayError):
    """A slot that may update a parameter produced a NaN or infinite gradient."""


@dataclass(frozen=True)
class _Region:
    index: int  # parameter index in the governor's order
    offset: int
    numel: int


_Ranges = tuple[tuple[int, int], ...]  # (offset, numel) of each region to zero, adjacent ones merged


@dataclass(frozen=True)
class _Layout:
    """A flat buffer's parameters (a DDP bucket, or one ``.grad`` without DDP), and the ranges
    each route (None: an empty slot) zeroes in it, computed on first use."""

    regions: tuple[_Region, ...]
    numel: int
    masks: dict[str | None, _Ranges] = field(default_factory=dict, compare=False, hash=False)


# Layouts kept (least recently used dropped first): DDP's buckets before and after its rebuild, of
# any model DDP can hold whole (an 8B fp32 model is ~1,300 buckets of 25 MB), and FSDP's one
# layout of whole tensors. Each keeps at most one range list per route, so the masks are bounded
# by layouts x routes.
LAYOUTS_KEPT = 4096


class GradientGovernor:
    """Per-step governance state shared by the DDP comm hook and the optimizer step.

    ``allowed_routes[i]`` is the set of routes that may update parameter ``i`` (in the order of
    ``named_parameters``). Parameters allowed the same routes form a *route group*; per step the
    governor keeps one example count per group (O(groups), whatever the number of tensors).
    Bucket layouts are cached by the bucket's parameters, not its index, because DDP rebuilds its
    buckets after the first iteration (at most ``LAYOUTS_KEPT``); each (layout, route) gets its
    masked ranges, merged where adjacent and zeroed in one fused op (never a bucket-sized mask).
    The divisors of a step (1/count per route group, fp32) are one device tensor made in
    :meth:`begin_step`, which the hook slices: no host-to-device copy inside the reduction.

    Nothing here reads a device value on the host during a step: the non-finite flags (one per
    route group) stay on the device until :meth:`check_finite`, which the loop calls at report
    and checkpoint boundaries, before anything leaves the worker.
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, nn.Parameter]],
        allowed_routes: Sequence[frozenset[str]],
    ) -> None:
        if len(named_parameters) != len(allowed_routes):
            raise ValueError("one allowed-route set per parameter")
        self.names = [name for name, _ in named_parameters]
        self.parameters = [parameter for _, parameter in named_parameters]
        self.allowed_routes = list(allowed_routes)
        self._index = {id(parameter): index for index, parameter in enumerate(self.parameters)}
        groups = sorted(set(self.allowed_routes), key=lambda routes: sorted(routes))
        self.groups: list[frozenset[str]] = groups
        self._group_of = [groups.index(routes) for routes in self.allowed_routes]
        self._members: list[list[nn.Parameter]] = [[] for _ in groups]
        for parameter, group in zip(self.parameters, self._group_of, strict=True):
            self._members[group].append(parameter)
        self._group_sizes = [sum(parameter.numel() for parameter in members) for members in self._members]
        self._total_size = sum(self._group_sizes)
        self._layouts: OrderedDict[tuple[int, ...], _Layout] = OrderedDict()  # bounded: LAYOUTS_KEPT
        self.step = -1
        self.local_route: str | None = None
        self.group_counts: list[int] = [0] * len(groups)
        self.loss_scale: float | None = None  # fp16: this worker's slot's loss scale
        self._overflow: dict[torch.device, torch.Tensor] = {}  # fp16: this worker's own overflow
        self._found: dict[torch.device, torch.Tensor] = {}  # device → one flag per route group
        self._first: dict[torch.device, torch.Tensor] = {}  # device → first flagged step per group
        self._inverses = torch.zeros(len(groups))  # this step's 1/count per route group (fp32)
        self._device_inverses: dict[torch.device, torch.Tensor] = {}  # this step's, on each device

    # -- per step --------------------------------------------------------------------------

    def begin_step(
        self,
        step: int,
        local_route: str | None,
        route_counts: Mapping[str, int],
        loss_scale: float | None = None,
    ) -> None:
        """Set this worker's route (None for an empty slot) and every route's example count;
        under fp16, the loss scale this worker's slot was multiplied by (its contribution is
        unscaled and checked for overflow before the sum)."""
        self.step = step
        self.begin_round(local_route, loss_scale)
        self.group_counts = [sum(route_counts.get(route, 0) for route in group) for group in self.groups]
        # 1/count as the Python float rounded to fp32 (the value the fused unscale multiplies by),
        # sent to the gradients' device once per step: from pinned memory without waiting on a GPU.
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self._inverses = torch.tensor(
            [1.0 / count if count else 0.0 for count in self.group_counts],
            dtype=torch.float32,
            pin_memory=device.type == "cuda",
        )
        self._device_inverses = {}
        self._inverse_of(0, device)

    def begin_round(self, local_route: str | None, loss_scale: float | None = None) -> None:
        """This worker's next slot of the step (a world smaller than the step's slots runs
        several: ``data.slots.rank_slots``): its route and loss scale; the divisors stay the step's."""
        self.local_route = local_route
        self.loss_scale = loss_scale

    def count(self, index: int) -> int:
        """Examples of this step whose gradients may reach parameter ``index`` (its divisor)."""
        return self.group_counts[self._group_of[index]]

    def masked_fraction(self) -> float:
        """The fraction of trainable parameter elements that no slot of this step may update
        (they get no update at all)."""
        sizes = zip(self._group_sizes, self.group_counts, strict=True)
        masked = sum(size for size, count in sizes if not count)
        return masked / self._total_size if self._total_size else 0.0

    def contributes(self, index: int) -> bool:
        """Whether this worker's slot may update parameter ``index`` at this step."""
        return self.local_route is not None and self.local_route in self.allowed_routes[index]

    def mask(self, tensor: torch.Tensor, layout: _Layout) -> None:
        """Overwrite with zeros the regions this worker may not update (selection: a NaN or inf
        there is replaced, never multiplied): the layout's ranges for this route (adjacent masked
        regions merged), zeroed in one fused op over narrowed views of ``tensor`` — no mask
        tensor, whatever the device."""
        ranges = layout.masks.get(self.local_route)
        if ranges is None:
            ranges = layout.masks[self.local_route] = self._masked_ranges(layout)
        if ranges:
            torch._foreach_zero_([tensor.narrow(0, offset, length) for offset, length in ranges])
        if self.loss_scale is not None:
            self._unscale_own([tensor])

    def _masked_ranges(self, layout: _Layout) -> _Ranges:
        ranges: list[list[int]] = []
        for region in layout.regions:
            if self.contributes(region.index):
                continue
            if ranges and ranges[-1][0] + ranges[-1][1] == region.offset:
                ranges[-1][1] += region.numel
            else:
                ranges.append([region.offset, region.numel])
        return tuple((offset, length) for offset, length in ranges)

    def _unscale_own(self, tensors: list[torch.Tensor]) -> None:
        """fp16: divide this worker's own contribution by its route's loss scale; on an overflow
        there, raise its flag and zero the contribution (its route's tensors skip the step, and
        no inf reaches another rank's sum)."""
        assert self.loss_scale is not None
        device = tensors[0].device
        overflow = self._overflow.get(device)
        if overflow is None:
            overflow = self._overflow[device] = torch.zeros(1, device=device)
        inverse = torch.full((1,), 1.0 / self.loss_scale, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, overflow, inverse)
        overflowed = overflow > 0
        for tensor in tensors:
            tensor.masked_fill_(overflowed, 0.0)

    def overflowed_routes(self, routes: Sequence[str], distributed: bool) -> frozenset[str]:
        """fp16, after backward: the routes whose slot overflowed on any rank (one small
        all-reduce, then one host read: the skip is decided on the host, as torch's GradScaler
        does with a non-fused optimizer)."""
        device = next(iter(self._overflow), self.parameters[0].device)
        flags = torch.zeros(len(routes), device=device)
        if self.local_route is not None:
            for overflow in self._overflow.values():
                flags[routes.index(self.local_route)] += overflow.to(device).squeeze(0)
        if distributed:
            dist.all_reduce(flags)
        for overflow in self._overflow.values():
            overflow.zero_()
        return frozenset(route for route, flag in zip(routes, flags.tolist(), strict=True) if flag)

    def average(self, tensor: torch.Tensor, layout: _Layout) -> None:
        """Divide each summed region by its example count, raising the region's route-group flag
        on a non-finite value (one fused pass per count; no host sync)."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for region in layout.regions:
            group = self._group_of[region.index]
            if self.group_counts[group]:  # count 0: every worker zeroed it, and its grad becomes None
                by_group.setdefault(group, []).append(tensor.narrow(0, region.offset, region.numel))
        found = self.flags(tensor.device)
        for group, views in by_group.items():
            torch._amp_foreach_non_finite_check_and_unscale_(
                views, found[group : group + 1], self._inverse_of(group, tensor.device)
            )

    def flags(self, device: torch.device) -> torch.Tensor:
        """The non-finite flag of each route group on ``device`` (raised, never cleared, until
        :meth:`check_finite`)."""
        found = self._found.get(device)
        if found is None:
            found = self._found[device] = torch.zeros(len(self.groups), device=device)
            self._first[device] = torch.full((len(self.groups),), -1, dtype=torch.int64, device=device)
        return found

    def _inverse_of(self, group: int, device: torch.device) -> torch.Tensor:
        """This step's ``[1/count]`` of route ``group`` on ``device``: a slice of the step's
        divisors, copied there once per step (in :meth:`begin_step` for the parameters' device)."""
        inverses = self._device_inverses.get(device)
        if inverses is None:
            inverses = self._device_inverses[device] = self._inverses.to(device, non_blocking=True)
        return inverses[group : group + 1]

    def layout(self, parameters: Sequence[torch.Tensor]) -> _Layout:
        key = tuple(id(parameter) for parameter in parameters)
        cached = self._layouts.get(key)
        if cached is None:
            offset, regions = 0, []
            for parameter in parameters:
                regions.append(_Region(self._index[id(parameter)], offset, parameter.numel()))
                offset += parameter.numel()
            cached = self._layouts[key] = _Layout(tuple(regions), offset)
            if len(self._layouts) > LAYOUTS_KEPT:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return cached

    def reduce_whole(self, parameters: Sequence[nn.Parameter]) -> None:
        """After backward, outside DDP's and FSDP's reducers (adapters): these tensors' gradients
        (zeros where none) in one flat buffer, masked, summed over every rank and divided by the
        counts as the comm hook does; each ``.grad`` becomes a view of the result."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        layout = self.layout(parameters)
        self.mask(flat, layout)  # this rank's forbidden regions zero-filled
        dist.all_reduce(flat)
        self.average(flat, layout)  # divided by the counts, flags raised
        for parameter, view in zip(parameters, flat.split([p.numel() for p in parameters]), strict=True):
            parameter.grad = view.view_as(parameter)

    def govern_local(self) -> None:
        """The same masks and averaging without DDP (one worker), on each ``.grad``."""
        by_group: dict[int, list[torch.Tensor]] = {}
        own = [
            parameter.grad
            for index, parameter in enumerate(self.parameters)
            if parameter.grad is not None and self.contributes(index)
        ]
        if self.loss_scale is not None and own:
            self._unscale_own(own)
        for index, parameter in enumerate(self.parameters):
            if parameter.grad is None:
                continue
            if not self.contributes(index):
                parameter.grad.zero_()  # selection: fills, never multiplies
            group = self._group_of[index]
            if self.group_counts[group]:
                by_group.setdefault(group, []).append(parameter.grad)
        for group, grads in by_group.items():
            found = self.flags(grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found[group : group + 1], self._inverse_of(group, grads[0].device)
            )

    def finish_step(self, max_grad_norm: float | None = None, skip: frozenset[str] = frozenset()) -> None:
        """After backward (and the allreduce): drop grads nobody may apply, clip per group.

        A non-finite gradient is not looked for here (that would wait for the device every
        step): it raises its group's flag, and :meth:`check_finite` refuses it at the boundary.
        """
        for device, found in self._found.items():  # which step raised a group's flag first
            first = self._first[device]
            first.masked_fill_((found > 0) & (first < 0), self.step)
        clipped: list[int] = []
        for group, count in enumerate(self.group_counts):
            if count == 0 or skip & self.groups[group]:
                # No slot may update it (or, fp16, a route that may overflowed): no step, no
                # momentum, no decay.
                for parameter in self._members[group]:
                    parameter.grad = None
            elif max_grad_norm is not None:
                clipped.append(group)
        if clipped:
            assert max_grad_norm is not None
            self._clip_groups(clipped, max_grad_norm)

    def _clip_groups(self, groups: Sequence[int], max_grad_norm: float) -> None:
        """Each route group clipped on its own norm: one route's gradients never rescale
        another's. (clip_grad_norm_ computes on the device: no host sync.)"""
        for group in groups:
            grads = [parameter for parameter in self._members[group] if parameter.grad is not None]
            if grads:
                torch.nn.utils.clip_grad_norm_(grads, max_grad_norm, foreach=True)

    def check_finite(self) -> None:
        """At a boundary (report, checkpoint, snapshot): raise if any step since the last check
        had a non-finite gradient from a slot allowed to update it, naming the routes and the
        tensors it left non-finite. One device-to-host read of one flag per route group."""
        if not self._found:
            return
        stacked = torch.stack([first.cpu() for first in self._first.values()])
        earliest = torch.where(stacked < 0, torch.iinfo(torch.int64).max, stacked).amin(dim=0)
        raised, firsts = self._agree_on_flags(
            torch.stack([found.cpu() for found in self._found.values()]).amax(dim=0),
            torch.where(earliest == torch.iinfo(torch.int64).max, -1, earliest),
        )
        for device, found in self._found.items():
            found.zero_()
            self._first[device].fill_(-1)
        flagged = {
            group: int(first)
            for group, (flag, first) in enumerate(zip(raised.tolist(), firsts.tolist(), strict=True))
            if flag
        }
        if not flagged:
            return
        # A non-finite update spreads (the next forward pass sees it everywhere): name the route
        # groups it first appeared in, and the step it did.
        step = min(flagged.values())
        bad_groups = [group for group, first in flagged.items() if first == step]
        routes = sorted({route for group in bad_groups for route in self.groups[group]})
        members = [
            name for name, group in zip(self.names, self._group_of, strict=True) if group in bad_groups
        ]
        indices = [index for index, group in enumerate(self._group_of) if group in bad_groups]
        broken = [
            self.names[index] for index, bad in zip(indices, self._non_finite(indices), strict=True) if bad
        ]
        culprits = broken or members
        raise NonFiniteGradientError(
            f"step {step}: non-finite gradient in {', '.join(culprits[:5])}"
            f"{' …' if len(culprits) > 5 else ''} from a slot allowed to update it "
            f"(routes {', '.join(routes)}); found at the boundary after step {self.step}; training stopped"
        )

    def _agree_on_flags(
        self, raised: torch.Tensor, firsts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The flags (one per route group) and first flagged steps (-1: none) every rank acts
        on. After an allreduce every rank saw the same sums: its own."""
        return raised, firsts

    def _non_finite(self, indices: Sequence[int]) -> list[bool]:
        """Whether each of these parameters holds a non-finite value now."""
        return [not bool(torch.isfinite(self.parameters[index].detach()).all()) for index in indices]


def governed_allreduce_hook(
    governor: GradientGovernor, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: mask this worker's bucket, sum it over all workers, divide by the counts."""
    buffer = bucket.buffer()
    layout = governor.layout(bucket.parameters())
    governor.mask(buffer, layout)
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None

    def reduced(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        result = future.value()[0]
        governor.average(result, layout)
        return result

    return work.get_future().then(reduced)


def parameters_by_name(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, parameter) for name, parameter in module.named_parameters() if parameter.requires_grad]
