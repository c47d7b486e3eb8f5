"""A 4-rank FSDP2 checkpoint (``sharding.write_shards``, after an AdamW step) loaded by real FSDP2
ranks of another world size (gloo, 2 and 3 ranks): every rank holds exactly its slices of the
consolidated tensors, weights and optimizer state (exp_avg, exp_avg_sq, step), bit for bit; it
read its share plus a bounded block overhead; a flipped byte in a block one rank reads is
refused on every rank, naming the file. A 4-rank HSDP checkpoint (2 shard groups of 2, every
rank writing its files) loads the same way from its first replica's files alone."""

from __future__ import annotations

import functools
import json
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from govray.train.checkpoints.files import shard_file
from tests.helpers.gloo_group import persistent_group

pytestmark = pytest.mark.slow  # three gloo groups (4, 2 and 3 spawned ranks)

SOURCE_WORLD = 4
SHARD_GROUP = 2  # the HSDP checkpoint's: 2 replicas of 2 shards
BLOCK = 4096  # small blocks, so that a rank's share is many of them


class Plain(nn.Module):
    """The part of ``GovernedModel`` the shard readers and writers use: a base, no adapters."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Sequential(nn.Linear(64, 2003), nn.ReLU(), nn.Linear(2003, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)

    def base_state(self) -> dict[str, torch.Tensor]:
        return dict(self.base.state_dict())

    def adapter_names(self) -> list[str]:
        return []


def rank_main(rank: int, init_file: str, tasks: Any, results: Any, world: int) -> None:
    import torch.distributed as dist

    import govray.train.checkpoints.blocks

    torch.set_num_threads(1)
    govray.train.checkpoints.blocks.BLOCK_SIZE = BLOCK
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    while (task := tasks.get()) is not None:
        try:
            results.put((rank, *task[0](rank, world, *task[1:])))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


def sharded(seed: int, world: int, shard_group: int | None = None) -> tuple[Plain, torch.optim.Optimizer]:
    """The model ``fully_shard``ed over ``world`` ranks (each Linear a unit; HSDP: sharded within
    groups of ``shard_group``, replicated across them, as ``train.hybrid``), and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Plain(seed)
    if shard_group is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh(
            "cpu", (world // shard_group, shard_group), mesh_dim_names=("replicate", "shard")
        )
    for unit in (model.base[0], model.base[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def write(rank: int, world: int, directory: Path, shard_group: int | None = None) -> tuple[str, Any]:
    """One AdamW step, then this rank's shard files and their block digests (side files a
    manifest lists, as a seed's: the signer keeps a checkpoint's in its manifest); rank 0 also
    writes ``optimizer.json`` and the whole tensors (``expected.safetensors``): every file's
    digest."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from govray.core.canonical import file_sha256
    from govray.train.checkpoints.blocks import write_blocks
    from govray.train.checkpoints.files import OPTIMIZER_META, split_optimizer_state
    from govray.train.parallel.fsdp import local_optimizer_state, write_shards

    model, optimizer = sharded(0, world, shard_group)
    model(torch.randn(5, 64, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    optimizer.step()
    written: dict[str, str] = {}
    for name in write_shards(directory, model, optimizer, rank, world):  # type: ignore[arg-type]
        written |= write_blocks(directory / name)  # the digests a manifest lists (side files, as a seed's)
    names = {id(p): name for name, p in model.base.named_parameters()}
    expected = {f"model.{name}": t.full_tensor() for name, t in model.base_state().items()}
    for p, values in optimizer.state.items():
        for key, value in values.items():
            expected[f"optimizer.{names[id(p)]}.{key}"] = (
                value.full_tensor() if isinstance(value, DTensor) else value
            )
    if rank == 0:
        meta = split_optimizer_state(local_optimizer_state(optimizer.state_dict()))[1]
        (directory / OPTIMIZER_META).write_text(json.dumps(meta))
        written[OPTIMIZER_META] = file_sha256(directory / OPTIMIZER_META)
        save_file({k: v.contiguous() for k, v in expected.items()}, str(directory / "expected.safetensors"))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, written)
    return "ok", {name: digest for part in gathered for name, digest in part.items()}


def load(
    rank: int, world: int, directory: Path, files: dict[str, str], shard_group: int | None = None
) -> tuple[str, Any]:
    """This rank's part of the 4-rank checkpoint (HSDP: in groups of ``shard_group``) into a
    differently initialised model sharded over ``world``: ``("ok", (mismatches, bytes read, share
    bytes))`` or ``("refused", message)``."""
    from govray.train.checkpoints.files import CheckpointError
    from govray.train.checkpoints.manifest import Manifest
    from govray.train.checkpoints.reshard import load_model_part, my_rows, resharded_optimizer_state
    from govray.train.parallel.fsdp import local, sharded_optimizer_state
    from govray.train.parallel.worker import Worker, agreed

    model, optimizer = sharded(seed=99, world=world)
    parameters = list(model.parameters())

    def read() -> tuple[Any, Any, dict[str, Any]]:
        weights = load_model_part(
            model, directory, Manifest.model_construct(files=files), SOURCE_WORLD, shard_group
        )
        state, moments = resharded_optimizer_state(
            directory, Manifest.model_construct(files=files), SOURCE_WORLD, optimizer, parameters, shard_group
        )
        return weights, moments, state

    try:
        weights, moments, state = agreed(read, Worker(rank, world), CheckpointError)
    except CheckpointError as error:
        return "refused", str(error)
    optimizer.load_state_dict(sharded_optimizer_state(optimizer, state))
    expected = load_file(str(directory / "expected.safetensors"))
    mismatches, share = [], 0
    for name, parameter in model.base.named_parameters():
        start, stop = my_rows(parameter)
        mine = local(parameter).detach()
        share += 3 * mine.numel() * mine.element_size()  # the weights, exp_avg and exp_avg_sq
        if not torch.equal(mine, expected[f"model.{name}"][start:stop]):
            mismatches.append(f"model.{name}")
        for key, value in optimizer.state[parameter].items():
            whole = expected[f"optimizer.{name}.{key}"]
            if not torch.equal(local(value), whole[start:stop] if whole.dim() else whole):
                mismatches.append(f"optimizer.{name}.{key}")
    return "ok", (mismatches, weights.bytes_read + moments.bytes_read, share)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    target = functools.partial(rank_main, world=SOURCE_WORLD)
    with persistent_group(target, tmp_path_factory.mktemp("gloo4"), SOURCE_WORLD, timeout=240) as run:
        yield run


def _written(run: Any, directory: Path, shard_group: int | None = None) -> tuple[Path, dict[str, str]]:
    answers = run((write, directory, shard_group))
    assert all(status == "ok" for status, _ in answers.values()), answers
    return directory, answers[0][1]


@pytest.fixture(scope="module")
def checkpoint(four_ranks: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    return _written(four_ranks, tmp_path_factory.mktemp("four-ranks"))


@pytest.fixture(scope="module")
def hsdp_checkpoint(four_ranks: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    return _written(four_ranks, tmp_path_factory.mktemp("hsdp-2x2"), SHARD_GROUP)


@pytest.fixture(scope="module", params=[2, 3])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    target = functools.partial(rank_main, world=request.param)
    with persistent_group(target, tmp_path_factory.mktemp("gloo"), request.param, timeout=240) as run:
        yield request.param, run


def test_a_four_rank_checkpoint_loads_on_another_world_size_exactly_and_by_ranges(
    checkpoint: tuple[Path, dict[str, str]], group: tuple[int, Any]
) -> None:
    directory, files = checkpoint
    world, run = group
    assert any(name.endswith(".blocks.json") for name in files)
    answers = run((load, directory, files))
    total = sum((directory / name).stat().st_size for name in files if name.endswith("safetensors"))
    for rank, (status, payload) in answers.items():
        assert status == "ok", (rank, payload)
        mismatches, read, share = payload
        assert not mismatches, (rank, mismatches)
        # Its share, plus per file (4 model, 4 optimizer) its header (< a block) and a block at
        # each end of each of its 5 tensors' ranges: never the whole checkpoint.
        assert share <= read <= share + 2 * SOURCE_WORLD * BLOCK * (1 + 2 * 5), (rank, read, share)
        assert read < total / world + total / 4, (rank, read, total)


def test_a_flipped_byte_one_rank_reads_is_refused_on_every_rank_naming_the_file(
    checkpoint: tuple[Path, dict[str, str]], group: tuple[int, Any], tmp_path: Path
) -> None:
    """A copy of the checkpoint with a byte flipped at the end of source rank 3's model shard
    (the last tensor of the file: rows only the last new rank reads)."""
    source, files = checkpoint
    _, run = group
    directory = tmp_path / "copy"
    directory.mkdir()
    for name in [*files, "expected.safetensors"]:
        (directory / name).write_bytes((source / name).read_bytes())
    tampered = directory / shard_file("model", 3, SOURCE_WORLD)
    data = bytearray(tampered.read_bytes())
    data[-5] ^= 0x01
    tampered.write_bytes(bytes(data))
    for rank, (status, message) in run((load, directory, files)).items():
        assert status == "refused", (rank, status, message)
        assert f"{tampered}: block" in message and "does not match its signed block digest" in message


def test_an_hsdp_checkpoint_loads_on_another_world_size_from_its_first_replica(
    hsdp_checkpoint: tuple[Path, dict[str, str]], group: tuple[int, Any]
) -> None:
    """Every rank of the 2 x 2 HSDP checkpoint wrote its files (the second replica's the first's
    copies); a rank of 2 or 3 FSDP ranks reads its exact slices from the first replica's files,
    within the same bound (2 files of each kind, not 4), bit for bit."""
    directory, files = hsdp_checkpoint
    _, run = group
    for kind in ("model", "optimizer"):
        for rank in range(SHARD_GROUP, SOURCE_WORLD):  # the second replica: copies of the first
            twin = shard_file(kind, rank % SHARD_GROUP, SOURCE_WORLD)
            assert files[shard_file(kind, rank, SOURCE_WORLD)] == files[twin], (kind, rank)
    for rank, (status, payload) in run((load, directory, files, SHARD_GROUP)).items():
        assert status == "ok", (rank, payload)
        mismatches, read, share = payload
        assert not mismatches, (rank, mismatches)
        assert share <= read <= share + 2 * SHARD_GROUP * BLOCK * (1 + 2 * 5), (rank, read, share)
