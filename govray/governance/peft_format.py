"""Adapters in PEFT's directory layout (``adapter_config.json``, ``adapter_model.safetensors``),
for other tools: ``peft.PeftModel.from_pretrained(base, directory)`` (and PEFT's Auto classes, by
the task type the model implies) puts a govray adapter on a plain copy of the base model.
Example::

    save_peft_adapter(model, "pii-lora", directory / "pii-lora")
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from govray.governance.adapter_files import write_safetensors
from govray.governance.adapters import GovernedModel
from govray.governance.policy import AdapterSpec

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


def save_peft_adapter(model: GovernedModel, adapter: str, directory: Path) -> Path:
    """Write ``adapter`` of a live model in PEFT's layout (see :func:`write_peft_adapter`)."""
    targets = model.adapter_targets(adapter)
    return write_peft_adapter(
        directory,
        model.adapter_spec(adapter),
        {target: model.target_kind(target) for target in targets},
        {target: (lora_a, lora_b) for target, lora_a, lora_b in model.adapter_factors(adapter)},
        getattr(model.base, "name_or_path", None) or None,
        peft_task_type(model.base),
    )


# PEFT's task type of a transformers model, by the auto mapping its class is listed in
_PEFT_TASKS = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "CAUSAL_LM"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "SEQ_2_SEQ_LM"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "SEQ_CLS"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "TOKEN_CLS"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "QUESTION_ANS"),
)


def peft_task_type(model: nn.Module) -> str | None:
    """The PEFT task type the model implies (``CAUSAL_LM`` for a transformers causal LM, ...),
    so that PEFT's Auto classes (``AutoPeftModelForCausalLM``) load the export; None for a model
    that is no transformers task model (PEFT then loads it with ``PeftModel`` only)."""
    if "transformers" not in sys.modules:  # a model built from transformers has imported it
        return None
    from transformers.models.auto import modeling_auto

    name = type(model).__name__
    for mapping, task in _PEFT_TASKS:
        for classes in getattr(modeling_auto, mapping, {}).values():
            if name in ((classes,) if isinstance(classes, str) else classes):
                return task
    return None


def write_peft_adapter(
    directory: Path,
    spec: AdapterSpec,
    kinds: Mapping[str, str],
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    base_name_or_path: str | None = None,
    task_type: str | None = None,
) -> Path:
    """Write an adapter in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``)
    so that ``peft.PeftModel.from_pretrained(base, directory)`` puts it on a plain copy of the
    base model; returns ``directory``. ``kinds``: each target's ``lora_target_kind``; ``factors``:
    each target's ``(A, B)`` as PEFT holds them.

    The config names the exact target modules (an anchored regular expression, so no other module
    whose name ends the same way is wrapped), the base model's ``name_or_path`` if known, and the
    ``task_type`` (:func:`peft_task_type`).
    """
    from peft import LoraConfig

    targets = tuple(kinds)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]
        lora_dropout=spec.dropout,
        target_modules="|".join(re.escape(target) for target in targets),  # PEFT fullmatches a str
        fan_in_fan_out=any(kinds[target] == "conv1d" for target in targets),
        base_model_name_or_path=base_name_or_path,
        task_type=task_type,
        inference_mode=True,
    )
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    tensors = {}
    for target in targets:
        # PEFT's saved keys: the module path under its wrapper, without the adapter's name.
        names = (
            ("lora_embedding_A", "lora_embedding_B")
            if kinds[target] == "embedding"
            else ("lora_A.weight", "lora_B.weight")
        )
        for name, tensor in zip(names, factors[target], strict=True):
            tensors[f"base_model.model.{target}.{name}"] = tensor.detach().cpu().contiguous()
    write_safetensors(tensors, directory / PEFT_WEIGHTS_FILE, {"format": "pt"})
    return directory
