"""Routing tables the tests share: a three-layer stack's table, and the routes that reach a tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from govray.governance.policy import DepthPolicy
from govray.governance.routing import RoutingTable, resolve_routes
from govray.train.step.governed import GovernedStep


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2 = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(self.l0(x)))


def routing(**routes: Any) -> RoutingTable:
    policy = DepthPolicy.model_validate(
        {
            "name": "p",
            "version": 1,
            "adapters": {"a": {"targets": ["l1"]}},
            "rules": [{"name": name, "route": route} for name, route in routes.items()],
        }
    )
    return resolve_routes(policy, Stack())


TABLE = routing(public="all", licensed={"depth": {"min": -1}}, pii={"adapter": "a"})


def routes_updating(governed: GovernedStep, tensor: str) -> set[str]:
    """The routes whose rows reach ``tensor``: an adapter's route, or those the table allows."""
    if tensor.startswith("adapter/"):
        adapter = tensor.split("/")[1]
        return {route for route, name in governed.routing.adapter_names.items() if name == adapter}
    return set(governed.routing.routes_updating(tensor))
