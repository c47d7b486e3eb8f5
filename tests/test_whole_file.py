"""The whole model of a sharded checkpoint is put together streaming (``train.whole_file``): the
file is byte for byte what ``save_base_tensors`` writes for the same weights, only shards the
signed manifest vouches for are read, and no process holds more than one tensor plus a bounded
buffer while it writes or hashes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from govray.core.canonical import file_sha256
from govray.core.dsse import sign_envelope, signing_time
from govray.core.keys import KeyRole, SigningKey, TrustConfig, platform_trust
from govray.governance.adapter_files import save_base_tensors
from govray.platform.rerun.replay import tensor_influence
from govray.provenance.attest import AttestationError, model_subjects
from govray.train.checkpoints.files import (
    MANIFEST_FILE,
    MODEL_FILE,
    SIGNATURE_FILE,
    CheckpointError,
    Manifest,
    shard_file,
)
from govray.train.checkpoints.manifest import MANIFEST_TYPE
from govray.train.checkpoints.whole_file import (
    CHUNK,
    shard_layout,
    whole_model_sha256,
    whole_tensors,
    write_whole_model,
)
from govray.train.parallel.fsdp import SHARDS_KEY
from govray.train.step.ledger import Ledger, LedgerEntry
from tests.helpers.sharded_reference import consolidated


def sharded_checkpoint(
    directory: Path,
    state: dict[str, torch.Tensor],
    shards: int,
    replicas: int = 1,
    key: SigningKey | None = None,
) -> TrustConfig:
    """A signed checkpoint holding ``state`` as FSDP2 shards it (``Shard(0)``: ``torch.chunk``'s
    rows, empty shards for the last ranks of a short tensor, 0-d tensors whole in every file) over
    ``shards`` ranks, each shard group ``replicas`` times (HSDP), with the files already in
    ``directory`` (adapters); returns the trust that verifies it."""
    directory.mkdir(parents=True, exist_ok=True)
    world = shards * replicas
    for rank in range(world):
        index = rank % shards
        tensors: dict[str, torch.Tensor] = {}
        placement: dict[str, list[list[int]]] = {}
        for name, tensor in state.items():
            if tensor.dim() == 0:
                tensors[name] = tensor.clone()
                continue
            size = -(-tensor.shape[0] // shards)
            start = min(index * size, tensor.shape[0])
            tensors[name] = tensor[start : start + size].clone()
            placement[name] = [list(tensor.shape), [start] + [0] * (tensor.dim() - 1)]
        metadata = {SHARDS_KEY: json.dumps(placement, sort_keys=True)}
        save_file(tensors, str(directory / shard_file("model", rank, world)), metadata=metadata)
    (directory / "state.json").write_text("{}")
    key = key or SigningKey.generate(KeyRole.PLATFORM)
    files = {path.name: file_sha256(path) for path in sorted(directory.iterdir())}
    manifest = Manifest(run=directory.resolve().parent.name, step=0, files=files, signed_at=signing_time())
    (directory / MANIFEST_FILE).write_bytes(manifest.to_bytes())
    envelope = sign_envelope(manifest.to_bytes(), MANIFEST_TYPE, key, manifest.signed_at)
    (directory / SIGNATURE_FILE).write_text(envelope.to_json())
    return platform_trust(key)


def mixed_state() -> dict[str, torch.Tensor]:
    """Tensors of every kind a base model has: several dtypes, a tied pair, a buffer, a scalar,
    a tensor with fewer rows than ranks, rows that do not divide evenly."""
    generator = torch.Generator().manual_seed(0)
    embedding = torch.randn(7, 3, generator=generator)
    return {
        "embed.weight": embedding,
        "head.weight": embedding,  # tied: save_base_tensors stores a copy under each name
        "norm.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        "block.0.proj": torch.randn(2, 4, generator=generator).to(torch.float16),
        "block.0.bias": torch.randn(1, 4, generator=generator),
        "positions": torch.arange(3, dtype=torch.int64),
        "scale": torch.tensor(0.5),
        "empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize(("shards", "replicas"), [(3, 1), (2, 2)], ids=["fsdp-3", "hsdp-2x2"])
def test_the_streamed_whole_model_is_save_base_tensors_file_byte_for_byte(
    tmp_path: Path, shards: int, replicas: int
) -> None:
    state = mixed_state()
    trust = sharded_checkpoint(tmp_path / "checkpoint", state, shards, replicas)
    expected = save_base_tensors(state, tmp_path / "today.safetensors")

    written = write_whole_model(tmp_path / "checkpoint", trust, tmp_path / "streamed.safetensors")

    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "today.safetensors").read_bytes()
    assert written == expected == whole_model_sha256(tmp_path / "checkpoint", trust)
    tensors = dict(whole_tensors(tmp_path / "checkpoint", trust))
    assert list(tensors) == sorted(state)
    for name, tensor in state.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name


def test_a_changed_shard_is_refused_naming_it_before_anything_is_written(tmp_path: Path) -> None:
    trust = sharded_checkpoint(tmp_path / "checkpoint", mixed_state(), 2)
    shard = tmp_path / "checkpoint" / shard_file("model", 1, 2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))

    with pytest.raises(CheckpointError, match=f"{shard}: sha256 does not match the signed manifest"):
        write_whole_model(tmp_path / "checkpoint", trust, tmp_path / "streamed.safetensors")
    with pytest.raises(CheckpointError, match=f"{shard}: sha256 does not match the signed manifest"):
        whole_model_sha256(tmp_path / "checkpoint", trust)
    assert not (tmp_path / "streamed.safetensors").exists()


def test_shards_that_do_not_cover_a_tensor_are_refused_naming_it(tmp_path: Path) -> None:
    sharded_checkpoint(tmp_path, {"weight": torch.ones(4, 2)}, 2)
    with pytest.raises(CheckpointError, match="the shards of weight do not cover it: 2 of 4 rows"):
        shard_layout([tmp_path / shard_file("model", 0, 2)])
    with pytest.raises(CheckpointError, match="the shards of weight do not cover it: rows 0..2 are missing"):
        shard_layout([tmp_path / shard_file("model", 1, 2)])


def memory_kib(field: str) -> int:
    """This process's ``VmRSS`` or ``VmHWM`` (its peak since the last reset), in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def peak_growth(work: Callable[[], object]) -> int:
    """How far above its resident memory before ``work`` this process's peak went while it ran."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    before = memory_kib("VmRSS:")
    work()
    return (memory_kib("VmHWM:") - before) * 1024


def test_a_whole_model_of_shards_is_written_and_hashed_holding_one_chunk_not_one_tensor(
    tmp_path: Path,
) -> None:
    """Two 64 MiB tensors over two shards: writing and hashing the whole model (what the
    registry and an attestation of an FSDP checkpoint do) raises the peak by at most one chunk
    plus slack, far below one tensor; putting it together in memory (as rank 0 did at each
    validation's checkpoint) raises it by the whole model — the measure sees a tensor when one is held."""
    tensor_bytes = 64 << 20
    state = {
        f"layer.{index}.weight": torch.full((tensor_bytes // 4096, 1024), float(index)) for index in range(2)
    }
    trust = sharded_checkpoint(tmp_path / "checkpoint", state, 2)
    del state
    directory = tmp_path / "checkpoint"

    streamed = peak_growth(lambda: write_whole_model(directory, trust, tmp_path / "streamed.safetensors"))
    hashed = peak_growth(lambda: whole_model_sha256(directory, trust))
    held = peak_growth(lambda: consolidated(directory, 2))

    slack = 4 << 20
    assert max(streamed, hashed) <= CHUNK + slack < tensor_bytes, (streamed, hashed, held)
    assert held >= 2 * tensor_bytes, (streamed, hashed, held)


def test_an_fsdp_replay_lists_each_tensor_once_under_the_file_it_belongs_to(tmp_path: Path) -> None:
    """The influence table reads a sharded checkpoint's base from its shards put together: each
    base tensor once, under ``model.safetensors`` (not once more per shard file), each adapter
    tensor once under its adapter file."""
    key = SigningKey.generate(KeyRole.PLATFORM)
    original, replayed = mixed_state(), mixed_state()
    replayed["block.0.bias"] = replayed["block.0.bias"] + 1.0  # the only base tensor the replay changed
    adapter = {"lora.A": torch.ones(2, 3), "lora.B": torch.zeros(3, 2)}
    for name, state in (("original", original), ("replay", replayed)):
        (tmp_path / name).mkdir()
        save_file(adapter, str(tmp_path / name / "adapter-pii.safetensors"))
        trust = sharded_checkpoint(tmp_path / name, state, 2, key=key)

    ledger = Ledger({("pii", "lora.A"): LedgerEntry(examples=5)})
    rows = tensor_influence(tmp_path / "original", tmp_path / "replay", ledger, ("pii",), trust)

    assert [(row.file, row.tensor) for row in rows] == [
        *(("adapter-pii.safetensors", name) for name in sorted(adapter)),
        *((MODEL_FILE, name) for name in sorted(original)),
    ]
    changed = {row.tensor: row.distance for row in rows if row.distance}
    assert changed == {"block.0.bias": pytest.approx(2.0)}  # four entries, each one more
    assert {row.tensor: row.direct_examples for row in rows if row.direct_examples} == {"lora.A": 5}


def test_an_attestation_names_the_whole_model_a_sharded_checkpoint_puts_together(tmp_path: Path) -> None:
    """What ``govray attest`` and ``govray verify`` compute for a sharded checkpoint: the digest
    of the whole file an unsharded checkpoint of the same weights holds; a changed shard refused."""
    state = mixed_state()
    (tmp_path / "checkpoint").mkdir()
    save_file({"lora.A": torch.ones(2, 3)}, str(tmp_path / "checkpoint" / "adapter-pii.safetensors"))
    trust = sharded_checkpoint(tmp_path / "checkpoint", state, 2)
    adapter = file_sha256(tmp_path / "checkpoint" / "adapter-pii.safetensors")

    assert model_subjects(tmp_path / "checkpoint", trust) == [
        {"name": MODEL_FILE, "digest": {"sha256": save_base_tensors(state, tmp_path / MODEL_FILE)}},
        {"name": "adapter-pii.safetensors", "digest": {"sha256": adapter}},
    ]
    shard = tmp_path / "checkpoint" / shard_file("model", 0, 2)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(AttestationError, match=f"{shard}: sha256 does not match the signed manifest"):
        model_subjects(tmp_path / "checkpoint", trust)
