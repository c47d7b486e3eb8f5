"""The Hugging Face example's governed steps with the memory savers on: activation-checkpointed
blocks (with dropout in them) train the same weights as without them, bit for bit; with them and
the chunked loss, removing the PII adapter equals the replay without the PII records, bit for bit,
also with a tokenizer read from a directory and its documents packed with its EOS. Ray ingests (and
packs) the corpora; the governed steps run in-process (one worker), as a Ray Train worker runs
them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from govray.data.fingerprint import directory_digest
from govray.data.packed import PackedStore
from govray.platform.run.plan import plan_run
from govray.train.context import WorkerContext
from govray.train.hf import CausalLMTrial
from govray.train.parallel.worker import Worker
from govray.train.runspec import RunSpec
from govray.train.step.governed import GovernedStep
from govray.train.trial import make_trial
from jobs.examples.digits.golden import opened
from jobs.examples.hf_lm.golden import example_under
from tests.helpers.lm import TOKENIZER_VOCAB, save_small_tokenizer

STEPS = 8
ADAPTER = "records-lora"
PII_CORPUS = "text-records"


def hf_run_spec(root: Path, edit: Callable[[dict[str, Any]], None] | None = None, **training: Any) -> RunSpec:
    """The hf_lm example's run spec (its corpora ingested under ``root``), with attention dropout
    in its blocks, ``edit`` applied to its experiment and ``training`` over its settings."""
    path = example_under(root, STEPS, **training)
    raw = yaml.safe_load(path.read_text())
    raw["hyperparameters"]["model"]["attention_dropout"] = 0.2  # dropout inside checkpointed blocks
    if edit is not None:
        edit(raw)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    config, _, checked, _, ingested = opened(path)
    plan = plan_run(config, checked, ingested.root, hparams=config.default_hparams(), trial_seed=0)
    return plan.named("lm-run", {})


def trained(spec: RunSpec, **settings: Any) -> GovernedStep:
    """``spec``'s governed steps on one in-process worker, ``settings`` over the run's."""
    assert spec.settings is not None
    trial = make_trial(spec.trial, spec.hparams, spec.settings.model_copy(update=settings))
    governed = GovernedStep(WorkerContext.of(spec, Worker(0, 1)), trial)
    for step in range(STEPS):
        governed.step(step)
    governed.batches.close()
    return governed


def adapter_state(governed: GovernedStep) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in governed.model.adapter_parameters(ADAPTER)]


def assert_same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name, tensor in left.items():
        assert torch.equal(tensor, right[name]), name


def assert_removal_is_the_replay(spec: RunSpec, original: GovernedStep) -> None:
    """The base of ``original`` equals the replay's without the PII corpus; its adapter learned."""
    replay = trained(spec.model_copy(update={"excluded_corpora": (PII_CORPUS,)}))
    assert_same(original.model.base_state(), replay.model.base_state())
    assert PII_CORPUS in original.ledger.corpora() and PII_CORPUS not in replay.ledger.corpora()
    learned = [tensor for tensor in adapter_state(original) if bool(tensor.any())]
    assert len(learned) == len(adapter_state(original)), "every adapter tensor learned (lora_B left 0)"


@pytest.fixture(scope="module")
def memory_spec(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> RunSpec:
    spec = hf_run_spec(tmp_path_factory.mktemp("hf-memory"), activation_checkpointing=True, loss_chunk=48)
    assert spec.settings is not None and spec.settings.activation_checkpointing
    return spec


@pytest.fixture(scope="module")
def memory_run(memory_spec: RunSpec) -> GovernedStep:
    return trained(memory_spec)


def test_checkpointed_blocks_train_the_weights_of_a_run_without_them(
    memory_spec: RunSpec, memory_run: GovernedStep
) -> None:
    plain = trained(memory_spec, activation_checkpointing=False)  # the same chunked loss
    assert_same(memory_run.model.base_state(), plain.model.base_state())
    for mine, theirs in zip(adapter_state(memory_run), adapter_state(plain), strict=True):
        assert torch.equal(mine, theirs)


def test_with_checkpointed_blocks_removing_the_adapter_equals_the_replay_without_its_corpus(
    memory_spec: RunSpec, memory_run: GovernedStep
) -> None:
    assert_removal_is_the_replay(memory_spec, memory_run)


@pytest.fixture(scope="module")
def tokenizer_spec(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> RunSpec:
    """The example with a BPE tokenizer from a directory, its rows packed into windows of 96 ids."""
    tokenizer = save_small_tokenizer(tmp_path_factory.mktemp("tokenizer"))

    def with_tokenizer(raw: dict[str, Any]) -> None:
        raw["hyperparameters"]["tokenizer"] = str(tokenizer)
        raw["hyperparameters"]["model"]["vocab_size"] = TOKENIZER_VOCAB
        raw["data"]["packing"] = {"seq_len": 96}
        raw["training"]["batch_size"] = 4

    root = tmp_path_factory.mktemp("hf-tokenizer")
    return hf_run_spec(root, with_tokenizer, activation_checkpointing=True, loss_chunk=40)


def test_packed_windows_hold_the_tokenizers_ids_with_its_eos_between_documents(
    tokenizer_spec: RunSpec,
) -> None:
    trial = make_trial(tokenizer_spec.trial, tokenizer_spec.hparams, tokenizer_spec.settings)
    assert isinstance(trial, CausalLMTrial)
    governed = GovernedStep(WorkerContext.of(tokenizer_spec, Worker(0, 1)), trial)
    assert governed.packed is not None
    for route in governed.schedule.routes:
        rows = governed.shards.route_table(route.route)
        documents = trial.tokenize(rows)
        windows = governed.packed.take(route.route, np.arange(3), pad_id=trial.pad_id)
        packed = [
            t
            for w, n in zip(windows["input_ids"].to_pylist(), windows["tokens"].to_pylist(), strict=True)
            for t in w[:n]
        ]
        assert packed == [token for document in documents for token in document][: len(packed)]
        assert packed.count(trial.eos_id) >= 2  # several documents per window, each ended by the EOS
    governed.batches.close()


def test_the_run_records_its_tokenizers_digest_and_its_packed_windows_are_keyed_by_it(
    tokenizer_spec: RunSpec,
) -> None:
    digest = directory_digest(Path(tokenizer_spec.hparams["tokenizer"]))
    assert tokenizer_spec.input_digests == {"tokenizer": digest}
    packed = PackedStore.open(Path(tokenizer_spec.packed_root))
    # A changed tokenizer packs its windows anew.
    assert json.loads(packed.manifest.tokenizer)["inputs"] == {"tokenizer": digest}


def test_with_a_tokenizer_and_packing_removing_the_adapter_equals_the_replay_without_its_corpus(
    tokenizer_spec: RunSpec,
) -> None:
    assert_removal_is_the_replay(tokenizer_spec, trained(tokenizer_spec))
