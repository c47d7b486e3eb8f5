"""The memory plan (``govray plan``): a rank's peak memory measured on fake tensors. Its parameters,
gradients and optimizer state equal a hand count from the model's shape (the hf_lm example, and a
Llama-3-8B shape with the first GPU job's three LoRA routes); a run that cannot fit is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from govray.cli import main
from govray.config.experiment import load_experiment
from govray.config.training import Precision
from govray.governance.policy import DepthPolicy, load_policy
from govray.train.footprint.estimate import MemoryPlan, PlanSetup, plan_governed
from govray.train.trial import make_trial
from jobs.benchmarks.memory_plan import story_policy, story_trial

REPO = Path(__file__).resolve().parents[1]
HF_LM = REPO / "jobs" / "examples" / "hf_lm" / "experiment.yaml"


def within(measured: int, expected: int, tolerance: float = 0.10) -> bool:
    return abs(measured - expected) <= tolerance * expected


def assert_hand_count(plan: MemoryPlan, params: int, grads: int, optimizer: int) -> None:
    assert within(plan.largest.params, params), (plan.largest.params, params)
    assert within(plan.largest.grads, grads), (plan.largest.grads, grads)
    assert within(plan.largest.optimizer, optimizer), (plan.largest.optimizer, optimizer)
    assert plan.total >= plan.at_peak.params + plan.at_peak.optimizer


def test_the_hf_lm_example_plans_its_parameters_gradients_and_adamw_state_as_counted_by_hand() -> None:
    config = load_experiment(HF_LM)
    hparams = config.default_hparams()
    trial = make_trial(config.trial, hparams, config.training.with_hyperparameters(hparams))
    plan = plan_governed(trial, load_policy(config.policy.file), PlanSetup(2, micro_batch=16, seq_len=129))
    # A 4-block Llama, hidden 32, 4 heads of 8 (2 for keys and values: 16 wide), MLP 64, vocab 257,
    # tied head; the PII adapter is rank 4 on q/k/v/o of every block. The public route may update
    # the whole base, so every tensor is trainable: fp32, and its slot holds the largest gradients.
    block = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32
    base = 4 * block + 257 * 32 + 32
    adapter = 4 * (4 * (32 + 32) + 4 * (32 + 16) + 4 * (32 + 16) + 4 * (32 + 32))
    assert_hand_count(plan, params=4 * (base + adapter), grads=4 * base, optimizer=8 * (base + adapter))
    # Two ranks: DDP's buckets hold a copy of the base's gradients, the adapters a flat buffer.
    assert plan.at_peak.communication == 4 * (base + adapter)
    assert plan.at_peak.activations > 0


def test_checkpointing_an_adapter_only_run_keeps_its_state_and_saves_activations() -> None:
    """Every route trains the PII adapter only: the base is frozen, the adapter's blocks recompute
    in backward with the adapter still active, and only activations shrink."""
    config = load_experiment(HF_LM)
    hparams = config.default_hparams()
    trial = make_trial(config.trial, hparams, config.training.with_hyperparameters(hparams))
    adapters = load_policy(config.policy.file).model_dump(mode="json")["adapters"]
    rules = [{"name": "everything", "route": {"adapter": "records-lora"}}]
    policy = DepthPolicy.model_validate(
        {"name": "lora-only", "version": 1, "adapters": adapters, "rules": rules}
    )
    plans = [
        plan_governed(trial, policy, PlanSetup(1, 16, 129, Precision.BF16, activation_checkpointing=on))
        for on in (False, True)
    ]
    base, adapter = 45376, 3584  # the hf_lm model's elements, counted in the test above
    for plan in plans:
        assert_hand_count(plan, params=2 * base + 4 * adapter, grads=4 * adapter, optimizer=8 * adapter)
        assert plan.at_peak.communication == 0  # one rank: nothing to reduce
    assert plans[1].largest.activations < plans[0].largest.activations


def test_govray_plan_prints_the_breakdown_and_refuses_a_run_that_cannot_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", str(HF_LM), "--gpu-memory", "1"]) == 0
    printed = capsys.readouterr().out
    assert "hf-lm-governed: 1 rank(s), 16 row(s) of 129 tokens per micro-batch, fp32" in printed
    for kind in ("params", "grads", "optimizer", "activations", "governance", "communication", "peak"):
        assert kind in printed
    assert main(["plan", str(HF_LM), "--world", "2", "--gpu-memory", "0.01"]) == 23
    captured = capsys.readouterr()
    assert "hf-lm-governed: 2 rank(s)" in captured.out
    assert "MemoryPlanError: hf-lm-governed does not fit in 0.01 GiB per GPU" in captured.err
    assert "(activations" in captured.err and "too much" in captured.err


@pytest.mark.slow
def test_a_llama3_8b_lora_job_plans_its_frozen_bf16_base_and_fp32_adapters_as_counted_by_hand() -> None:
    setup = PlanSetup(8, micro_batch=1, seq_len=256, precision=Precision.BF16)
    plan = plan_governed(story_trial(), story_policy(rank=16), setup)
    hidden, kv, inter, vocab = 4096, 1024, 14336, 128256
    base = (
        32 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden)
        + 2 * vocab * hidden
        + hidden
    )
    per_block = 16 * (hidden + hidden) * 2 + 16 * (hidden + kv) * 2  # q, o; k, v
    public, licensed, pii = 32 * per_block, 16 * per_block, 32 * per_block
    adapters = public + licensed + pii
    # The base is frozen in bf16; the adapters, their gradients and AdamW's two moments are fp32.
    assert_hand_count(plan, params=2 * base + 4 * adapters, grads=4 * public, optimizer=8 * adapters)
    assert plan.at_peak.communication == 4 * adapters  # no DDP: the adapters' flat buffer alone
    assert plan.total < 20 * 2**30
    assert not torch.distributed.is_initialized()  # the fake process group is gone
