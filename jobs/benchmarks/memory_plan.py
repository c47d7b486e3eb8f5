"""Benchmark: the memory plan of the first real GPU job, governed against plain PEFT + DDP.

A Llama-3-8B-shaped model (hidden 4096, 32 blocks, 32 heads, 8 KV heads, MLP 14336, vocab
128256), bf16 base, sequence 4096, one row per rank per step, activation checkpointing, 8 ranks
under DDP. Three corpora, each routed to its own LoRA adapter (rank 16 on q/k/v/o): public text on
every block, licensed text on blocks 16-31 only, PII on every block; the base is frozen.

Both steps run under the same estimator (``govray.train.footprint.estimate``: fake tensors, a fake
process group of 8 ranks, torch's memory tracker): govray's governed step (``plan_governed``)
and a plain step of the same model with the same three adapters injected by PEFT, ungoverned,
DDP's buckets over every adapter tensor (``plain_peft_ddp``), with the same checkpointing and
chunked loss. The tracker's parameters, gradients and optimizer state are checked against a hand
count first.

Then a Llama-70B-shaped model (hidden 8192, 80 blocks, 64 heads, 8 KV heads, MLP 28672, vocab
128256) fully fine-tuned on 64 ranks under FSDP2: sequence 4096, one row per micro-batch, bf16
(FSDP2's mixed precision: bf16 compute, fp32 parameters, gradients, AdamW state and reduction),
activation checkpointing, the loss head chunked. Public text may update every tensor, licensed
text the upper 40 blocks, norm and head. govray's governed FSDP step
(``govray.train.footprint.sharded.plan_sharded``: the engine's units and ``shard_model``, the
``ShardedGovernor``'s zero-fill hooks, per-shard division and per-group clipping) against a plain
FSDP2 step of the same model (torch's ``fully_shard`` on the same units, averaging reduction,
AdamW, no governance), under the same estimator. ``--accumulation K`` also measures a slot of K
micro-batches reduce-scattered after each (govray) against today's ``no_sync`` way (FSDP's
gradient sync off for the first K-1: unsharded fp32 gradients kept between micro-batches).

Run it with ``python -m jobs.benchmarks.memory_plan [--accumulation K]``; the last lines are the
8B and the 70B ratios and governed peaks per rank, then (measured, not estimated:
``jobs.benchmarks.init_memory``) the host memory one FSDP rank needs to build its shard, as a
ratio to that shard.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn

from govray.config.training import Precision
from govray.governance.policy import DepthPolicy
from govray.train.decoder import decoder_layers
from govray.train.footprint.estimate import (
    MemoryPlan,
    PlanSetup,
    checkpoint_blocks,
    chunked_lm_loss,
    ddp_buckets_by_hand,
    fake_world,
    materialize_fake,
    measure_step,
)
from govray.train.footprint.sharded import plan_sharded
from govray.train.hf import CausalLMTrial
from jobs.benchmarks.init_memory import init_ratio

GIB = 2**30
LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
SETUP = PlanSetup(
    world_size=8, micro_batch=1, seq_len=4096, precision=Precision.BF16, activation_checkpointing=True
)
LICENSED_BLOCKS = range(16, 32)
LLAMA_70B: dict[str, Any] = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
SETUP_70B = PlanSetup(
    world_size=64, micro_batch=1, seq_len=4096, precision=Precision.BF16, activation_checkpointing=True
)
# Public text may update every tensor; licensed text the upper 40 blocks, the final norm and head.
FULL_POLICY = DepthPolicy.model_validate(
    {
        "name": "llama-70b-full",
        "version": 1,
        "rules": [
            {"name": "licensed", "match": {"license_class": "licensed"}, "route": {"depth": {"min": -42}}},
            {"name": "public", "route": "all"},
        ],
    }
)


def story_trial(shape: dict[str, Any] = LLAMA3_8B) -> CausalLMTrial:
    """The model of the story: a Llama-3-8B shape from its config, trained with AdamW."""
    return CausalLMTrial({"model": shape})


def story_policy(rank: int = 16) -> DepthPolicy:
    """Public text → an adapter on every block, licensed text → one on blocks 16-31, PII → a
    third on every block; nothing may update the base."""
    every = [f"model.layers.*.self_attn.{projection}" for projection in PROJECTIONS]
    upper = [f"model.layers.{block}.self_attn.{p}" for block in LICENSED_BLOCKS for p in PROJECTIONS]
    adapters = {
        "public-lora": {"targets": every, "rank": rank, "alpha": 2 * rank},
        "licensed-lora": {"targets": upper, "rank": rank, "alpha": 2 * rank},
        "pii-lora": {"targets": every, "rank": rank, "alpha": 2 * rank},
    }
    rules = [
        {"name": "pii", "match": {"sensitivity": "pii"}, "route": {"adapter": "pii-lora"}},
        {"name": "licensed", "match": {"license_class": "licensed"}, "route": {"adapter": "licensed-lora"}},
        {"name": "public", "route": {"adapter": "public-lora"}},
    ]
    return DepthPolicy.model_validate(
        {"name": "llama3-8b-story", "version": 1, "adapters": adapters, "rules": rules}
    )


def plain_peft_ddp(trial: CausalLMTrial, policy: DepthPolicy, setup: PlanSetup) -> MemoryPlan:
    """The plain step under the same estimator: PEFT injects the same adapters (no govray), all
    trainable in fp32, the public one active (the largest); DDP reduces every adapter tensor (its
    buckets counted by hand, as the estimator does); AdamW; no masks, divisors or flags."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = trial.build_meta_model()
    for name, spec in policy.adapters.items():
        targets = [f"{prefix}.{p}" for prefix in _blocks(spec.targets) for p in PROJECTIONS]
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets)  # type: ignore[arg-type]
        inject_adapter_in_model(config, model, adapter_name=name)
    trainable = {name for name, _ in model.named_parameters() if ".lora_" in name}
    with fake_world(setup.world_size), FakeTensorMode(allow_non_fake_inputs=True):
        materialize_fake(model, trainable, torch.bfloat16)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.set_adapter("public-lora")  # PEFT's switch freezes the others: undo it
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name in trainable)
        if setup.activation_checkpointing:
            checkpoint_blocks(model, decoder_layers(model))
        parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
        buckets = torch.empty(ddp_buckets_by_hand(parameters), dtype=torch.uint8)
        optimizer = trial.build_optimizer(parameters)
        ids = torch.zeros(setup.micro_batch, setup.seq_len, dtype=torch.long)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = chunked_lm_loss(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return measure_step(model, optimizer, step, [buckets], governance=0)


def _blocks(targets: tuple[str, ...]) -> list[str]:
    """The block prefixes an adapter's targets name (``model.layers.N.self_attn``)."""
    if targets[0].startswith("model.layers.*"):
        return [f"model.layers.{block}.self_attn" for block in range(LLAMA3_8B["num_hidden_layers"])]
    return sorted({target.rpartition(".")[0] for target in targets})


def hand_count(policy: DepthPolicy, shape: dict[str, Any] = LLAMA3_8B) -> dict[str, int]:
    """Bytes of parameters (bf16 base, fp32 adapters), of the public adapter's gradients and of
    AdamW's state (two fp32 moments per adapter element), from the shape alone."""
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    blocks = shape["num_hidden_layers"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    base = blocks * block + 2 * vocab * hidden + hidden  # embeddings, head, final norm
    outs = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    adapters = {}
    for name, spec in policy.adapters.items():
        covered = len(_blocks(spec.targets))
        adapters[name] = covered * sum(spec.rank * (hidden + out) for out in outs.values())
    total = sum(adapters.values())
    return {
        "params": 2 * base + 4 * total,
        "grads": 4 * adapters["public-lora"],
        "optimizer": 8 * total,
    }


def _show(label: str, plan: MemoryPlan) -> None:
    print(f"{label}: peak {plan.total / GIB:.3f} GiB per rank")
    for (kind, at_peak), (_, largest) in zip(plan.at_peak.items(), plan.largest.items(), strict=True):
        print(f"  {kind:<14} at peak {at_peak / GIB:8.3f} GiB   largest {largest / GIB:8.3f} GiB")


def _check(plan: MemoryPlan, hand: dict[str, int]) -> None:
    for kind, expected in hand.items():
        measured = getattr(plan.largest, kind)
        print(f"  tracker vs hand count, {kind}: {measured / GIB:.4f} / {expected / GIB:.4f} GiB")
        if abs(measured - expected) > 0.02 * expected:
            raise SystemExit(f"the tracker's {kind} ({measured} B) is not the hand count ({expected} B)")


class TodaysAccumulation(CausalLMTrial):
    """The trial as govray accumulated before issue 32: FSDP's gradient sync off for the first
    K-1 micro-batches of a slot (their unsharded gradients kept), on for the K-th."""

    def __init__(self, hparams: dict[str, Any], micro_batches: int) -> None:
        super().__init__(hparams)
        self.micro_batches, self.calls = micro_batches, 0

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(model, FSDPModule)
        self.calls += 1
        model.set_requires_gradient_sync(self.calls % self.micro_batches == 0)
        return super().loss(model, batch)


def plain_fsdp(trial: CausalLMTrial, setup: PlanSetup) -> MemoryPlan:
    """The plain step under the same estimator: every tensor trainable (fp32), torch's
    ``fully_shard`` on the same units then the root (bf16 compute, fp32 reduction, averaging),
    the same checkpointing and chunked loss, AdamW; no masks, divisors, hooks or flags."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from govray.train.parallel.fsdp import layer_units
    from govray.train.step.memory_savers import checkpoint_activations

    model = trial.build_meta_model()
    units = layer_units(model, trial.fsdp_units(model))
    with fake_world(setup.world_size):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            materialize_fake(model, {name for name, _ in model.named_parameters()}, torch.bfloat16)
            checkpoint_activations(model, trial.checkpoint_units(model))
        mesh = init_device_mesh("cpu", (setup.world_size,))  # outside the fake mode
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        with fake:
            optimizer = trial.build_optimizer(list(model.parameters()))
            ids = torch.zeros(setup.micro_batch, setup.seq_len, dtype=torch.long)

            def step() -> None:
                trial.loss(model, {"ids": ids, "targets": ids}).sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            return measure_step(model, optimizer, step, [], governance=0)


def sharded_hand_count(shape: dict[str, Any], world_size: int) -> dict[str, int]:
    """Bytes of one rank's shards of a fully trainable model: fp32 parameters, and AdamW's two
    fp32 moments (the gradients' shards are the parameters' size; the tracker's largest adds one
    unit's unsharded gradient, so they are not checked here)."""
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    total = shape["num_hidden_layers"] * block + 2 * vocab * hidden + hidden
    return {"optimizer": 8 * total // world_size}


def accumulation_trade(micro_batches: int) -> None:
    """A slot of ``micro_batches`` micro-batches on the 70B shape: reduce-scattered after each
    (govray) against FSDP's sync off for the first K-1 (before issue 32)."""
    started = time.perf_counter()
    each = plan_sharded(story_trial(LLAMA_70B), FULL_POLICY, SETUP_70B, micro_batches)
    each_s = time.perf_counter() - started
    today = plan_sharded(
        TodaysAccumulation({"model": LLAMA_70B}, micro_batches), FULL_POLICY, SETUP_70B, micro_batches
    )
    today_s = time.perf_counter() - started - each_s
    _show(f"governed, reduce-scatter every micro-batch, {micro_batches} micro-batches ({each_s:.1f} s)", each)
    _show(f"governed, no_sync for the first {micro_batches - 1} ({today_s:.1f} s)", today)
    print(
        f"accumulation {micro_batches}, peak per rank: reduce-scatter every micro-batch "
        f"{each.total / GIB:.1f} GiB, no_sync {today.total / GIB:.1f} GiB"
    )


def main() -> None:
    from govray.train.footprint.estimate import plan_governed

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accumulation", type=int, default=0, help="also measure K micro-batches")
    args = parser.parse_args()
    if args.accumulation > 1:
        accumulation_trade(args.accumulation)
    trial, policy = story_trial(), story_policy()
    started = time.perf_counter()
    governed = plan_governed(trial, policy, SETUP)
    governed_s = time.perf_counter() - started
    plain = plain_peft_ddp(trial, policy, SETUP)
    plain_s = time.perf_counter() - started - governed_s
    hand = hand_count(policy)
    _show(f"governed (estimated in {governed_s:.1f} s)", governed)
    _check(governed, hand)
    _show(f"plain PEFT + DDP (estimated in {plain_s:.1f} s)", plain)
    _check(plain, hand)

    large = story_trial(LLAMA_70B)
    started = time.perf_counter()
    sharded = plan_sharded(large, FULL_POLICY, SETUP_70B)
    sharded_s = time.perf_counter() - started
    plain_sharded = plain_fsdp(large, SETUP_70B)
    plain_sharded_s = time.perf_counter() - started - sharded_s
    hand_70b = sharded_hand_count(LLAMA_70B, SETUP_70B.world_size)
    _show(f"llama-70b governed fsdp (estimated in {sharded_s:.1f} s)", sharded)
    _check(sharded, hand_70b)
    _show(f"llama-70b plain fsdp (estimated in {plain_sharded_s:.1f} s)", plain_sharded)
    _check(plain_sharded, hand_70b)

    init = init_ratio()  # measured (its per-rank lines printed here), its figure printed last
    ratio = governed.total / plain.total
    print(f"governed/plain peak memory per rank (llama-3-8b lora, ddp, 8 ranks, bf16): {ratio:.3f}")
    peak = governed.total / GIB
    print(f"governed peak memory per rank (llama-3-8b lora, ddp, 8 ranks, bf16): {peak:.1f} GiB")
    ratio = sharded.total / plain_sharded.total
    print(f"governed/plain peak memory per rank (llama-70b full, fsdp, 64 ranks, bf16): {ratio:.3f}")
    peak = sharded.total / GIB
    print(f"governed peak memory per rank (llama-70b full, fsdp, 64 ranks, bf16): {peak:.1f} GiB")
    print(f"init host memory per rank / its shard of the model: {init:.2f}")  # measured, last


if __name__ == "__main__":
    main()
