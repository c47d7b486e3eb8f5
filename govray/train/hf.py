"""Hugging Face causal language models as govray trials.

``govray.train.decoder.decoder_layers(model)`` gives a decoder stack's ordered layers — input
embeddings, each block in order, final norm, output head — so a policy's depth range counts blocks
(block ``i`` is layer ``i + 1`` in every architecture; ``-1`` is the head). A tied embedding and
head is the one tensor held by the first and last layers; routing's rule for tied tensors applies (a
route updates it only if it may update both). Other embeddings (GPT-2's positions,
``transformer.wpe``) lie outside the layers: routes that update every parameter, or name them by
glob, reach them.

``CausalLMTrial`` is a trial around ``transformers.AutoModelForCausalLM``: built from the
``model`` hyperparameter (a config dict with ``model_type``; random init under govray's seed) or
``pretrained`` (a local directory written by ``save_pretrained``; nothing is downloaded). Text is
byte-level by default (UTF-8 bytes, ids 0 to 255, ``BOS`` 256: the config's ``vocab_size`` must be at
least 257); a trial overrides ``encode`` for another tokenizer. Loss per example: the mean
next-token NLL over the row's tokens. Example::

    class TinyLlamaTrial(CausalLMTrial):
        pass    # hyperparameters: model: {model_type: llama, vocab_size: 257, ...}, context: 96

transformers is imported when a model is built, never by importing this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import torch
import torch.nn.functional as F
from torch import nn

from govray.core.errors import ConfigError
from govray.train.trial import Batch, Trial, scoring

BOS = 256  # after the 256 byte values
BYTE_VOCAB = 257
IGNORE = -100  # a padded position's target
SCORE_CHUNK = 128  # texts per forward pass in sequence_scores


class CausalLMTrial(Trial):
    """Next-token prediction with a transformers causal LM over a text column.

    Hyperparameters: ``model`` (a config dict with ``model_type``) or ``pretrained`` (a local
    directory), ``context`` (tokens per row after BOS; longer rows are truncated; default 128).
    """

    text_column = "text"

    @property
    def context(self) -> int:
        return int(self.hparams.get("context", 128))

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        pretrained = self.hparams.get("pretrained")
        if pretrained is not None:
            return AutoModelForCausalLM.from_pretrained(str(pretrained), local_files_only=True)
        return AutoModelForCausalLM.from_config(self.model_config())

    def build_meta_model(self) -> nn.Module:
        """The architecture on the meta device (``from_pretrained`` refuses it: a pretrained
        model's structure is built from its saved config, without reading its weights)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.model_config())

    def model_config(self) -> Any:
        """The transformers config: ``pretrained``'s saved one, or the ``model`` hyperparameter's."""
        from transformers import AutoConfig

        pretrained = self.hparams.get("pretrained")
        if pretrained is not None:
            return AutoConfig.from_pretrained(str(pretrained), local_files_only=True)
        settings = dict(self.hparams.get("model") or {})
        model_type = settings.pop("model_type", None)
        if model_type is None:
            raise ConfigError(
                f"{type(self).__name__}: hyperparameter 'model' needs a 'model_type' (or give 'pretrained')"
            )
        return AutoConfig.for_model(model_type, **settings)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` after BOS (byte-level: its UTF-8 bytes)."""
        return [BOS, *text.encode("utf-8")]

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text)[: self.context + 1] for text in texts]

    def _batch(self, texts: Sequence[str]) -> Batch:
        encoded = self._ids(texts)
        length = max((len(ids) for ids in encoded), default=1)
        ids = torch.full((len(encoded), length), BOS, dtype=torch.long)
        targets = torch.full((len(encoded), length), IGNORE, dtype=torch.long)
        for row, tokens in enumerate(encoded):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            targets[row, : len(tokens) - 1] = torch.tensor(tokens[1:])
        return {"ids": ids, "targets": targets}

    def collate(self, rows: pa.Table) -> Batch:
        return self._batch(rows[self.text_column].to_pylist())

    def token_nll(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Per-position NLL (nats) of the next token, ``[batch, length]``; 0 at padding.

        Rows are right-padded and attention is causal, so no real token attends to padding and no
        attention mask is needed.
        """
        ids = batch["ids"]
        if len(ids) == 0:
            # An empty slot still runs forward and backward (DDP's hook with it): transformers
            # refuses an empty batch, so one BOS row goes through the graph and none of it is kept.
            logits = model(input_ids=ids.new_full((1, 1), BOS), use_cache=False).logits[:0]
        else:
            logits = model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(
            logits.transpose(1, 2).float(), batch["targets"], ignore_index=IGNORE, reduction="none"
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        counts = (batch["targets"] != IGNORE).sum(dim=1).clamp(min=1)
        return self.token_nll(model, batch).sum(dim=1) / counts

    def tokens(self, rows: pa.Table) -> list[int]:
        """Tokens predicted per row (the ledger's token counts)."""
        return [len(ids) - 1 for ids in self._ids(rows[self.text_column].to_pylist())]

    def sequence_scores(self, model: nn.Module, texts: Sequence[str]) -> torch.Tensor:
        """Total NLL (nats) of each text after BOS, lower = more likely (canary exposure). Runs in
        eval mode without gradients and restores the model's mode."""
        scores = []
        with scoring(model) as device:
            for start in range(0, len(texts), SCORE_CHUNK):
                batch = {k: v.to(device) for k, v in self._batch(texts[start : start + SCORE_CHUNK]).items()}
                scores.append(self.token_nll(model, batch).sum(dim=1).cpu())
        return torch.cat(scores) if scores else torch.zeros(0)
