"""A causal LM trial with its own tokenizer, read from a local directory (AutoTokenizer; the test
trains a small byte-level BPE on Python's own docstrings and saves it with save_pretrained, nothing
is downloaded): rows are its ids after its BOS, packed documents end with its EOS, and a packed
window predicts each next real token, across the EOS, and nothing in its padding; the run records
the digest of the tokenizer's files, and a replay or resume refuses a tokenizer that changed (no
Ray)."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
import transformers

from govray.core.errors import ConfigError
from govray.train.hf import BOS, CausalLMTrial
from govray.train.reproduce.snapshots import ReproducibilityError, input_digests, verify_input_digests
from govray.train.step.memory_savers import IGNORE
from tests.helpers.lm import TOKENIZER_VOCAB, llama, save_small_tokenizer

TEXTS = ["Ada Lovelace, 10 Dec 1815", "Return a new ordered dictionary.", "x"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def lm(tokenizer_dir: Path | None, vocab: int = TOKENIZER_VOCAB) -> CausalLMTrial:
    hparams: dict[str, Any] = {"model": llama(vocab), "context": 64}
    if tokenizer_dir is not None:
        hparams["tokenizer"] = str(tokenizer_dir)
    return CausalLMTrial(hparams)


def test_a_trial_with_a_tokenizer_directory_tokenizes_with_it(tokenizer_dir: Path) -> None:
    own = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    trial = lm(tokenizer_dir)
    bos, eos = own.convert_tokens_to_ids("<s>"), own.convert_tokens_to_ids("</s>")
    assert (trial.bos_id, trial.eos_id, trial.pad_id) == (bos, eos, own.convert_tokens_to_ids("<pad>"))
    expected = [[bos, *own(text, add_special_tokens=False)["input_ids"]] for text in TEXTS]
    assert [trial.encode(text) for text in TEXTS] == expected
    assert expected[1] != CausalLMTrial({"model": llama(257)}).encode(TEXTS[1])  # not bytes
    batch = trial.collate(pa.table({"text": TEXTS}))
    for row, ids in enumerate(expected):
        assert batch["ids"][row, : len(ids)].tolist() == ids
        assert batch["targets"][row, : len(ids) - 1].tolist() == ids[1:]
        assert bool((batch["targets"][row, len(ids) - 1 :] == IGNORE).all())
    assert trial.tokens(pa.table({"text": TEXTS})) == [len(ids) - 1 for ids in expected]
    assert trial.tokenize(pa.table({"text": TEXTS})) == [[*ids[1:], eos] for ids in expected]


def test_byte_level_stays_the_default() -> None:
    trial = lm(None, vocab=257)
    assert trial.encode("Ab") == [BOS, 65, 98] and (trial.bos_id, trial.eos_id) == (BOS, BOS)
    assert trial.tokenize(pa.table({"text": ["Ab", ""]})) == [[65, 98, BOS], [BOS]]


def test_a_packed_window_predicts_every_next_real_token_across_the_eos(tokenizer_dir: Path) -> None:
    trial = lm(tokenizer_dir)
    documents = trial.tokenize(pa.table({"text": TEXTS[:2]}))
    window = [*documents[0], *documents[1]]  # what packing writes: documents, each ending with EOS
    seq_len = len(window) + 5
    table = pa.table(
        {"input_ids": [window + [trial.pad_id] * 5], "tokens": [len(window)]},
        schema=pa.schema([("input_ids", pa.list_(pa.int32())), ("tokens", pa.int64())]),
    )
    batch = trial.collate(table)
    assert batch["ids"].shape == (1, seq_len) and batch["ids"][0, : len(window)].tolist() == window
    assert batch["targets"][0, : len(window) - 1].tolist() == window[1:]  # the EOS and what follows it
    assert bool((batch["targets"][0, len(window) - 1 :] == IGNORE).all())  # nothing after the last token
    torch.manual_seed(0)
    model = trial.build_model()
    summed = trial.loss(model, batch)
    per_token = trial.token_nll(model, batch)
    assert torch.equal(summed, per_token.sum(dim=1))  # a window's loss is its sum: govray divides


def test_a_tokenizer_the_model_cannot_embed_or_cannot_read_is_refused(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=f"has {TOKENIZER_VOCAB} ids; the model's vocab_size is 257"):
        lm(tokenizer_dir, vocab=257).build_model()
    with pytest.raises(ConfigError, match="cannot read a tokenizer from"):
        lm(tmp_path).encode("x")


def test_a_run_records_the_digest_of_its_tokenizers_files_in_sorted_path_order(tokenizer_dir: Path) -> None:
    by_hand = hashlib.sha256()  # the corpus fingerprint's scheme: path, length, bytes of each file
    for file in sorted(tokenizer_dir.iterdir()):
        data = file.read_bytes()
        by_hand.update(f"{file.name}\0{len(data)}\0".encode() + data)
    assert input_digests(lm(tokenizer_dir)) == {"tokenizer": by_hand.hexdigest()}
    assert input_digests(lm(None, vocab=257)) == {}  # byte-level reads no directory
    with pytest.raises(ConfigError, match="hyperparameter 'tokenizer': .* is not a directory"):
        input_digests(lm(tokenizer_dir / "missing"))


def test_a_replay_or_resume_refuses_a_tokenizer_whose_files_changed(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(tokenizer_dir, tmp_path / "tokenizer"))
    trial = lm(copy)
    recorded = input_digests(trial)
    verify_input_digests(recorded, trial, run="trial 7")  # the same files: runs
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<pad>", "</s>"))
    now = input_digests(trial)["tokenizer"]
    expected = f"the tokenizer directory {copy} with digest {recorded['tokenizer']}; it now has {now}"
    with pytest.raises(ReproducibilityError, match=re.escape(expected)):
        verify_input_digests(recorded, trial, run="trial 7")
    shutil.rmtree(copy)
    with pytest.raises(ReproducibilityError, match="it now has gone"):
        verify_input_digests(recorded, trial, run="trial 7")
