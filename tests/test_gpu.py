"""The engine on a GPU (marked ``gpu``; skipped without CUDA): run with ``pytest -m gpu tests/test_gpu.py``
on a machine with one NVIDIA GPU.

(a) The Hugging Face example on one GPU worker in bf16: no direct contribution outside a route's
    tensors (exact, whatever the reduction order) and adapter removal = counterfactual replay
    within the tolerance the run's attestation states.
(b) Two ranks on the one GPU with gloo and CUDA tensors (NCCL cannot put two ranks on one GPU;
    gloo reduces CUDA tensors): the comm hook's device path gives the masked per-example mean,
    and a masked slot's NaN leaks nothing.
(c) With ``training.deterministic: true`` adapter removal = replay is bit-identical on the GPU.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from govray.governance.allreduce import GradientGovernor, governed_allreduce_hook
from govray.platform.rerun.replay import replay_trial
from govray.platform.run.runner import TrialOutcome, run_trial
from govray.provenance.locations import run_spec_of
from govray.signer.attesting import attest
from govray.train.checkpoints.files import MODEL_FILE, find_checkpoints
from jobs.examples.digits.golden import opened
from jobs.gpu_check import gpu_experiment
from tests.helpers.attest import statement_of
from tests.helpers.gloo_group import persistent_group

REPO = Path(__file__).resolve().parents[1]
HF_EXAMPLE = REPO / "jobs" / "examples" / "hf_lm" / "experiment.yaml"
STEPS = 8

pytestmark = pytest.mark.gpu  # selected only with -m gpu (on a GPU machine: jobs/gpu_check.py)


# --- (a), (c): the Hugging Face example on one GPU worker ------------------------------------------


def hf_example_on_gpu(root: Path, *, deterministic: bool) -> Path:
    """The HF example's experiment under ``root`` as ``python -m jobs.gpu_check`` runs it (absolute
    data, canary and policy paths, storage in ``root``, one GPU worker, bf16), for a few steps."""
    return gpu_experiment(root, STEPS, deterministic=deterministic)


def final_checkpoint(outcome: TrialOutcome) -> Path:
    found = find_checkpoints(outcome.run_dir)
    assert found, f"{outcome.run_dir}: no checkpoint"
    return found[-1]


def removal_against_replay(root: Path, *, deterministic: bool) -> None:
    """Train the example, replay it without every corpus routed only to an adapter, and compare the
    base tensors: bit-identical (deterministic) or within the attested tolerance."""
    config, store, checked, experiment, ingested = opened(
        hf_example_on_gpu(root, deterministic=deterministic)
    )
    outcome = run_trial(config, checked, experiment, ingested.root, store)
    checkpoint = final_checkpoint(outcome)
    routing = run_spec_of(checkpoint).routing
    assert routing is not None and routing.adapter_names, "the HF example routes no corpus to an adapter"
    ledger = outcome.ledger
    assert ledger is not None
    # Zero direct contribution, exact on the GPU: an adapter corpus reached only adapter tensors.
    adapter_corpora = sorted(
        corpus
        for corpus in ledger.corpora()
        if all(tensor.startswith("adapter/") for found, tensor, _ in ledger.rows() if found == corpus)
    )
    assert adapter_corpora, "no corpus of the HF example reached only adapter tensors"
    promise = statement_of(attest(checkpoint, destination=root / "attested").provenance)["predicate"][
        "buildDefinition"
    ]["internalParameters"]["replay_equivalence"]
    assert promise["exact"] is deterministic
    replayed = replay_trial(store, config.name, tuple(adapter_corpora), trial_id=outcome.trial_id)
    base = load_file(checkpoint / MODEL_FILE)
    counterfactual = load_file(final_checkpoint(replayed.outcome) / MODEL_FILE)
    assert base.keys() == counterfactual.keys()
    frozen = [
        info.name
        for index, info in enumerate(routing.parameters)
        if not any(m[index] for m in routing.masks.values())
    ]
    for name, tensor in base.items():
        if deterministic or name in frozen:  # a tensor no route updates never moves, on any device
            assert torch.equal(tensor, counterfactual[name]), name
        else:
            tolerance = promise["tolerance"]
            torch.testing.assert_close(
                counterfactual[name], tensor, rtol=tolerance["rtol"], atol=tolerance["atol"]
            )
    assert replayed.outcome.ledger is not None
    assert not set(adapter_corpora) & set(replayed.outcome.ledger.corpora())


def test_hf_example_in_bf16_on_a_gpu_removal_equals_replay_within_the_attested_tolerance(
    ray_session: None, tmp_path: Path
) -> None:
    removal_against_replay(tmp_path, deterministic=False)


def test_hf_example_in_deterministic_mode_removal_equals_replay_bit_for_bit_on_the_gpu(
    ray_session: None, tmp_path: Path
) -> None:
    removal_against_replay(tmp_path, deterministic=True)


# --- (b): the comm hook's device path, two ranks on one GPU with gloo --------------------------------

WORLD = 2
# Per parameter of the model (l0.weight, l0.bias, l1.weight, l1.bias): the routes that may update it.
ALLOWED = (frozenset("a"), frozenset("ab"), frozenset("b"), frozenset())
CASES = [  # (slots per rank, examples per rank, the rank whose inputs are NaN)
    (("a", "b"), (3, 2), None),
    (("a", "a"), (1, 4), None),
    (("b", None), (2, 0), None),
    (("a", "c"), (3, 2), 1),  # route c may update nothing: rank 1's NaN must reach no tensor
]


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).cuda()


def inputs(case: int, rank: int, size: int, nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case * 10 + rank)
    x, y = torch.randn(size, 5, generator=generator), torch.randn(size, 3, generator=generator)
    if nan:
        x = torch.full_like(x, float("nan"))
    return x.cuda(), y.cuda()


def counts(slots: tuple[str | None, ...], sizes: tuple[int, ...]) -> dict[str, int]:
    found: dict[str, int] = {}
    for route, size in zip(slots, sizes, strict=True):
        if route is not None:
            found[route] = found.get(route, 0) + size
    return found


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum(dim=1)


def rank_main(rank: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from govray.train.parallel.strategies import rank_local_buffers

    torch.cuda.set_device(0)  # both ranks share the one GPU
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    while (task := tasks.get()) is not None:
        index, (slots, sizes, nan_rank) = task
        try:
            model = build_model(index)
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            governor = GradientGovernor(list(model.named_parameters()), ALLOWED)
            ddp = DistributedDataParallel(model, device_ids=[0], **rank_local_buffers())
            ddp.register_comm_hook(governor, governed_allreduce_hook)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
            governor.begin_step(0, slots[rank], counts(slots, sizes))
            loss(ddp, *inputs(index, rank, sizes[rank], nan_rank == rank)).sum().backward()
            governor.finish_step()
            governor.check_finite()  # the boundary: a NaN on a masked slot never raises
            grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
            devices = {p.grad.device.type for p in model.parameters() if p.grad is not None}
            optimizer.step()
            after = {name: p.detach().cpu() for name, p in model.named_parameters()}
            results.put((rank, "ok", (grads, {n: t.cpu() for n, t in before.items()}, after, devices)))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_ranks_on_one_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with persistent_group(rank_main, tmp_path_factory.mktemp("gloo-cuda"), WORLD, timeout=120) as run:
        yield lambda index: run((index, CASES[index]))


def reference(index: int) -> dict[str, torch.Tensor | None]:
    """One process, same GPU: each slot's summed per-example gradient, masked mean per parameter."""
    slots, sizes, nan_rank = CASES[index]
    model = build_model(index)
    per_slot = []
    for rank in range(WORLD):
        model.zero_grad(set_to_none=False)
        loss(model, *inputs(index, rank, sizes[rank], nan_rank == rank)).sum().backward()
        per_slot.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    expected: dict[str, torch.Tensor | None] = {}
    for position, (name, _) in enumerate(model.named_parameters()):
        members = [r for r in range(WORLD) if slots[r] is not None and slots[r] in ALLOWED[position]]
        count = sum(sizes[r] for r in members)
        expected[name] = None if count == 0 else (sum(per_slot[r][name] for r in members) / count).cpu()
    return expected


@pytest.mark.parametrize("index", range(len(CASES)))
def test_the_comm_hooks_device_path_gives_the_masked_mean_and_leaks_nothing_from_masked_slots(
    gloo_ranks_on_one_gpu: Any, index: int
) -> None:
    answers = gloo_ranks_on_one_gpu(index)
    expected = reference(index)
    for rank in range(WORLD):
        status, payload = answers[rank]
        assert status == "ok", payload
        grads, before, after, devices = payload
        assert devices <= {"cuda"}  # the hook reduced CUDA buffers in place
        for name, want in expected.items():
            got = grads[name]
            if want is None:  # no slot may update it: no gradient, not moved by AdamW's decay
                assert got is None, name
                assert torch.equal(before[name], after[name]), name
            else:
                assert got is not None and bool(torch.isfinite(got).all()), f"{name}: NaN leaked"
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7 * float(want.abs().max()) + 1e-12)
