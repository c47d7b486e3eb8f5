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
least 257), or the ``tokenizer`` hyperparameter's (a local directory that
``AutoTokenizer.from_pretrained`` reads, e.g. one written by ``save_pretrained``; nothing is
downloaded): a row is its BOS (or, without one, its EOS) and the text's ids without special tokens.
Under ``data.packing`` each row is its ids followed by the end-of-text id (the tokenizer's EOS;
byte-level: 256), so a packed window shows the model where one document ends and the next begins.
Loss per example: the mean next-token NLL over the row's tokens (a packed window: the sum over its
tokens; govray divides). Example::

    class TinyLlamaTrial(CausalLMTrial):
        pass    # hyperparameters: model: {model_type: llama, vocab_size: 257, ...}, context: 96

transformers is imported when a model is built, never by importing this module.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
from torch import nn

from govray.core.errors import ConfigError
from govray.governance.detectors import TokenStats, token_stats
from govray.train.decoder import decoder_layers, is_transformers_model
from govray.train.step.memory_savers import IGNORE, chunked_token_nll, token_nll
from govray.train.trial import Batch, Trial, scoring

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

BOS = 256  # after the 256 byte values
BYTE_VOCAB = 257
SCORE_CHUNK = 128  # texts per forward pass in sequence_scores


def transformers_model(model: nn.Module) -> PreTrainedModel:
    """The outermost transformers model inside ``model`` (a DDP or govray wrapper, or itself)."""
    for module in model.modules():
        if is_transformers_model(module):
            found: PreTrainedModel = module  # type: ignore[assignment]  # checked just above
            return found
    raise ConfigError(f"{type(model).__name__} holds no transformers model")


def plain_head(model: PreTrainedModel) -> bool:
    """Whether ``model``'s logits are exactly its output head applied to its last hidden state,
    and its forward can skip computing them (``logits_to_keep``): what the chunked loss needs."""
    softcap = getattr(model.config, "final_logit_softcapping", None)
    post_processed = softcap is not None or getattr(model.config, "logit_scale", None) not in (None, 1.0)
    takes_positions = "logits_to_keep" in inspect.signature(type(model).forward).parameters
    return takes_positions and not post_processed and model.get_output_embeddings() is not None


class CausalLMTrial(Trial):
    """Next-token prediction with a transformers causal LM over a text column.

    Hyperparameters: ``model`` (a config dict with ``model_type``) or ``pretrained`` (a local
    directory), ``context`` (tokens per row after BOS; longer rows are truncated; default 128),
    ``tokenizer`` (a local tokenizer directory; default: byte-level).
    """

    text_column = "text"

    @property
    def context(self) -> int:
        return int(self.hparams.get("context", 128))

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The ``tokenizer`` hyperparameter's tokenizer, read from its directory; None: byte-level."""
        directory = self.hparams.get("tokenizer")
        if directory is None:
            return None
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"hyperparameter 'tokenizer': cannot read a tokenizer from {directory}: {error}"
            ) from None

    @property
    def bos_id(self) -> int:
        """The id each row starts with: the tokenizer's BOS, else its EOS (byte-level: 256)."""
        if self.tokenizer is None:
            return BOS
        return self._special("bos_token_id", "eos_token_id")

    @property
    def eos_id(self) -> int:
        """The id that ends each document in a packed window: the tokenizer's EOS (byte-level: 256)."""
        if self.tokenizer is None:
            return BOS
        return self._special("eos_token_id")

    @property
    def pad_id(self) -> int:  # type: ignore[override]  # a property over the base's class attribute
        """The id that pads a packed window (never a target): the tokenizer's pad token, else EOS."""
        if self.tokenizer is None or self.tokenizer.pad_token_id is None:
            return self.eos_id
        return int(self.tokenizer.pad_token_id)

    def input_directories(self) -> dict[str, Path]:
        """The tokenizer's directory, when the ``tokenizer`` hyperparameter names one: its digest
        is recorded with the run, so a replay or resume refuses a tokenizer that changed."""
        directory = self.hparams.get("tokenizer")
        return {} if directory is None else {"tokenizer": Path(str(directory))}

    def _special(self, *names: str) -> int:
        for name in names:
            value = getattr(self.tokenizer, name, None)
            if value is not None:
                return int(value)
        directory = self.hparams.get("tokenizer")
        raise ConfigError(f"the tokenizer at {directory} has no {' or '.join(names).replace('_id', '')}")

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        pretrained = self.hparams.get("pretrained")
        if pretrained is not None:
            model = AutoModelForCausalLM.from_pretrained(str(pretrained), local_files_only=True)
        else:
            model = AutoModelForCausalLM.from_config(self.model_config())
        if self.tokenizer is not None and len(self.tokenizer) > model.config.vocab_size:
            raise ConfigError(
                f"the tokenizer at {self.hparams['tokenizer']} has {len(self.tokenizer)} ids; the model's "
                f"vocab_size is {model.config.vocab_size}"
            )
        return model

    def checkpoint_units(self, model: nn.Module) -> list[str]:
        """The decoder's blocks (activation checkpointing): embeddings, norm and head keep theirs."""
        return decoder_layers(model)[1:-2]

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
        """BOS, then the token ids of ``text`` (byte-level: its UTF-8 bytes)."""
        return [self.bos_id, *self.text_ids(text)]

    def text_ids(self, text: str) -> list[int]:
        """The token ids of ``text`` alone, without special tokens."""
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tokenize(self, rows: pa.Table) -> list[list[int]]:
        """Under ``data.packing``: each row's ids followed by the end-of-text id (``eos_id``)."""
        return [[*self.text_ids(text), self.eos_id] for text in rows[self.text_column].to_pylist()]

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text)[: self.context + 1] for text in texts]

    def _batch(self, texts: Sequence[str]) -> Batch:
        encoded = self._ids(texts)
        length = max(len(ids) for ids in encoded)
        ids = torch.full((len(encoded), length), self.bos_id, dtype=torch.long)
        targets = torch.full((len(encoded), length), IGNORE, dtype=torch.long)
        for row, tokens in enumerate(encoded):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            targets[row, : len(tokens) - 1] = torch.tensor(tokens[1:])
        return {"ids": ids, "targets": targets}

    def collate(self, rows: pa.Table) -> Batch:
        if "input_ids" in rows.column_names:  # packed windows (data.packing)
            return self._windows(rows)
        return self._batch(rows[self.text_column].to_pylist())

    def _windows(self, rows: pa.Table) -> Batch:
        """Each window's ids; position ``t`` predicts ``t + 1`` among its ``tokens`` real ones."""
        windows = rows["input_ids"].to_pylist()
        ids = torch.tensor(windows, dtype=torch.long)
        tokens = torch.tensor(rows["tokens"].to_pylist(), dtype=torch.long)
        predicted = torch.arange(1, ids.shape[1]) < tokens[:, None]  # the next token is real
        targets = torch.full_like(ids, IGNORE)
        targets[:, :-1] = torch.where(predicted, ids[:, 1:], IGNORE)
        return {"ids": ids, "targets": targets, "tokens": tokens}

    def token_nll(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Per-position NLL (nats) of the next token, ``[batch, length]``; 0 at padding.

        Rows are right-padded and attention is causal, so no real token attends to padding and no
        attention mask is needed. Under ``training.loss_chunk`` (default 1024 positions) the
        output head and cross-entropy run a chunk at a time from the final hidden states
        (:func:`govray.train.step.memory_savers.chunked_token_nll`): the whole sequence's logits are never
        held. A model whose logits are more than its head applied to the last hidden state (a
        soft cap, a logit scale) computes them whole.
        """
        ids, targets = batch["ids"], batch["targets"]
        chunk = self.settings.loss_chunk
        language_model = transformers_model(model)
        if chunk is None or not plain_head(language_model):
            nll = token_nll(model(input_ids=ids, use_cache=False).logits, targets)
        else:
            # No logits from the model (an empty set of positions to keep): its final hidden states.
            out = model(
                input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=ids.new_zeros(0)
            )
            head = language_model.get_output_embeddings()
            nll = chunked_token_nll(head, out.hidden_states[-1], targets, chunk)
        return nll

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        nll = self.token_nll(model, batch).sum(dim=1)
        if "tokens" in batch:  # a packed window: the sum over its tokens (govray divides)
            return nll
        counts = (batch["targets"] != IGNORE).sum(dim=1).clamp(min=1)
        return nll / counts

    def predictions(self, model: nn.Module, batch: Batch) -> TokenStats:
        """The per-token statistics of the logit detectors (``governance.detectors``: Min-K%,
        Min-K%++, confidence, zlib ratio) for each row's predicted tokens. Under
        ``training.loss_chunk`` the output head runs a chunk of positions at a time on the final
        hidden states, as in ``token_nll``: a sequence's logits are never held whole."""
        ids, targets = batch["ids"], batch["targets"]
        mask = targets != IGNORE
        chunk = self.settings.loss_chunk
        language_model = transformers_model(model)
        if chunk is None or not plain_head(language_model):
            return token_stats(model(input_ids=ids, use_cache=False).logits, targets, mask)
        out = model(
            input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=ids.new_zeros(0)
        )
        head, hidden = language_model.get_output_embeddings(), out.hidden_states[-1]
        return TokenStats.cat(
            [
                token_stats(
                    head(hidden[:, start : start + chunk]),
                    targets[:, start : start + chunk],
                    mask[:, start : start + chunk],
                )
                for start in range(0, ids.shape[1], chunk)
            ]
        )

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
