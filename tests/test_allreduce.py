"""The governance-aware allreduce, as a property over random policies and slots, in one persistent
2-process gloo group: the applied gradient is the masked per-example mean of a single-process
reference; masked slots leak nothing (not even NaN); an unreachable parameter is untouched."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from govray.governance.allreduce import GradientGovernor, NonFiniteGradientError, governed_allreduce_hook
from tests.helpers.gloo_group import persistent_group

ROUTES = ("a", "b", "c")
WORLD = 2


@dataclass(frozen=True)
class Case:
    seed: int
    allowed: tuple[frozenset[str], ...]  # per parameter (4 tensors: l0.weight, l0.bias, l1.weight, l1.bias)
    slots: tuple[str | None, ...]  # per rank
    sizes: tuple[int, ...]  # examples per rank
    nan_rank: int | None  # this rank's inputs are NaN
    steps: int = 1  # governed steps on the same DDP module (DDP rebuilds buckets after the first)


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def inputs(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case.seed * 10 + rank)
    x = torch.randn(case.sizes[rank], 5, generator=generator)
    y = torch.randn(case.sizes[rank], 3, generator=generator)
    if case.nan_rank == rank:
        x = torch.full_like(x, float("nan"))
    return x, y


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum(dim=1)


def route_counts(case: Case) -> dict[str, int]:
    counts: dict[str, int] = {}
    for route, size in zip(case.slots, case.sizes, strict=True):
        if route is not None:
            counts[route] = counts.get(route, 0) + size
    return counts


def worker_main(rank: int, init_file: str, tasks: Any, results: Any) -> None:
    """One member of the persistent group: runs cases until it receives None."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from govray.train.parallel.strategies import rank_local_buffers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    while (case := tasks.get()) is not None:
        try:
            model = build_model(case.seed)
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            governor = GradientGovernor(list(model.named_parameters()), case.allowed)
            ddp = DistributedDataParallel(model, **rank_local_buffers())  # rank-local buffers, as govray
            ddp.register_comm_hook(governor, governed_allreduce_hook)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
            try:
                for step in range(case.steps):
                    optimizer.zero_grad(set_to_none=True)
                    governor.begin_step(step, case.slots[rank], route_counts(case))
                    x, y = inputs(case, rank)
                    per_example_loss(ddp, x, y).sum().backward()
                    governor.finish_step()
                    governor.check_finite()  # a boundary at every step
                    grads = {
                        name: None if p.grad is None else p.grad.clone()
                        for name, p in model.named_parameters()
                    }
                    optimizer.step()
            except NonFiniteGradientError as error:
                results.put((rank, "nonfinite", str(error)))
                continue
            after = {name: p.detach().clone() for name, p in model.named_parameters()}
            results.put((rank, "ok", (grads, before, after)))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with persistent_group(worker_main, tmp_path_factory.mktemp("gloo"), WORLD, timeout=60) as run:
        yield run


def reference(case: Case) -> dict[str, torch.Tensor | None]:
    """Single process: per-slot sums of per-example gradients, masked mean per parameter."""
    model = build_model(case.seed)
    names = [name for name, _ in model.named_parameters()]
    slot_grads = []
    for rank in range(WORLD):
        model.zero_grad(set_to_none=False)
        x, y = inputs(case, rank)
        per_example_loss(model, x, y).sum().backward()
        slot_grads.append({name: p.grad.clone() for name, p in model.named_parameters()})  # type: ignore[union-attr]
    expected: dict[str, torch.Tensor | None] = {}
    for index, name in enumerate(names):
        members = [
            r for r in range(WORLD) if case.slots[r] is not None and case.slots[r] in case.allowed[index]
        ]
        count = sum(case.sizes[r] for r in members)
        summed = torch.stack([slot_grads[r][name] for r in members]).sum(dim=0) if members else None
        expected[name] = None if summed is None or count == 0 else summed / count
    return expected


route_sets = st.frozensets(st.sampled_from(ROUTES))
cases = st.builds(
    Case,
    seed=st.integers(0, 10_000),
    allowed=st.tuples(route_sets, route_sets, route_sets, route_sets),
    slots=st.tuples(st.sampled_from((*ROUTES, None)), st.sampled_from((*ROUTES, None))),
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    nan_rank=st.none(),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_applied_gradient_is_the_masked_per_example_mean(gloo_pair: Any, case: Case) -> None:
    answers = gloo_pair(case)
    expected = reference(case)
    for rank in range(WORLD):
        status, payload = answers[rank]
        assert status == "ok", payload
        grads, before, after = payload
        for name, want in expected.items():
            got = grads[name]
            if want is None:
                assert got is None, f"{name}: no slot may update it, yet it has a gradient"
                assert torch.equal(before[name], after[name]), f"{name} moved (AdamW with weight decay)"
            else:
                assert got is not None
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * float(want.abs().max()) + 1e-12)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases, nan_rank=st.integers(0, WORLD - 1))
def test_nan_on_a_masked_slot_leaks_nothing_and_on_an_allowed_slot_stops(
    gloo_pair: Any, case: Case, nan_rank: int
) -> None:
    case = Case(case.seed, case.allowed, case.slots, case.sizes, nan_rank)
    answers = gloo_pair(case)
    route = case.slots[nan_rank]
    reaches = route is not None and any(route in allowed for allowed in case.allowed)
    for rank in range(WORLD):
        status, payload = answers[rank]
        if reaches:
            assert status == "nonfinite", payload
            assert "non-finite gradient" in payload and "training stopped" in payload
            continue
        assert status == "ok", payload
        grads, _, _ = payload
        clean = Case(case.seed, case.allowed, case.slots, case.sizes, None)
        for name, want in reference(clean).items():
            got = grads[name]
            assert (got is None) == (want is None)
            if got is not None and want is not None:
                assert bool(torch.isfinite(got).all()), f"NaN leaked into {name}"
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * float(want.abs().max()) + 1e-12)


def test_bucket_layout_cache_survives_ddp_rebuilding_buckets(gloo_pair: Any) -> None:
    """DDP rebuilds its buckets after step 1: several steps in a row in the same process."""
    case = Case(
        7, (frozenset("c"), frozenset("ab"), frozenset("b"), frozenset("abc")), ("a", "b"), (3, 2), None, 4
    )
    answers = gloo_pair(case)
    for status, payload in answers.values():
        assert status == "ok", payload
        grads, before, after = payload
        assert grads["0.weight"] is None and torch.equal(before["0.weight"], after["0.weight"])
        assert grads["0.bias"] is not None and not torch.equal(before["0.bias"], after["0.bias"])


def test_clipping_is_per_route_group() -> None:
    """One route's huge gradient never rescales another route's tensors."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    allowed = (frozenset("a"), frozenset("a"), frozenset("b"), frozenset("b"))
    governor = GradientGovernor(list(model.named_parameters()), allowed)
    governor.begin_step(0, "a", {"a": 1, "b": 1})
    for index, parameter in enumerate(model.parameters()):
        parameter.grad = torch.full_like(parameter, 100.0 if index < 2 else 0.01)
    small = [p.grad.clone() for p in list(model.parameters())[2:]]  # type: ignore[union-attr]
    governor.finish_step(max_grad_norm=1.0)
    big = [p.grad for p in list(model.parameters())[:2]]
    assert abs(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in big]))) - 1.0) < 1e-5  # type: ignore[union-attr]
    assert all(
        p.grad is not None and torch.equal(p.grad, g)
        for p, g in zip(list(model.parameters())[2:], small, strict=True)
    )


def alternating_governor(device: torch.device) -> tuple[GradientGovernor, list[nn.Parameter]]:
    """Six tensors on ``device``, route ``a`` allowed on every other one: a bucket of all six has
    three masked ranges for a slot of route ``a``."""
    parameters = [nn.Parameter(torch.zeros(size, device=device)) for size in (3, 5, 2, 7, 4, 1)]
    allowed = tuple(frozenset("ab") if index % 2 == 0 else frozenset("b") for index in range(6))
    return GradientGovernor([(f"p{i}", p) for i, p in enumerate(parameters)], allowed), parameters


DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_masked_ranges_holding_nan_and_inf_end_exactly_zero(device: torch.device) -> None:
    """Selection by zero-filling ranges, several per bucket, on every device: NaN and inf in a
    masked region end exactly 0 (a multiplying mask would leave NaN), allowed regions keep their
    bits, and the plan is ranges (no bucket-sized mask tensor is kept)."""
    governor, parameters = alternating_governor(device)
    governor.begin_step(0, "a", {"a": 3, "b": 2})
    layout = governor.layout(parameters)
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randn(layout.numel, generator=generator).to(device)
    allowed = torch.zeros(layout.numel, dtype=torch.bool)
    for region in layout.regions:
        if governor.contributes(region.index):
            allowed[region.offset : region.offset + region.numel] = True
        else:
            poison = (float("nan"), float("inf"), float("-inf"))[region.index % 3]
            buffer[region.offset : region.offset + region.numel] = poison
    kept = buffer.cpu()[allowed].clone()
    governor.mask(buffer, layout)
    masked = buffer.cpu()[~allowed]
    assert masked.numel() == 13 and bool((masked == 0).all()) and not bool(masked.signbit().any())
    assert torch.equal(buffer.cpu()[allowed], kept)
    ranges = layout.masks["a"]
    assert ranges == ((3, 5), (10, 7), (21, 1))
    assert all(isinstance(plan, tuple) for plan in layout.masks.values())


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_divisors_are_one_device_tensor_per_step_with_fp32_inverses(device: torch.device) -> None:
    """``begin_step`` makes the step's 1/count of every route group once, on the device; the
    average multiplies each region by exactly fp32(1/count), and a new step's counts replace the
    last step's (nothing accumulates per count)."""
    governor, parameters = alternating_governor(device)
    layout = governor.layout(parameters)
    for step, counts in enumerate(({"a": 3, "b": 4}, {"a": 7, "b": 11}, {"a": 5, "b": 13})):
        governor.begin_step(step, "b", counts)
        assert list(governor._device_inverses) == [parameters[0].device]
        summed = torch.randn(layout.numel, generator=torch.Generator().manual_seed(step)).to(device)
        averaged = summed.clone()
        governor.average(averaged, layout)
        for region in layout.regions:
            count = governor.count(region.index)
            inverse = torch.tensor(1.0 / count, dtype=torch.float32)
            got = averaged[region.offset : region.offset + region.numel].cpu()
            want = summed[region.offset : region.offset + region.numel].cpu() * inverse
            assert torch.equal(got, want), (step, region)
    assert governor._inverses.tolist() == [
        torch.tensor(1 / 18, dtype=torch.float32).item(),
        torch.tensor(1 / 13, dtype=torch.float32).item(),
    ]


def test_bucket_layouts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layouts (and the masks each holds, one per route) are an LRU of ``LAYOUTS_KEPT``: a run
    that makes new buckets forever keeps a bounded cache, and a layout in use stays cached."""
    from govray.governance import allreduce

    monkeypatch.setattr(allreduce, "LAYOUTS_KEPT", 3)
    governor, parameters = alternating_governor(torch.device("cpu"))
    governor.begin_step(0, "a", {"a": 1})
    hot = governor.layout(parameters[:2])
    for first in range(6):
        for last in range(first + 1, 7):
            layout = governor.layout(parameters[first:last])
            governor.mask(torch.zeros(layout.numel), layout)
            assert governor.layout(parameters[:2]) is hot
            assert len(governor._layouts) <= 3
