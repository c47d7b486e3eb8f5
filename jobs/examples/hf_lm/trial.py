"""The Hugging Face trial: a tiny Llama (``transformers``) from a config, random init, byte-level.

Everything but the rows' padding is :class:`govray.train.hf.CausalLMTrial`'s: the model comes
from the ``model`` hyperparameter (a Llama config dict; tied embeddings), its layers from
``decoder_layers`` (embeddings, ``model.layers.0`` … ``model.layers.3``, ``model.norm``,
``lm_head``), the loss is each row's mean next-byte NLL, the ledger counts bytes, and canaries are
scored by their total NLL. The text example's rows are right-padded with newlines
(``jobs/examples/text``); the padding is not text, so it is not a token.
"""

from __future__ import annotations

from govray.train.hf import CausalLMTrial


class TinyLlamaTrial(CausalLMTrial):
    def text_ids(self, text: str) -> list[int]:
        return super().text_ids(text.rstrip("\n"))
