"""Hugging Face causal language models as govray trials.

``decoder_layers(model)`` gives a decoder stack's ordered layers — input embeddings, each block in
order, final norm, output head — so a policy's depth range counts blocks (block ``i`` is layer
``i + 1`` in every architecture; ``-1`` is the head). A tied embedding and head is the one tensor
held by the first and last layers; routing's rule for tied tensors applies (a route updates it only
if it may update both). Other embeddings (GPT-2's positions, ``transformer.wpe``) lie outside the
layers: routes that update every parameter, or name them by glob, reach them.

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

import inspect
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
from torch import nn

from govray.core.errors import ConfigError
from govray.train.memory import IGNORE, chunked_token_nll, token_nll
from govray.train.trial import Batch, Trial, scoring

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BOS = 256  # after the 256 byte values
BYTE_VOCAB = 257
SCORE_CHUNK = 128  # texts per forward pass in sequence_scores
BLOCK_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")
NORM_PATHS = ("model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm", "model.decoder.final_layer_norm")


def _name_of(model: nn.Module, module: nn.Module | None, what: str) -> str:
    for name, candidate in model.named_modules():
        if candidate is module and name:
            return name
    raise ConfigError(f"{type(model).__name__}: cannot find its {what}; declare the trial's layers()")


def _first_submodule(model: nn.Module, paths: Sequence[str], what: str) -> tuple[str, nn.Module]:
    for path in paths:
        try:
            return path, model.get_submodule(path)
        except AttributeError:
            continue
    raise ConfigError(
        f"{type(model).__name__}: no {what} at {', '.join(paths)}; declare the trial's layers()"
    )


def decoder_layers(model: nn.Module) -> list[str]:
    """The ordered layers of a transformers decoder-only model: input embeddings, each block,
    final norm, output head (module names), e.g. ``["model.embed_tokens", "model.layers.0", ...,
    "model.norm", "lm_head"]``. A model without one of them is a ``ConfigError``."""
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    embeddings = _name_of(model, get_input() if get_input else None, "input embeddings")
    head = _name_of(model, get_output() if get_output else None, "output head")
    blocks_path, blocks = _first_submodule(model, BLOCK_PATHS, "block list")
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}: {blocks_path} is not a ModuleList of blocks")
    norm, _ = _first_submodule(model, NORM_PATHS, "final norm")
    return [embeddings, *(f"{blocks_path}.{index}" for index in range(len(blocks))), norm, head]


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing transformers:
    a model built from it has imported it)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


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
        attention mask is needed. Under ``training.loss_chunk`` (default 1024 positions) the
        output head and cross-entropy run a chunk at a time from the final hidden states
        (:func:`govray.train.memory.chunked_token_nll`): the whole sequence's logits are never
        held. A model whose logits are more than its head applied to the last hidden state (a
        soft cap, a logit scale) computes them whole.
        """
        ids, targets = batch["ids"], batch["targets"]
        if len(ids) == 0:
            # An empty slot still runs forward and backward (DDP's hook with it): transformers
            # refuses an empty batch, so one BOS row goes through the graph and none of it is kept.
            ids, targets = ids.new_full((1, 1), BOS), targets.new_full((1, 1), IGNORE)
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
        return nll[: len(batch["ids"])]

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
