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
the reduction and stops with :class:`NonFiniteGradientError`.

Example (inside a worker, around ``loss.backward()``)::

    governor = GradientGovernor(named_parameters, allowed_routes)
    ddp.register_comm_hook(governor, governed_allreduce_hook)
    governor.begin_step(step=t, local_route="public", route_counts={"public": 64, "licensed": 32})
    losses.sum().backward()
    governor.finish_step()           # grad None where S is empty; raises on an allowed NaN
"""

# No ``from __future__ import annotations``: DDP checks the comm hook's annotations at runtime.
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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


class GradientGovernor:
    """Per-step governance state shared by the DDP comm hook and the optimizer step.

    ``allowed_routes[i]`` is the set of routes that may update parameter ``i`` (in the order of
    ``named_parameters``). Bucket layouts are cached by the bucket's parameters, not its index,
    because DDP rebuilds its buckets after the first iteration.
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
        self._sizes = [parameter.numel() for parameter in self.parameters]
        self._total_size = sum(self._sizes)
        self._layouts: dict[tuple[int, ...], tuple[_Region, ...]] = {}
        groups = sorted(set(self.allowed_routes), key=lambda routes: sorted(routes))
        self.groups: list[frozenset[str]] = groups
        self._group_of = [groups.index(routes) for routes in self.allowed_routes]
        self.step = -1
        self.local_route: str | None = None
        self.counts: list[int] = [0] * len(self.parameters)
        self._found_nonfinite = torch.zeros(1)
        self._inverse: dict[int, torch.Tensor] = {}  # count → tensor([1 / count]), reused

    # -- per step --------------------------------------------------------------------------

    def begin_step(self, step: int, local_route: str | None, route_counts: Mapping[str, int]) -> None:
        """Set this worker's route (None for an empty slot) and every route's example count."""
        self.step = step
        self.local_route = local_route
        group_counts = [sum(route_counts.get(route, 0) for route in group) for group in self.groups]
        self.counts = [group_counts[group] for group in self._group_of]
        self._found_nonfinite.zero_()

    def masked_fraction(self) -> float:
        """The fraction of trainable parameter elements that no slot of this step may update
        (they get no update at all)."""
        masked = sum(size for size, count in zip(self._sizes, self.counts, strict=True) if count == 0)
        return masked / self._total_size if self._total_size else 0.0

    def contributes(self, index: int) -> bool:
        """Whether this worker's slot may update parameter ``index`` at this step."""
        return self.local_route is not None and self.local_route in self.allowed_routes[index]

    def mask(self, tensor: torch.Tensor, regions: Sequence[_Region]) -> None:
        """Overwrite with zeros the regions this worker may not update (selection: a NaN or inf
        there is replaced, never multiplied)."""
        for region in regions:
            if not self.contributes(region.index):
                tensor.narrow(0, region.offset, region.numel).zero_()

    def average(self, tensor: torch.Tensor, regions: Sequence[_Region]) -> None:
        """Divide each summed region by its example count, flagging non-finite values (one pass)."""
        by_count: dict[int, list[torch.Tensor]] = {}
        for region in regions:
            count = self.counts[region.index]
            if count:  # count 0: every worker zeroed it, and its grad becomes None
                by_count.setdefault(count, []).append(tensor.narrow(0, region.offset, region.numel))
        for count, views in by_count.items():
            inverse = self._inverse.get(count)
            if inverse is None:
                inverse = self._inverse[count] = torch.tensor([1.0 / count])
            torch._amp_foreach_non_finite_check_and_unscale_(views, self._found_nonfinite, inverse)

    def layout(self, parameters: Sequence[torch.Tensor]) -> tuple[_Region, ...]:
        key = tuple(id(parameter) for parameter in parameters)
        cached = self._layouts.get(key)
        if cached is None:
            offset, regions = 0, []
            for parameter in parameters:
                regions.append(_Region(self._index[id(parameter)], offset, parameter.numel()))
                offset += parameter.numel()
            cached = self._layouts[key] = tuple(regions)
        return cached

    def govern_local(self) -> None:
        """The same masks and averaging without DDP (one worker), on each ``.grad``."""
        for index, parameter in enumerate(self.parameters):
            if parameter.grad is None:
                continue
            regions = (_Region(index, 0, parameter.numel()),)
            flat = parameter.grad.view(-1)
            self.mask(flat, regions)
            self.average(flat, regions)

    def finish_step(self, max_grad_norm: float | None = None) -> None:
        """After backward (and the allreduce): drop grads nobody may apply, check, clip per group."""
        for index, parameter in enumerate(self.parameters):
            if self.counts[index] == 0:
                parameter.grad = None  # no slot may update it: no step, no momentum, no decay
        if bool(self._found_nonfinite.item()):
            self._raise_nonfinite()
        if max_grad_norm is not None:
            self.clip_per_group(max_grad_norm)

    def clip_per_group(self, max_norm: float) -> None:
        """Clip each route group (parameters updated by the same routes) on its own norm, so one
        route's gradients never rescale another's."""
        for group_index in range(len(self.groups)):
            members = [
                parameter
                for parameter, group in zip(self.parameters, self._group_of, strict=True)
                if group == group_index and parameter.grad is not None
            ]
            if members:
                torch.nn.utils.clip_grad_norm_(members, max_norm, foreach=True)

    def _raise_nonfinite(self) -> None:
        culprits = [
            name
            for name, parameter in zip(self.names, self.parameters, strict=True)
            if parameter.grad is not None and not bool(torch.isfinite(parameter.grad).all())
        ]
        routes = sorted(
            {
                route
                for index, name in enumerate(self.names)
                if name in culprits
                for route in self.allowed_routes[index]
            }
        )
        raise NonFiniteGradientError(
            f"step {self.step}: non-finite gradient in {', '.join(culprits[:5]) or 'a bucket'}"
            f"{' …' if len(culprits) > 5 else ''} from a slot allowed to update it "
            f"(routes {', '.join(routes)}); training stopped"
        )


def governed_allreduce_hook(
    governor: GradientGovernor, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: mask this worker's bucket, sum it over all workers, divide by the counts."""
    buffer = bucket.buffer()
    regions = governor.layout(bucket.parameters())
    governor.mask(buffer, regions)
    work = dist.all_reduce(buffer, async_op=True)
    assert work is not None

    def reduced(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        result = future.value()[0]
        governor.average(result, regions)
        return result

    return work.get_future().then(reduced)


def parameters_by_name(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, parameter) for name, parameter in module.named_parameters() if parameter.requires_grad]
