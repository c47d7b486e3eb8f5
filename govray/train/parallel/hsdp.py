"""Governed HSDP (``resources.strategy: hsdp``): FSDP2 within each shard group of
``resources.shard_group`` workers, the groups replicas of one another.

FSDP2 does it with a 2-D device mesh ``(replicas, shard_group)`` named ``("replicate",
"shard")``: a unit's all-gather and reduce-scatter stay inside the shard group (a node: its fast
links), then one all-reduce of the reduced shard runs across the replicas. Shard groups are runs
of consecutive ranks (Ray Train numbers a node's workers consecutively), so the default group
is a node: the workers Ray Train put on it (its GPUs under ``use_gpu``). A CPU run names it.

Governance is FSDP's (``train.sharding``) unchanged: the zero-fill hooks run before the
reduce-scatter on every rank; the reduce-scatter and the all-reduce both sum (divide factor 1,
force-sum reduction: FSDP2's HSDP takes the same two settings for both), so every rank's shard
holds the sum over **all** ranks' slots and dividing it by the schedule's global counts is exact.
What differs is the clipping norm: each shard lives on one rank per replica group, so only the
first replica group's shards enter it (``ShardedGovernor.counts_its_shards``).

Checkpoints: every rank writes (and verifies, and reads back) its own shard files, replicas
included: FSDP's ``ShardedLayout`` unchanged, each rank's shards in the files next to it. The
price is a copy of the shards per replica group on storage. One replica group alone writing
would store one copy, but every other rank would then read and verify another rank's files at
each resume and rollback (from another node, through the object storage), and the layout's
one-rank-one-file checks would change; with byte-range reads of any layout (a resharding
resume) that becomes the better trade. The state records the shard group: a resume under
another one, or under FSDP, is refused.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from govray.config.resources import shard_group_refusal
from govray.core.errors import ConfigError
from govray.train.parallel.worker import Worker

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def workers_per_node() -> int | None:
    """The workers on this node: Ray Train's local world size (torchrun's outside Ray), or None
    where neither says."""
    try:
        import ray.train

        return int(ray.train.get_context().get_local_world_size())
    except (RuntimeError, ValueError, AttributeError):  # not a Ray Train worker
        size = os.environ.get("LOCAL_WORLD_SIZE")
        return int(size) if size else None


def shard_group_size(configured: int | None, worker: Worker) -> int:
    """The shard group: ``resources.shard_group``, or the workers per node; the same on every
    rank and splitting the world into two or more groups, or refused on every rank (a collective)."""
    size = configured if configured is not None else workers_per_node()
    sizes: list[Any] = [None] * worker.world_size
    dist.all_gather_object(sizes, size, group=worker.host_group)
    if None in sizes:
        raise ConfigError(
            "strategy hsdp: set resources.shard_group (the workers per node, its default, are not known here)"
        )
    if len(set(sizes)) > 1:
        raise ConfigError(
            f"strategy hsdp: the nodes hold different numbers of workers ({sorted(set(sizes))}): set "
            "resources.shard_group, or give every node as many workers"
        )
    refusal = shard_group_refusal(worker.world_size, sizes[0])
    if refusal is not None:
        raise ConfigError(refusal)
    return int(sizes[0])


def hybrid_mesh(worker: Worker, shard_group: int) -> DeviceMesh:
    """The 2-D mesh ``(replicas, shard_group)``: row r is the shard group of ranks
    ``r * shard_group`` to ``(r + 1) * shard_group - 1``."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas = worker.world_size // shard_group
    return init_device_mesh(
        worker.device.type, (replicas, shard_group), mesh_dim_names=("replicate", "shard")
    )


def first_replica(mesh: DeviceMesh) -> bool:
    """Whether this rank is in the first replica group (whose shards the clipping norm counts)."""
    return mesh.get_local_rank("replicate") == 0
