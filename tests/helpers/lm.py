"""Small causal-LM pieces the Hugging Face tests share: a llama config, a LoRA policy, a tokenizer."""

from __future__ import annotations

import argparse
import collections
import csv
import functools
import itertools
import json
import pathlib
import re
from pathlib import Path
from typing import Any

import torch

from govray.governance.adapters import GovernedModel
from govray.governance.policy import DepthPolicy

VOCAB = 1000
TOKENIZER_VOCAB = 320


def llama(vocab: int = VOCAB, tied: bool = True) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": tied,
    }


def policy(targets: list[str], *extra: str) -> DepthPolicy:
    adapters = {name: {"targets": targets, "rank": 4, "alpha": 8} for name in ("pii-lora", *extra)}
    return DepthPolicy.model_validate(
        {
            "name": "hf",
            "version": 1,
            "adapters": adapters,
            "rules": [
                {"name": "public", "match": {"license_class": "permissive"}, "route": "all"},
                {"name": "licensed", "match": {"license_class": "licensed"}, "route": {"depth": {"min": -3}}},
                *(
                    {"name": f"r-{name}", "match": {"corpus_id": name}, "route": {"adapter": name}}
                    for name in adapters
                ),
            ],
        }
    )


def make_nonzero(model: GovernedModel, adapter: str = "pii-lora") -> None:
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.adapter_parameters(adapter):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def save_small_tokenizer(directory: Path) -> Path:
    """A byte-level BPE of ``TOKENIZER_VOCAB`` ids trained on standard-library docstrings, with
    ``<s>`` (BOS), ``</s>`` (EOS) and ``<pad>``, saved with ``save_pretrained`` into ``directory``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    modules = (argparse, collections, csv, functools, itertools, json, pathlib, re)
    texts = [module.__doc__ or "" for module in modules]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.save_pretrained(str(directory))
    return directory
