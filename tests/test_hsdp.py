"""Governed HSDP (``strategy: hsdp``, shard groups of 2 on 4 gloo ranks: FSDP2 within each pair,
the pairs replicas of one another) keeps FSDP's promises, in one persistent 4-process group
running the golden run's governed step: its update equals the 4-rank FSDP update (within fp32
rounding: the sums run in another order; the per-route-group clipping norm counts each shard
once), a tensor no slot may update stays bit-identical, removing the adapter's corpus leaves
every base tensor bit-identical to the run with it (the replay without it), and a resume from
its checkpoint is bit-identical (each replica's shard files the same bytes as its twin's), and
a checkpoint of other shard groups (HSDP <-> FSDP, HSDP -> DDP) resumes with its exact state,
read by verified ranges from the first replica. The configuration refuses what HSDP cannot split."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from govray.config.experiment import ExperimentConfig
from govray.train.checkpoints.files import MODEL_FILE, shard_file, shard_owner
from jobs.examples.digits.golden import EXAMPLE_CONFIG
from tests.helpers.engine import run_spec
from tests.helpers.fsdp import PUBLIC, Task, assert_resumed_exactly, rank_main, weights
from tests.helpers.gloo_group import persistent_group
from tests.helpers.golden import GoldenRun

WORLD = 4
SHARD_GROUP = 2
ADAPTER_CORPUS = "digits-writers"  # trains the PII adapter only


@pytest.fixture(scope="module")
def gloo_four(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    target = functools.partial(rank_main, world=WORLD)
    with persistent_group(target, tmp_path_factory.mktemp("hsdp"), WORLD, timeout=300) as run:
        yield run


def hsdp(spec: Any) -> str:
    """``spec`` as JSON, its shard group 2 (the strategy is the task's)."""
    return spec.model_copy(update={"shard_group": SHARD_GROUP}).model_dump_json()


@pytest.mark.slow
def test_the_hsdp_update_equals_the_fsdp_update(gloo_four: Any, golden_run: GoldenRun) -> None:
    """10 steps of the golden trial (3 routes, the PII adapter, per-group clipping at 0.25,
    AdamW with weight decay) on 4 ranks: HSDP 2 x 2 equals FSDP over 4, element by element."""
    spec = hsdp(run_spec(golden_run))
    fsdp_before, fsdp = weights(gloo_four, Task(spec, "fsdp"))
    hsdp_before, hybrid = weights(gloo_four, Task(spec, "hsdp"))
    assert fsdp.keys() == hybrid.keys()
    assert any(".lora_" in name for name in fsdp), "the adapter is in play"
    for name in fsdp:
        assert torch.equal(fsdp_before[name], hsdp_before[name]), f"{name}: the same initial weights"
        assert not torch.equal(fsdp_before[name], fsdp[name]), f"{name}: trained (not vacuous)"
        torch.testing.assert_close(hybrid[name], fsdp[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_tensor_no_slot_may_update_is_bit_identical_under_hsdp(
    gloo_four: Any, golden_run: GoldenRun
) -> None:
    """Without the public corpus no slot may update the embedding: after 10 HSDP AdamW steps with
    weight decay (bf16, accumulation 2) it is the initial embedding bit for bit."""
    spec = hsdp(run_spec(golden_run))
    training = (("precision", "bf16"), ("accumulation_steps", 2))
    before, after = weights(gloo_four, Task(spec, "hsdp", excluded=(PUBLIC,), training=training))
    embedding = [name for name in before if name.startswith("base.embed.")]
    assert embedding
    for name in before:
        if name in embedding:
            assert torch.equal(before[name], after[name]), name
        else:
            assert not torch.equal(before[name], after[name]), f"{name} trained"


@pytest.mark.slow
def test_removing_the_adapter_is_the_replay_without_its_corpus_under_hsdp(
    gloo_four: Any, golden_run: GoldenRun
) -> None:
    """The adapter's corpus trains only the adapter: the HSDP run without it (the replay) has
    every base tensor bit-identical to the run with it, so dropping the adapter is the removal."""
    spec = hsdp(run_spec(golden_run))
    _, original = weights(gloo_four, Task(spec, "hsdp"))
    _, replay = weights(gloo_four, Task(spec, "hsdp", excluded=(ADAPTER_CORPUS,)))
    adapter = [name for name in original if ".lora_" in name]
    assert adapter and any(not torch.equal(original[name], replay[name]) for name in adapter), (
        "the adapter learned from its corpus"
    )
    for name in original:
        if name not in adapter:
            assert torch.equal(original[name], replay[name]), name


@pytest.mark.slow
def test_a_resume_from_the_hsdp_checkpoint_is_bit_identical(gloo_four: Any, signing_spec: Any) -> None:
    """Every rank, replicas included, writes its own shards (and reads them back); a replica's
    files are its first group's twin's byte for byte (the replicas never drift apart)."""
    answers = gloo_four(Task(hsdp(signing_spec), "hsdp", resume_at=4))
    assert all(status == "ok" for status, _ in answers.values()), answers
    _, (uninterrupted, again, *_) = answers[0]
    folder = Path(signing_spec.run_dir) / "checkpoint_00000004"
    assert {shard_owner(path.name) for path in folder.iterdir()} == {None, 0, 1, 2, 3}
    assert not (folder / MODEL_FILE).exists()
    for kind in ("model", "optimizer"):
        for rank in range(SHARD_GROUP, WORLD):
            twin = folder / shard_file(kind, rank % SHARD_GROUP, WORLD)
            assert (folder / shard_file(kind, rank, WORLD)).read_bytes() == twin.read_bytes(), (kind, rank)
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], again[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("written", "resumed"),
    [("hsdp", "fsdp"), ("fsdp", "hsdp"), ("hsdp", "ddp")],
    ids=["hsdp-to-fsdp", "fsdp-to-hsdp", "hsdp-to-ddp"],
)
def test_a_checkpoint_sharded_in_other_groups_resumes_with_its_exact_state(
    gloo_four: Any, signing_spec: Any, written: str, resumed: str
) -> None:
    """The same world size, other parts of each tensor in each rank's file: each rank reads its
    rows by verified ranges (of an HSDP checkpoint, from its first replica's files only); the
    resumed weights and optimizer state (exp_avg, exp_avg_sq, step) are the checkpointed ones bit
    for bit, the ledger continues exactly, and the weights trained on equal the uninterrupted
    run's within the layouts' summation order."""
    assert_resumed_exactly(
        gloo_four(Task(hsdp(signing_spec), written, resume_at=4, resumed_as=(resumed, WORLD)))
    )


@pytest.mark.slow
def test_a_flipped_byte_in_the_first_replicas_files_is_refused_on_every_rank(
    gloo_four: Any, signing_spec: Any
) -> None:
    """HSDP -> FSDP reads the first replica's files by ranges: a flipped byte in one is refused on
    every rank, naming the file (the replicas' copies are never read, so never trusted instead)."""
    name = shard_file("model", 1, WORLD)
    answers = gloo_four(
        Task(hsdp(signing_spec), "hsdp", resume_at=2, tamper=name, resumed_as=("fsdp", WORLD))
    )
    for rank, (status, message) in answers.items():
        assert status == "refused", (rank, status, message)
        assert name in message and "does not match" in message, message


@pytest.mark.parametrize(
    ("resources", "refusal"),
    [
        ({"workers": 4}, "strategy hsdp on CPUs needs resources.shard_group"),
        ({"workers": 2, "use_gpu": True}, "it needs workers >= 4 .this run has 2.; use strategy fsdp"),
        ({"workers": 6, "shard_group": 4}, "6 workers do not split into shard groups of 4"),
        ({"workers": 4, "shard_group": 4}, "make one group, nothing to replicate across: use strategy fsdp"),
        ({"workers": 4, "shard_group": 1}, "shard_group"),
        ({"workers": 4, "shard_group": 2, "strategy": "fsdp"}, "resources.shard_group is for strategy hsdp"),
    ],
    ids=["cpu-without-group", "two-workers", "not-a-multiple", "one-group", "group-of-one", "not-hsdp"],
)
def test_hsdp_refuses_a_world_it_cannot_split(resources: dict[str, Any], refusal: str) -> None:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    with pytest.raises(ValueError, match=refusal):
        ExperimentConfig.model_validate({**raw, "resources": {"strategy": "hsdp", **resources}})


def test_hsdp_is_validated_and_serialized() -> None:
    raw = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    config = ExperimentConfig.model_validate(
        {**raw, "resources": {"strategy": "hsdp", "workers": 4, "shard_group": 2}}
    )
    dumped = config.model_dump(mode="json")["resources"]
    assert (dumped["strategy"], dumped["shard_group"]) == ("hsdp", 2)
    on_gpus = ExperimentConfig.model_validate(
        {**raw, "resources": {"strategy": "hsdp", "workers": 16, "use_gpu": True}}
    )
    assert "shard_group" not in on_gpus.model_dump(mode="json")["resources"], "the GPUs per node, at run time"
    with pytest.raises(ValueError, match="precision fp16 with strategy hsdp: use bf16"):
        ExperimentConfig.model_validate(
            {
                **raw,
                "resources": {"strategy": "hsdp", "workers": 4, "shard_group": 2},
                "training": {"precision": "fp16"},
            }
        )
