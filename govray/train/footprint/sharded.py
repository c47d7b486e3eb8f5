"""The memory plan of a run under ``resources.strategy: fsdp``: one rank's peak memory in a governed
FSDP2 step, measured on fake tensors with a fake process group of the run's world size.

The step is the engine's (``train.sharding``): the trial's model built on ``meta``, every tensor
some route may update fp32 (the others in the compute dtype), each of the trial's FSDP units and
the root ``fully_shard``ed by :func:`~govray.train.parallel.fsdp.shard_model` (bf16 compute and fp32
reduction under ``precision: bf16``), the :class:`~govray.train.parallel.fsdp.ShardedGovernor`'s
zero-fill hooks before each reduce-scatter, its per-shard division by the counts and per-route-group
clipping, the trial's optimizer over the shards. A slot of ``micro_batches`` micro-batches
reduce-scatters after each of them, as the engine does. The measured route is the one whose slot
updates the most bytes, the optimizer state of every trainable tensor already there (as
:func:`govray.train.footprint.estimate.plan_governed` measures a DDP run).

Example::

    plan = plan_sharded(trial, policy, PlanSetup(64, micro_batch=1, seq_len=4096,
                                                 precision=Precision.BF16,
                                                 activation_checkpointing=True))
    print(plan.total / 2**30)        # GiB per rank at its peak
"""

from __future__ import annotations

import torch

from govray.governance.policy import DepthPolicy
from govray.train.footprint.estimate import (
    HALF,
    MemoryPlan,
    PlanSetup,
    fake_world,
    governance_buffers_by_hand,
    governed_meta_model,
    materialize_fake,
    measure_step,
)
from govray.train.parallel.fsdp import ShardedGovernor, layer_units, optimizer_groups, shard_model
from govray.train.step.memory_savers import checkpoint_activations
from govray.train.trial import Trial


def plan_sharded(trial: Trial, policy: DepthPolicy, setup: PlanSetup, micro_batches: int = 1) -> MemoryPlan:
    """One rank's peak memory for a governed FSDP2 step of ``trial`` (a transformers causal LM)
    under ``policy`` on ``setup.world_size`` ranks, ``micro_batches`` micro-batches per slot."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    base, _, table, model, routes, route = governed_meta_model(trial, policy)
    adapter = table.adapter_names.get(route)
    units = layer_units(base, trial.fsdp_units(base))
    with fake_world(setup.world_size):
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            materialize_fake(model, set(routes), HALF.get(setup.precision, torch.float32))
            if setup.activation_checkpointing:
                checkpoint_activations(base, trial.checkpoint_units(base))
        # The device mesh is made outside the fake mode (made inside, fully_shard refuses it);
        # the fake tensors stay fake, their operations run in their own mode.
        shard_model(model, units, setup.precision, torch.device("cpu"))
        with fake:
            named = [(name, p) for name, p in model.named_parameters() if name in routes]
            governor = ShardedGovernor(model, named, [routes[name] for name, _ in named], torch.device("cpu"))
            optimizer = trial.build_optimizer(optimizer_groups([p for _, p in named]))
            ids = torch.zeros(setup.micro_batch, setup.seq_len, dtype=torch.long)
            batch = {"ids": ids, "targets": ids}
            counts = {name: setup.micro_batch * setup.world_size * micro_batches for name in table.routes}

            def step() -> None:
                governor.begin_step(0, route, counts)
                with model.active(adapter):
                    for _ in range(micro_batches):  # each backward ends in the reduce-scatters
                        trial.loss(model, batch).sum().backward()  # the root's forward, as trained
                governor.govern_sharded()
                governor.finish_step(trial.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            return measure_step(model, optimizer, step, [], governance_buffers_by_hand(len(governor.groups)))
