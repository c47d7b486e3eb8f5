"""Routing tables: masks follow the rules, tied parameters take the strictest route, refusals name
what matched nothing."""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from govray.cli.ledger_table import format_ledger
from govray.core.errors import RoutingError
from govray.governance.policy import DepthPolicy, LayerRoute
from govray.governance.routing import (
    OUTSIDE_LAYERS,
    adapter_of_tensor,
    default_layers,
    layer_label,
    resolve_routes,
)
from govray.provenance.predicates import coverage_matrix
from govray.train.step.ledger import Ledger, LedgerEntry


class Stack(nn.Module):
    """``depth`` Linear layers; optionally the first and last share one weight (tied)."""

    def __init__(self, depth: int, width: int = 3, tied: bool = False) -> None:
        super().__init__()
        for index in range(depth):
            self.add_module(f"l{index}", nn.Linear(width, width))
        if tied:
            self.get_submodule(f"l{depth - 1}").weight = self.get_submodule("l0").weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.children():
            x = module(x)
        return x


def policy(*routes: Any, default: Any = None) -> DepthPolicy:
    rules = [{"name": f"r{i}", "route": route} for i, route in enumerate(routes)]
    return DepthPolicy.model_validate({"name": "p", "version": 1, "rules": rules, "default": default})


def reference_mask(route: LayerRoute, names: list[str], depth: int) -> dict[str, bool]:
    """Independent statement of the rule: a name is selected if a glob matches it or its layer is
    in the (normalized, inclusive) range; a tensor needs all of its names selected."""
    layers = set()
    if route.depth is not None:
        low = route.depth.min % depth if route.depth.min is not None else 0
        high = route.depth.max % depth if route.depth.max is not None else depth - 1
        layers = set(range(low, high + 1))
    return {
        name: int(name[1:].split(".")[0]) in layers or any(fnmatch.fnmatchcase(name, g) for g in route.params)
        for name in names
    }


depth_ranges = st.integers(min_value=2, max_value=5).flatmap(
    lambda depth: st.tuples(
        st.just(depth),
        st.one_of(st.none(), st.integers(-depth, depth - 1)),
        st.one_of(st.none(), st.integers(-depth, depth - 1)),
        st.lists(
            st.sampled_from(["*.bias", "l0.*", f"l{depth - 1}.weight", "l1.bias"]), max_size=2, unique=True
        ),
    )
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth_ranges)
def test_layer_route_masks_match_the_rule(case: tuple[int, int | None, int | None, list[str]]) -> None:
    depth, low, high, globs = case
    model = Stack(depth)
    route_spec: dict[str, Any] = {"params": globs}
    if low is not None or high is not None:
        route_spec["depth"] = {"min": low, "max": high}
    if not globs and "depth" not in route_spec:
        route_spec["depth"] = {"min": 0}
    route = LayerRoute.model_validate(route_spec)
    names = [name for name, _ in model.named_parameters()]
    expected = reference_mask(route, names, depth)
    try:
        table = resolve_routes(policy("all", route_spec), model)
    except RoutingError as error:
        # Only legitimate refusals: an empty range, or nothing selected at all.
        assert "matches no layer" in str(error) or "may update no parameter" in str(error)
        assert not any(expected.values()) or (
            route.depth is not None
            and route.depth.min is not None
            and route.depth.max is not None
            and route.depth.min % depth > route.depth.max % depth
        )
        return
    assert {name: table.may_update("r1", name) for name in names} == expected
    assert all(table.may_update("r0", name) for name in names)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=3, max_value=5), st.integers(min_value=0, max_value=4))
def test_tied_parameters_take_the_strictest_route(depth: int, low: int) -> None:
    """l0.weight is also l{depth-1}.weight: a route may update it only if both layers are in it."""
    low = low % depth
    model = Stack(depth, tied=True)
    table = resolve_routes(policy({"depth": {"min": low}}), model)
    both_in = low == 0  # l0 must be in the range for the tied tensor to be updated
    assert table.may_update("r0", "l0.weight") is both_in
    assert table.may_update("r0", f"l{depth - 1}.weight") is both_in  # same tensor, either name
    assert table.may_update("r0", f"l{depth - 1}.bias") is True  # not tied
    glob_one_name = resolve_routes(policy({"params": [f"l{depth - 1}.*"]}), model)
    assert glob_one_name.may_update("r0", "l0.weight") is False


@settings(max_examples=60, deadline=None)
@given(st.permutations(["all", {"depth": {"min": -1}}, {"params": ["*.bias"]}]))
def test_route_keys_follow_rule_order(routes: list[Any]) -> None:
    table = resolve_routes(policy(*routes), Stack(3))
    assert table.routes == ("r0", "r1", "r2")
    for index, route in enumerate(routes):
        allowed = set(table.allowed(f"r{index}"))
        if route == "all":
            assert allowed == {name for name, _ in Stack(3).named_parameters()}
        elif "depth" in route:
            assert allowed == {"l2.weight", "l2.bias"}
        else:
            assert allowed == {"l0.bias", "l1.bias", "l2.bias"}


def test_default_layers_are_top_level_children_in_registration_order() -> None:
    assert default_layers(Stack(4)) == ("l0", "l1", "l2", "l3")


def test_declared_layers_override_the_default() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    table = resolve_routes(policy({"depth": {"min": 1, "max": 1}}), model, layers=["0.0", "0.1", "1"])
    assert table.allowed("r0") == ("0.1.weight", "0.1.bias")


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ({"params": ["encoder.*"]}, r"route 'r0': glob 'encoder.\*' matches no parameter"),
        ({"depth": {"min": 5}}, r"route 'r0': depth min 5 matches no layer; the model has 3 layers"),
        ({"depth": {"min": 2, "max": 1}}, r"route 'r0': depth range 2..1 matches no layer"),
    ],
)
def test_a_route_that_matches_nothing_is_an_error_naming_it(route: Any, message: str) -> None:
    with pytest.raises(RoutingError, match=message):
        resolve_routes(policy(route), Stack(3))


def test_adapter_route_updates_no_base_parameter_and_names_its_targets() -> None:
    spec = DepthPolicy.model_validate(
        {
            "name": "p",
            "version": 1,
            "adapters": {"a": {"targets": ["l1", "l2"]}},
            "rules": [{"name": "pii", "route": {"adapter": "a"}}],
        }
    )
    table = resolve_routes(spec, Stack(3))
    assert table.allowed("pii") == ()
    assert table.adapter_targets["pii"] == ("l1", "l2")
    assert table.masked_fraction("pii") == 1.0
    assert table.updated_tensors("pii") == (
        "adapter/a/l1.lora_A",
        "adapter/a/l1.lora_B",
        "adapter/a/l2.lora_A",
        "adapter/a/l2.lora_B",
    )
    bad = spec.model_copy(
        update={"adapters": {"a": spec.adapters["a"].model_copy(update={"targets": ("conv*",)})}}
    )
    no_target = r"adapter 'a' target 'conv\*' matches no Linear, Embedding or Conv1D module"
    with pytest.raises(RoutingError, match=no_target):
        resolve_routes(bad, Stack(3))


def test_a_tensor_is_named_by_one_rule_in_ledger_tables_and_attestations() -> None:
    """Its layer's name, ``adapter:NAME`` for an adapter's tensors, ``(outside layers)`` for a
    parameter in no declared layer: the same in the ledger table and the coverage attestation."""
    spec = DepthPolicy.model_validate(
        {
            "name": "p",
            "version": 1,
            "adapters": {"a": {"targets": ["l1"]}},
            "rules": [{"name": "all", "route": "all"}, {"name": "pii", "route": {"adapter": "a"}}],
        }
    )
    table = resolve_routes(spec, Stack(3), layers=["l0", "l1"])  # l2 lies outside them
    entry = LedgerEntry(examples=4, tokens=0, steps=1)
    tensors = [*table.allowed("all"), *table.updated_tensors("pii")]
    ledger = Ledger({("c", tensor): entry for tensor in tensors})
    names = ["l0", "l1", OUTSIDE_LAYERS, "adapter:a"]
    assert sorted(coverage_matrix(ledger, table)["c"]) == sorted(names)
    header = format_ledger(ledger, table).splitlines()[0]
    assert re.split(r" {2,}", header.strip()) == ["corpus", *names]
    assert (
        adapter_of_tensor(table.updated_tensors("pii")[0]) == "a" and adapter_of_tensor("l1.weight") is None
    )
    assert layer_label("l1") == "l1" and layer_label(None) == OUTSIDE_LAYERS == "(outside layers)"


def test_running_statistics_are_refused_under_a_restricting_policy() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(RoutingError, match=r"modules 1 keep running statistics \(BatchNorm\)"):
        resolve_routes(policy("all", {"depth": {"min": -1}}), model)
    # Every route updates everything: the buffers follow the same (unrestricted) data.
    assert resolve_routes(policy("all"), model).allowed("r0")
    # LayerNorm keeps no running statistics.
    transformer_like = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    assert resolve_routes(policy({"depth": {"min": -1}}), transformer_like).allowed("r0") == (
        "2.weight",
        "2.bias",
    )


def test_unknown_declared_layer_is_refused() -> None:
    with pytest.raises(RoutingError, match="declared layer 'encoder' is not a module"):
        resolve_routes(policy("all"), Stack(2), layers=["l0", "encoder"])
