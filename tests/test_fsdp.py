"""Governed FSDP2 keeps the governed allreduce's promises, in one persistent 2-process gloo group
running the golden run's governed step: the sharded update equals DDP's (within fp32 rounding:
the reduce-scatter sums in another order), a tensor no slot may update stays bit-identical under
AdamW with weight decay (fp32, and bf16 mixed precision with gradient accumulation), and a
non-finite gradient stops every rank at the boundary naming the tensor and the route."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from govray.config.experiment import ExperimentConfig
from govray.core.settings import operator_trust
from govray.governance.adapter_files import save_base_tensors
from govray.train.checkpoints.files import MODEL_FILE, shard_file, shard_owner
from govray.train.checkpoints.whole_file import write_whole_model
from jobs.examples.digits.golden import EXAMPLE_CONFIG
from tests.helpers.engine import run_spec
from tests.helpers.fsdp import PUBLIC, WORLD, Task, assert_resumed_exactly, rank_main, weights
from tests.helpers.gloo_group import persistent_group
from tests.helpers.golden import GoldenRun
from tests.helpers.sharded_reference import consolidated


@pytest.fixture(scope="module")
def gloo_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with persistent_group(rank_main, tmp_path_factory.mktemp("fsdp"), WORLD, timeout=240) as run:
        yield run


def test_the_sharded_update_equals_the_ddp_update(gloo_pair: Any, golden_run: GoldenRun) -> None:
    """10 steps of the golden trial (3 routes, the PII adapter, per-group clipping at 0.25,
    AdamW with weight decay): FSDP's weights equal DDP's within fp32 rounding, element by element."""
    spec = run_spec(golden_run).model_dump_json()
    ddp_before, ddp = weights(gloo_pair, Task(spec, "ddp"))
    fsdp_before, fsdp = weights(gloo_pair, Task(spec, "fsdp"))
    assert ddp.keys() == fsdp.keys()
    assert any(".lora_" in name for name in ddp), "the adapter is in play"
    for name in ddp:
        assert torch.equal(ddp_before[name], fsdp_before[name]), f"{name}: the same initial weights"
        assert not torch.equal(ddp_before[name], ddp[name]), (
            f"{name}: trained (the comparison is not vacuous)"
        )
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "training",
    [(), (("precision", "bf16"), ("accumulation_steps", 2))],
    ids=["fp32", "bf16-accumulation"],
)
def test_a_tensor_no_slot_may_update_is_bit_identical_under_adamw_with_decay(
    gloo_pair: Any, golden_run: GoldenRun, training: tuple[tuple[str, Any], ...]
) -> None:
    """Without the public corpus no slot may update the embedding: after 10 sharded AdamW steps
    with weight decay it is the initial embedding bit for bit, while what the licensed and PII
    routes may update trained."""
    spec = run_spec(golden_run).model_dump_json()
    before, after = weights(gloo_pair, Task(spec, "fsdp", excluded=(PUBLIC,), training=training))
    embedding = [name for name in before if name.startswith("base.embed.")]
    assert embedding
    for name in before:
        if name in embedding:
            assert torch.equal(before[name], after[name]), name
        else:
            assert not torch.equal(before[name], after[name]), f"{name} trained"


def test_a_resume_from_the_sharded_checkpoint_is_bit_identical(
    gloo_pair: Any, signing_spec: Any, tmp_path: Path
) -> None:
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", resume_at=4))
    assert answers[1][0] == "ok", answers[1]
    status, (uninterrupted, again, *_) = answers[0]
    assert status == "ok"
    folder = Path(signing_spec.run_dir) / "checkpoint_00000004"
    assert {shard_owner(path.name) for path in folder.iterdir()} == {None, 0, 1}, "each rank wrote its shards"
    assert not (folder / MODEL_FILE).exists()
    # The whole model streamed from these shards is the file the shards put together in memory give.
    in_memory = save_base_tensors(consolidated(folder, WORLD), tmp_path / MODEL_FILE)
    assert write_whole_model(folder, operator_trust(), tmp_path / "streamed.safetensors") == in_memory
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], again[name]), name


@pytest.mark.parametrize(
    "name",
    [shard_file(kind, rank, WORLD) for kind in ("model", "optimizer") for rank in range(WORLD)]
    + [
        "adapter-pii-lora.safetensors",
        "optimizer.json",
        "state.json",
    ],
)
def test_a_flipped_byte_in_any_file_of_a_sharded_checkpoint_is_refused_on_every_rank_naming_it(
    gloo_pair: Any, signing_spec: Any, name: str
) -> None:
    """The rank that reads the file refuses it; the other rank refuses too (with that rank's
    message) instead of resuming alone."""
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", resume_at=2, tamper=name))
    for rank, (status, message) in answers.items():
        assert status == "refused", (rank, status, message)
        assert f"{name}: sha256 does not match the signed manifest (tampered)" in message, message


@pytest.mark.parametrize(
    ("strategy", "resumed_as"), [("ddp", "fsdp"), ("fsdp", "ddp")], ids=["ddp-to-fsdp", "fsdp-to-ddp"]
)
def test_a_checkpoint_of_the_other_strategy_resumes_with_its_exact_state(
    gloo_pair: Any, signing_spec: Any, strategy: str, resumed_as: str
) -> None:
    """DDP -> FSDP and FSDP -> DDP on the same world size (the schedule unchanged): each rank
    reads its rows by verified ranges; the resumed weights and optimizer state (exp_avg,
    exp_avg_sq, step) are the checkpointed ones bit for bit, the ledger continues exactly, and
    the weights trained on equal the uninterrupted run's within the DDP/FSDP rounding (the
    allreduce and the reduce-scatter sum in another order)."""
    task = Task(signing_spec.model_dump_json(), strategy, resume_at=4, resumed_as=(resumed_as, WORLD))
    assert_resumed_exactly(gloo_pair(task))


@pytest.mark.parametrize(
    ("strategy", "resumed_as", "name"),
    [
        ("ddp", "fsdp", MODEL_FILE),
        ("ddp", "fsdp", "optimizer.safetensors"),
        ("fsdp", "ddp", shard_file("model", 1, WORLD)),
        ("fsdp", "ddp", shard_file("optimizer", 0, WORLD)),
    ],
)
def test_a_flipped_byte_in_a_range_a_rank_reads_is_refused_on_every_rank_naming_the_file(
    gloo_pair: Any, signing_spec: Any, strategy: str, resumed_as: str, name: str
) -> None:
    """Read by ranges (another strategy): the block holding the byte fails its signed digest on
    the rank that reads it, and every rank refuses with that rank's message."""
    task = Task(
        signing_spec.model_dump_json(), strategy, resume_at=2, tamper=name, resumed_as=(resumed_as, WORLD)
    )
    for rank, (status, message) in gloo_pair(task).items():
        assert status == "refused", (rank, status, message)
        assert re.search(
            rf"{name}: block \d+ does not match its signed block digest \(tampered\)", message
        ), message


def test_an_fsdp_rollback_restores_the_clean_state_from_storage(gloo_pair: Any, signing_spec: Any) -> None:
    """No clean state is kept in memory: a rollback reads the signed checkpoint of the clean step
    (its own shards, or the copies a later checkpoint carries), bit for bit."""
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", rollback=True))
    assert answers[1][0] == "ok", answers[1]
    status, (clean, first, second, initial, carried) = answers[0]
    assert status == "ok"
    assert {shard_owner(name) for name in carried} == {None, 0, 1}, carried  # each rank carried its own
    assert all(name.startswith("clean-00000004-") for name in carried), carried
    assert any(not torch.equal(clean[name], initial[name]) for name in clean), "training moved it"
    for name in clean:
        assert torch.equal(first[name], clean[name]), name
        assert torch.equal(second[name], clean[name]), name


@pytest.mark.parametrize("name", [shard_file("model", 1, WORLD), "optimizer.json"])
def test_a_tampered_clean_state_is_never_carried_into_a_new_checkpoint(
    gloo_pair: Any, signing_spec: Any, name: str
) -> None:
    """The checkpoint that carries a clean state checks each file against its signed manifest
    first: a byte flipped since is refused (on every rank), never signed again."""
    answers = gloo_pair(Task(signing_spec.model_dump_json(), "fsdp", rollback=True, tamper=name))
    for rank, (status, message) in answers.items():
        assert status == "refused", (rank, status, message)
        assert f"checkpoint_00000004/{name}: sha256 does not match its signed manifest" in message, message


def test_a_non_finite_gradient_stops_every_rank_naming_tensor_and_route(
    gloo_pair: Any, golden_run: GoldenRun
) -> None:
    """NaN losses on rank 1 from step 3: both ranks refuse at the boundary with the same message,
    naming the step, tensors and routes (each rank flags its own shards; the boundary all-reduces
    the flags)."""
    answers = gloo_pair(Task(run_spec(golden_run).model_dump_json(), "fsdp", nan_step=3))
    assert {status for status, _ in answers.values()} == {"nonfinite"}, answers
    messages = {message for _, message in answers.values()}
    assert len(messages) == 1, messages
    (message,) = messages
    match = re.match(
        r"step (\d+): non-finite gradient in (.+) from a slot allowed to update it \(routes (.+)\)", message
    )
    assert match is not None, message
    assert int(match.group(1)) >= 3


def test_fsdp_is_validated() -> None:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    with pytest.raises(
        ValueError, match="strategy fsdp shards the model across workers: it needs workers >= 2"
    ):
        ExperimentConfig.model_validate({**raw, "resources": {"strategy": "fsdp"}})
    with pytest.raises(ValueError, match="precision fp16 with strategy fsdp: use bf16"):
        ExperimentConfig.model_validate(
            {**raw, "resources": {"strategy": "fsdp", "workers": 2}, "training": {"precision": "fp16"}}
        )
    config = ExperimentConfig.model_validate({**raw, "resources": {"strategy": "fsdp", "workers": 2}})
    assert config.model_dump(mode="json")["resources"]["strategy"] == "fsdp"
    default = ExperimentConfig.model_validate({**raw, "resources": {"workers": 2}})
    assert "strategy" not in default.model_dump(mode="json")["resources"], "ddp leaves digests as they were"
