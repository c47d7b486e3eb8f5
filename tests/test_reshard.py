"""Resharding reads (``train.ranged``, ``train.reshard``): a rank's rows of a checkpoint written by
another layout are exactly the slices of the whole tensors, read by verified byte ranges; a rank
reads its share plus bounded block overhead, and a flipped byte in any block it reads is refused
naming the file. Files written here as FSDP2 writes them (``sharding.write_shards``: dim-0 chunks,
placement metadata for the model, none for the optimizer), with small blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from govray.train.checkpoints.blocks import write_blocks
from govray.train.checkpoints.files import MODEL_FILE, OPTIMIZER_TENSORS, CheckpointError, shard_file
from govray.train.checkpoints.manifest import Manifest
from govray.train.checkpoints.reshard import CheckpointTensors
from govray.train.parallel.fsdp import SHARDS_KEY

BLOCK = 4096
SOURCE_WORLD = 4


def fsdp_rows(rank: int, world: int, rows: int) -> tuple[int, int]:
    """FSDP2's dim-0 chunk of ``rank`` (``torch.chunk``: ceil(rows / world) rows each)."""
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def model_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(1000, 64, generator=generator),  # 250 KiB: many blocks
        "head.bias": torch.randn(3, generator=generator),  # fewer rows than ranks
        "norm.weight": torch.randn(10, 7, generator=generator).to(torch.bfloat16),
    }


def optimizer_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return {
        "state.0.exp_avg": torch.randn(1000, 64, generator=generator),
        "state.0.exp_avg_sq": torch.rand(1000, 64, generator=generator),
        "state.0.step": torch.tensor(7.0),  # a scalar: whole in every shard file
    }


def write_sharded(directory: Path, whole: dict[str, torch.Tensor], kind: str, world: int) -> dict[str, str]:
    """``world`` shard files of ``whole`` as ``write_shards`` lays them out; their digests."""
    digests: dict[str, str] = {}
    for rank in range(world):
        part, placement = {}, {}
        for name, tensor in whole.items():
            if tensor.dim() == 0:
                part[name] = tensor
                continue
            start, stop = fsdp_rows(rank, world, tensor.shape[0])
            part[name] = tensor[start:stop].clone()
            placement[name] = [list(tensor.shape), [start] + [0] * (tensor.dim() - 1)]
        layout = placement if kind == "model" else {}
        path = directory / shard_file(kind, rank, world)
        save_file(part, str(path), metadata={SHARDS_KEY: json.dumps(layout, sort_keys=True)})
        digests |= write_blocks(path, BLOCK)
    return digests


def listed(files: dict[str, str]) -> Manifest:
    """A manifest listing ``files`` (with their side files of block digests, as a seed lists them)."""
    return Manifest.model_construct(files=files)


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    files = write_sharded(tmp_path, model_tensors(), "model", SOURCE_WORLD)
    files |= write_sharded(tmp_path, optimizer_tensors(), "optimizer", SOURCE_WORLD)
    return tmp_path, files


@pytest.mark.parametrize("world", [2, 3])
def test_every_new_rank_reads_exactly_the_slices_of_the_whole_tensors(
    sharded: tuple[Path, dict[str, str]], world: int
) -> None:
    directory, files = sharded
    for kind, whole in (("model", model_tensors()), ("optimizer", optimizer_tensors())):
        for rank in range(world):
            source = CheckpointTensors(directory, listed(files), kind, SOURCE_WORLD)
            for name, tensor in whole.items():
                start, stop = fsdp_rows(rank, world, tensor.shape[0]) if tensor.dim() else (0, 0)
                part = source.part(name, tuple(tensor.shape), start, stop)
                expected = tensor[start:stop] if tensor.dim() else tensor
                assert part.dtype == tensor.dtype, name
                assert torch.equal(part, expected), (kind, rank, name)


def test_an_unsharded_checkpoint_gives_each_rank_its_slices(tmp_path: Path) -> None:
    """DDP -> FSDP: the ranks' rows of ``model.safetensors`` and ``optimizer.safetensors``."""
    files: dict[str, str] = {}
    for name, whole in ((MODEL_FILE, model_tensors()), (OPTIMIZER_TENSORS, optimizer_tensors())):
        save_file(whole, str(tmp_path / name))
        files |= write_blocks(tmp_path / name, BLOCK)
    for kind, whole in (("model", model_tensors()), ("optimizer", optimizer_tensors())):
        for rank in range(2):
            source = CheckpointTensors(tmp_path, listed(files), kind, None)
            for name, tensor in whole.items():
                start, stop = fsdp_rows(rank, 2, tensor.shape[0]) if tensor.dim() else (0, 0)
                expected = tensor[start:stop] if tensor.dim() else tensor
                assert torch.equal(source.part(name, tuple(tensor.shape), start, stop), expected)


def test_a_rank_reads_its_share_and_a_bounded_block_overhead(sharded: tuple[Path, dict[str, str]]) -> None:
    """On 3 ranks each reads about a third of the 4-rank files: its rows' bytes, plus at most a
    block at each end of each range and each file's header (checked by its own digest), never
    the whole model."""
    directory, files = sharded
    total = sum((directory / shard_file("model", rank, SOURCE_WORLD)).stat().st_size for rank in range(4))
    embed = model_tensors()["embed.weight"]
    row = embed.shape[1] * embed.element_size()
    for rank in range(3):
        source = CheckpointTensors(directory, listed(files), "model", SOURCE_WORLD)
        start, stop = fsdp_rows(rank, 3, embed.shape[0])
        source.part("embed.weight", tuple(embed.shape), start, stop)
        pieces = sum(
            1 for r in range(4) if max(start, fsdp_rows(r, 4, 1000)[0]) < min(stop, fsdp_rows(r, 4, 1000)[1])
        )
        headers = sum(source.files[r].header()[0] for r in range(SOURCE_WORLD))
        bound = (stop - start) * row + 2 * BLOCK * pieces + headers
        assert (stop - start) * row <= source.bytes_read <= bound, (rank, source.bytes_read, bound)
        assert source.bytes_read < 0.6 * total, "not the whole model"


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_block_a_rank_reads_is_refused_naming_the_file(
    sharded: tuple[Path, dict[str, str]],
) -> None:
    """A byte flipped in the last block of rank 1's source file: new rank 0 (of 2), whose rows lie
    in source files 0 and 1, refuses naming it; new rank 1 never reads that block and is served."""
    directory, files = sharded
    tampered = directory / shard_file("model", 1, SOURCE_WORLD)
    flip(tampered, tampered.stat().st_size - 10)
    shape = tuple(model_tensors()["embed.weight"].shape)
    reader = CheckpointTensors(directory, listed(files), "model", SOURCE_WORLD)
    with pytest.raises(CheckpointError, match=rf"{tampered}: block \d+ does not match"):
        for name, tensor in model_tensors().items():  # the tail of the file holds norm.weight
            reader.part(name, tuple(tensor.shape), *fsdp_rows(0, 2, tensor.shape[0]))
    other = CheckpointTensors(directory, listed(files), "model", SOURCE_WORLD)
    assert other.part("embed.weight", shape, 500, 1000).shape == (500, 64)


def test_a_flipped_header_byte_and_a_tampered_block_list_are_refused(
    sharded: tuple[Path, dict[str, str]],
) -> None:
    directory, files = sharded
    path = directory / shard_file("model", 0, SOURCE_WORLD)
    flip(path, 20)
    with pytest.raises(CheckpointError, match=rf"{path}: its header does not match its signed digest"):
        CheckpointTensors(directory, listed(files), "model", SOURCE_WORLD).names()
    side = directory / (shard_file("model", 2, SOURCE_WORLD) + ".blocks.json")
    side.write_text(side.read_text().replace('"blocks":["', '"blocks":["0'))
    with pytest.raises(CheckpointError, match=rf"{side}: sha256 does not match the signed manifest"):
        CheckpointTensors(directory, listed(files), "model", SOURCE_WORLD)


def test_a_checkpoint_without_block_digests_is_verified_whole(tmp_path: Path) -> None:
    """Written before block digests: each file read is checked whole against its sha256."""
    files = write_sharded(tmp_path, model_tensors(), "model", SOURCE_WORLD)
    for name in [name for name in files if name.endswith(".blocks.json")]:
        del files[name]
    source = CheckpointTensors(tmp_path, listed(files), "model", SOURCE_WORLD)
    embed = model_tensors()["embed.weight"]
    assert torch.equal(source.part("embed.weight", tuple(embed.shape), 0, 334), embed[:334])
    tampered = tmp_path / shard_file("model", 3, SOURCE_WORLD)
    flip(tampered, tampered.stat().st_size - 10)
    fresh = CheckpointTensors(tmp_path, listed(files), "model", SOURCE_WORLD)
    with pytest.raises(CheckpointError, match=rf"{tampered}: sha256 does not match the signed manifest"):
        fresh.part("embed.weight", tuple(embed.shape), 667, 1000)
