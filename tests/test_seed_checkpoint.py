"""Meta-device build under FSDP: rank 0 writes the seed checkpoint once, every rank builds the
model on meta, is sharded, and fills its shards from the seed; every tensor of every rank equals
the slice of today's full build bit for bit (the digits model, the hf_lm example's tiny Llama with
PEFT LoRA layers, a ``from_pretrained`` bf16 Llama), the forward is today's, a trial that cannot
be built on meta is built whole as before, and a flipped byte in the seed is refused on every rank
naming the file. Two spawned gloo ranks (``tests/helpers/gloo_group.py``): their start-up (~15 s, more on
a loaded machine) puts the module in the slow tier; in the default tier
``tests/test_fsdp.py::test_the_sharded_update_equals_the_ddp_update`` holds the golden trial's
initial weights under FSDP (meta + seed) equal to DDP's (whole build)."""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from jobs.examples.digits.trial import DigitsTrial
from tests.helpers.gloo_group import persistent_group

pytestmark = pytest.mark.slow

WORLD = 2
DIGITS = "jobs.examples.digits.trial:DigitsTrial"
TINY_LLAMA = "jobs.examples.hf_lm.trial:TinyLlamaTrial"
LLAMA = {
    "model_type": "llama",
    "vocab_size": 257,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 129,
    "tie_word_embeddings": True,
}  # the hf_lm example's model


class DigitsWithoutMeta(DigitsTrial):
    """A trial whose model cannot be built on the meta device."""

    def build_meta_model(self) -> nn.Module:
        raise RuntimeError("this model loads weights while it is built")


@dataclass(frozen=True)
class Case:
    trial: str
    hparams: dict[str, Any]
    targets: tuple[str, ...]  # the LoRA adapter's targets (PEFT layers injected there)
    run_dir: str
    tamper: bool = False  # rank 0 flips a byte of the seed before the ranks read it


def policy(targets: tuple[str, ...]) -> Any:
    from govray.governance.policy import DepthPolicy

    return DepthPolicy.model_validate(
        {
            "name": "seed",
            "version": 1,
            "adapters": {"pii-lora": {"targets": list(targets), "rank": 4, "alpha": 8}},
            "rules": [
                {"name": "public", "match": {"license_class": "permissive"}, "route": "all"},
                {"name": "pii", "match": {"corpus_id": "pii"}, "route": {"adapter": "pii-lora"}},
            ],
        }
    )


def rank_main(rank: int, init_file: str, tasks: Any, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    while (case := tasks.get()) is not None:
        try:
            results.put((rank, *(compared(case, rank) if isinstance(case, Case) else started())))
        except Exception:
            results.put((rank, "crash", traceback.format_exc()))
    dist.destroy_process_group()


def started() -> tuple[str, None]:
    """What every case imports, imported (a rank's start-up)."""
    for name in (
        "torch.distributed.fsdp",
        "transformers",
        "govray.train.hf",
        "govray.train.checkpoints.seed",
    ):
        importlib.import_module(name)
    return "ok", None


def compared(case: Case, rank: int) -> tuple[str, Any]:
    """This rank's sharded model from the seed against today's full build: ``("ok", (meta,
    tensors compared, names that differ, forward equal))`` or ``("refused", message)``."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from govray.config.training import Precision
    from govray.core.storage import IN_PLACE
    from govray.governance.adapters import GovernedModel
    from govray.governance.routing import resolve_routes
    from govray.train.checkpoints.files import CheckpointError
    from govray.train.checkpoints.seed import SeedCheckpoint, initial_model
    from govray.train.parallel.fsdp import layer_units, local, shard_model
    from govray.train.parallel.worker import Worker
    from govray.train.runspec import RunSpec
    from govray.train.trial import make_trial

    spec = RunSpec.model_construct(seed=11, trial_seed=3, run_dir=case.run_dir, storage="")
    trial = make_trial(case.trial, case.hparams)
    rules = policy(case.targets)

    def governed(base: nn.Module) -> GovernedModel:
        return GovernedModel(base, resolve_routes(rules, base, trial.layers(base)), rules.adapters, seed=5)

    today = governed(initial_model(spec, trial))  # what every rank built before
    seed = SeedCheckpoint.agree(spec, Worker.detect(), IN_PLACE, trial)
    base = seed.skeleton()
    meta = all(parameter.is_meta for parameter in base.parameters())
    model = governed(base)
    shard_model(model, layer_units(base, trial.fsdp_units(base)), Precision.FP32, torch.device("cpu"))
    if case.tamper:
        assert seed.path is not None
        if rank == 0:
            data = bytearray(seed.path.read_bytes())
            data[len(data) // 2] ^= 0x01
            seed.path.write_bytes(bytes(data))
        dist.barrier()
    try:
        seed.fill(model, torch.device("cpu"))
    except CheckpointError as error:
        return "refused", str(error)
    expected = dict(today.named_parameters()) | dict(today.named_buffers())
    mine = dict(model.named_parameters()) | dict(model.named_buffers())
    assert mine.keys() == expected.keys(), sorted(mine.keys() ^ expected.keys())
    differ = []
    for name, tensor in mine.items():
        whole = expected[name].detach()
        if isinstance(tensor, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            whole = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        part = local(tensor).detach()
        if part.dtype != whole.dtype or not torch.equal(part, whole):
            differ.append(name)
    forward = None
    if "model" in case.hparams or "pretrained" in case.hparams:  # a Llama: rotary buffers in play
        ids = torch.arange(2 * 16).view(2, 16) % 250 + 1
        with torch.no_grad():
            forward = torch.equal(model(input_ids=ids).logits, today(input_ids=ids).logits)
    return "ok", (meta, len(mine), differ, forward)


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with persistent_group(rank_main, tmp_path_factory.mktemp("seed"), WORLD, timeout=120) as run:
        run("started")  # the ranks' start-up is the fixture's time, not the first test's
        yield run


@pytest.fixture(scope="module")
def pretrained_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved in bf16 (``from_pretrained`` loads it so; the meta build from its
    config would be fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("pretrained")
    settings = dict(LLAMA)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def answered(gloo_pair: Any, case: Case) -> list[tuple[bool, int, list[str], bool | None]]:
    answers = gloo_pair(case)
    for rank, (status, payload) in answers.items():
        assert status == "ok", f"rank {rank}: {payload}"
    return [answers[rank][1] for rank in range(WORLD)]


@pytest.mark.parametrize(
    "trial, hparams, targets",
    [
        (DIGITS, {"hidden": 48, "dropout": 0.1}, ("hidden",)),
        (TINY_LLAMA, {"context": 128, "model": LLAMA}, ("model.layers.*.self_attn.q_proj",)),
        ("govray.train.hf:CausalLMTrial", {"context": 32}, ("model.layers.*.self_attn.v_proj",)),
    ],
    ids=["digits", "hf_lm-peft", "from_pretrained-bf16"],
)
def test_meta_init_from_the_seed_is_todays_init_bit_for_bit(
    gloo_pair: Any, pretrained_bf16: Path, tmp_path: Path, trial: str, hparams: dict[str, Any], targets: Any
) -> None:
    if "context" in hparams and "model" not in hparams:
        hparams = {**hparams, "pretrained": str(pretrained_bf16)}
    for meta, compared_count, differ, forward in answered(
        gloo_pair, Case(trial, hparams, targets, str(tmp_path))
    ):
        assert meta, "the model was built on the meta device, not whole"
        assert compared_count > 4 and differ == [], differ
        assert forward in (None, True), "the sharded forward gives today's logits"
    seeds = list((tmp_path / "seed").glob("*.safetensors"))
    assert len(seeds) == 1, "one seed file, written once by rank 0"


def test_a_trial_that_cannot_build_on_meta_is_built_whole_with_todays_init(
    gloo_pair: Any, tmp_path: Path
) -> None:
    case = Case(
        "tests.test_seed_checkpoint:DigitsWithoutMeta",
        {"hidden": 48, "dropout": 0.1},
        ("hidden",),
        str(tmp_path),
    )
    for meta, compared_count, differ, _ in answered(gloo_pair, case):
        assert not meta
        assert compared_count > 4 and differ == [], differ


def test_a_flipped_byte_in_the_seed_is_refused_on_every_rank_naming_the_file(
    gloo_pair: Any, tmp_path: Path
) -> None:
    case = Case(DIGITS, {"hidden": 48, "dropout": 0.1}, ("hidden",), str(tmp_path), tamper=True)
    answers = gloo_pair(case)
    for rank, (status, message) in answers.items():
        assert status == "refused", f"rank {rank}: {message}"
        assert "seed/" in message and "tampered" in message, message
