"""The ordered layers of a Hugging Face decoder stack, for depth ranges: input embeddings, each
block in order, final norm, output head (module names). A trial's default ``layers`` uses them for
a transformers model; :mod:`govray.train.hf` holds the trial class around such models.

Found by attribute paths and the model's own accessors, never by importing transformers (a model
built from it has imported it already).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch import nn

from govray.core.errors import ConfigError

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
