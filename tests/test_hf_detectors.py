"""The logit detectors on a Hugging Face causal LM (``CausalLMTrial.predictions``): the per-token
statistics computed a chunk of positions at a time equal those of the whole logits, and a
sequence the model was fitted to scores as trained against a fresh one (no Ray)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
import torch

from govray.config.training import TrainingSettings
from govray.governance.detectors import TokenStats, example_scores, min_k_prob, token_stats
from govray.train.hf import CausalLMTrial
from govray.train.step.memory_savers import IGNORE

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 257,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
TEXTS = ["Ada Lovelace, 10 Dec 1815", "tied weights", "x"]


def trial(chunk: int | None) -> CausalLMTrial:
    return CausalLMTrial({"model": LLAMA, "context": 32}, TrainingSettings(loss_chunk=chunk))


def built(hf: CausalLMTrial) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf.build_model()
    model.eval()
    return model


def test_chunked_statistics_equal_the_whole_logits_statistics() -> None:
    whole, chunked = trial(None), trial(4)  # 4 positions a chunk: several chunks per row
    model = built(whole)
    batch = whole.collate(pa.Table.from_pylist([{"text": text} for text in TEXTS]))
    with torch.no_grad():
        logits, targets = model(input_ids=batch["ids"]).logits, batch["targets"]
        expected = token_stats(logits, targets, targets != IGNORE)
        given = chunked.predictions(model, batch)
        plain = whole.predictions(model, batch)
    assert isinstance(given, TokenStats) and isinstance(plain, TokenStats)
    assert torch.equal(given.mask, batch["targets"] != IGNORE)
    assert int(given.mask.sum()) == sum(len(text) for text in TEXTS)  # each byte after BOS, once
    for name in ("log_p", "mu", "sigma"):
        assert torch.equal(getattr(plain, name), getattr(expected, name)), name
        torch.testing.assert_close(getattr(given, name), getattr(expected, name), rtol=0, atol=1e-5)
    scores = example_scores(torch.zeros(len(TEXTS)), given, texts=TEXTS)
    assert set(scores) == {"loss", "min_k_prob", "min_k_plus_plus", "confidence", "zlib_ratio"}
    for score in scores.values():
        assert score.shape == (len(TEXTS),) and bool(torch.isfinite(score).all())


@pytest.mark.slow  # 40 optimizer steps of a small Llama: ~5-20 s here
def test_a_fitted_sequence_scores_as_trained_against_a_fresh_one() -> None:
    hf = trial(8)
    model = built(hf)
    seen, fresh = "my PIN is 4921-7730", "the cat sat on a mat"
    before = {text: hf.collate(pa.Table.from_pylist([{"text": text}])) for text in (seen, fresh)}
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        optimizer.zero_grad()
        hf.loss(model, before[seen]).sum().backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        scores = {text: float(min_k_prob(hf.predictions(model, batch))[0]) for text, batch in before.items()}
    assert scores[seen] > -0.5 and scores[fresh] < -3.0  # the fitted one: its least likely tokens likely
