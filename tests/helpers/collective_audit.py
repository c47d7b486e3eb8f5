"""An audit of every ``torch.distributed`` collective a block of code calls, holding each to what
NCCL enforces: the run's process group (the default group) carries tensors on the run's device
only; host objects (object collectives, barriers, host tensors) go through a gloo side group.

On a CPU-only machine the run's device is the CPU and gloo accepts anything, so the audit is
configurable: declare ``device`` (e.g. ``meta`` for a ``Worker`` whose device is ``meta``) and a
CPU tensor handed to the run's group is refused, as NCCL refuses it on a GPU.

Example::

    with CollectiveAudit(worker.device) as audit:
        session.look_for_stop(4)
    assert audit.violations == []
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
HOST_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
)


@dataclass(frozen=True)
class Call:
    name: str
    group: str  # "run" (the default group) or "host" (a gloo side group)
    devices: tuple[str, ...]  # of its tensor arguments


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


class CollectiveAudit:
    """While entered: every collective called through ``torch.distributed`` (its own internal
    calls, e.g. an object collective's, are not counted twice) is recorded in ``calls``, and what
    NCCL would refuse (or what would carry host objects through the device) in ``violations``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.calls: list[Call] = []
        self.violations: list[str] = []
        self._inside = threading.local()
        self._saved: list[tuple[ModuleType, str, Callable[..., Any]]] = []

    def __enter__(self) -> CollectiveAudit:
        for name in (*TENSOR_COLLECTIVES, *HOST_COLLECTIVES):
            original: Callable[..., Any] = getattr(c10d, name)
            audited = self._audited(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, audited)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _audited(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def audited(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0):
                return original(*args, **kwargs)
            self._inside.depth = 1
            try:
                self._check(name, signature.bind(*args, **kwargs).arguments)
                return original(*args, **kwargs)
            finally:
                self._inside.depth = 0

        return audited

    def _check(self, name: str, arguments: dict[str, Any]) -> None:
        group = arguments.get("group")
        # Any group but the default one (FSDP's 1-D mesh is the default group) is a side group.
        world = dist.group.WORLD
        host = group is not None and world is not None and group.group_name != world.group_name
        if host and dist.get_backend(group) != "gloo":
            self.violations.append(f"{name}: a side group that is not gloo ({dist.get_backend(group)})")
        tensors = [tensor for value in arguments.values() for tensor in _tensors(value)]
        self.calls.append(Call(name, "host" if host else "run", tuple(str(t.device) for t in tensors)))
        if host:
            for tensor in tensors:
                if tensor.device.type != "cpu":
                    self.violations.append(f"{name} on the host group with a {tensor.device} tensor")
            return
        if name in HOST_COLLECTIVES:
            self.violations.append(f"{name} on the run's group: host objects belong on the host group")
        for tensor in tensors:
            if tensor.device != self.device:
                self.violations.append(
                    f"{name} on the run's group with a {tensor.device} {tensor.dtype} tensor "
                    f"{tuple(tensor.shape)} (the run's device is {self.device})"
                )
