"""Hugging Face models and PEFT adapters: a decoder's layers are embeddings, blocks, norm, head; a
model saved with save_pretrained routes as the one it was saved from; PEFT LoRA adapters are
exactly inactive off their route, initialised apart from everything else, and what govray saves
loads with PeftModel.from_pretrained (no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

from govray.core.errors import RoutingError
from govray.governance.adapter_files import load_adapter
from govray.governance.adapters import GovernedModel
from govray.governance.peft_format import save_peft_adapter
from govray.governance.policy import DepthPolicy
from govray.governance.routing import RoutingTable, resolve_routes
from govray.train.decoder import decoder_layers
from govray.train.hf import CausalLMTrial
from tests.helpers.lm import make_nonzero, policy

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 257,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 257,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "bos_token_id": 256,
    "eos_token_id": 256,
}
TEXTS = ["Ada Lovelace, 10 Dec 1815", "tied weights", "x"]
# (model config, adapter targets): Linear, GPT-2's Conv1D, an Embedding
CASES = {
    "llama-linear": (LLAMA, ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.v_proj"]),
    "gpt2-conv1d": (GPT2, ["transformer.h.*.attn.c_attn"]),
    "gpt2-embedding": (GPT2, ["transformer.wpe"]),
}


def trial_for(config: dict[str, Any]) -> CausalLMTrial:
    return CausalLMTrial({"model": config, "context": 32})


def built(config: dict[str, Any], seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = trial_for(config).build_model()
    model.eval()
    return model


def governed(case: str, *extra: str, seed: int = 7, base_seed: int = 0) -> GovernedModel:
    config, targets = CASES[case]
    base = built(config, base_seed)
    rules = policy(targets, *extra)
    return GovernedModel(base, resolve_routes(rules, base, decoder_layers(base)), rules.adapters, seed=seed)


def batch(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return trial_for(config).collate(pa.Table.from_pylist([{"text": text} for text in TEXTS]))


def logits(model: torch.nn.Module, config: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=batch(config)["ids"], use_cache=False).logits
    return out


# -- layers ---------------------------------------------------------------------------------------


def test_decoder_layers_are_embeddings_each_block_final_norm_and_head() -> None:
    assert decoder_layers(built(LLAMA)) == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.norm",
        "lm_head",
    ]
    assert decoder_layers(built(GPT2)) == [
        "transformer.wte",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
    assert trial_for(LLAMA).layers(built(LLAMA)) == decoder_layers(built(LLAMA))  # Trial's default


def test_a_model_saved_with_save_pretrained_loads_through_the_trial_and_routes_identically(
    tmp_path: Path,
) -> None:
    original = built(LLAMA, seed=3)
    original.save_pretrained(tmp_path / "tiny-llama")
    loaded = CausalLMTrial({"pretrained": str(tmp_path / "tiny-llama"), "context": 32}).build_model()
    loaded.eval()
    assert loaded.state_dict().keys() == original.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in original.state_dict().items())
    rules = policy(CASES["llama-linear"][1])
    first: RoutingTable = resolve_routes(rules, original, decoder_layers(original))
    again: RoutingTable = resolve_routes(rules, loaded, decoder_layers(loaded))
    assert (again.layers, again.parameters, again.masks) == (first.layers, first.parameters, first.masks)
    assert again.adapter_targets == first.adapter_targets
    assert torch.equal(logits(loaded, LLAMA), logits(original, LLAMA))


def test_a_tied_embedding_and_head_follow_the_tied_rule() -> None:
    model = built(LLAMA)
    table = resolve_routes(policy(CASES["llama-linear"][1]), model, decoder_layers(model))
    tied = table.parameters[table._index("lm_head.weight")]
    assert set(tied.aliases) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert tied.layers == (0, 5)
    assert table.may_update("public", "lm_head.weight")
    # licensed (depth -3..) reaches the top block, the norm and the head, not the embeddings: the
    # tied tensor is held by both, so licensed may not update it.
    assert table.may_update("licensed", "model.layers.2.self_attn.q_proj.weight")
    assert not table.may_update("licensed", "model.layers.1.self_attn.q_proj.weight")
    assert not table.may_update("licensed", "lm_head.weight")
    head_only = DepthPolicy.model_validate(
        {"name": "h", "version": 1, "rules": [{"name": "top", "route": {"depth": {"min": -1}}}]}
    )
    with pytest.raises(RoutingError, match="route 'top' may update no parameter: a tied parameter"):
        resolve_routes(head_only, model, decoder_layers(model))


# -- PEFT adapters --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_an_inactive_peft_adapter_leaves_the_output_the_bare_models_and_gets_no_gradient(case: str) -> None:
    config, _ = CASES[case]
    bare = built(config)
    model = governed(case)
    make_nonzero(model)
    model.eval()
    assert torch.equal(logits(model, config), logits(bare, config))
    with model.active("pii-lora"):
        assert not torch.equal(logits(model, config), logits(bare, config))
    assert model.active_adapter is None
    assert torch.equal(logits(model, config), logits(bare, config))

    model.train()
    model(input_ids=batch(config)["ids"], use_cache=False).logits.square().mean().backward()
    assert all(parameter.grad is None for parameter in model.adapter_parameters("pii-lora"))
    assert all(parameter.grad is not None for _, parameter in model.base_named_parameters())
    model.zero_grad(set_to_none=True)
    with model.active("pii-lora"):
        model(input_ids=batch(config)["ids"], use_cache=False).logits.square().mean().backward()
    assert all(parameter.grad is not None for parameter in model.adapter_parameters("pii-lora"))
    assert all(parameter.requires_grad for parameter in model.parameters())  # never flipped


@pytest.mark.parametrize("case", list(CASES))
def test_base_names_stay_the_users_around_peft_layers(case: str) -> None:
    config, _ = CASES[case]
    bare = built(config)
    model = governed(case)
    assert list(model.base_state()) == list(bare.state_dict())
    assert [name for name, _ in model.base_named_parameters()] == [
        name for name, _ in bare.named_parameters()
    ]
    keys = list(model.state_dict())
    assert [key for key in keys if key.startswith("base.")] == [f"base.{key}" for key in bare.state_dict()]
    assert all(key.startswith("adapters.pii-lora.") for key in keys if not key.startswith("base."))
    fresh = built(config, seed=5)
    fresh.load_state_dict(model.base_state(), strict=True)
    assert torch.equal(logits(fresh, config), logits(bare, config))


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_init_ignores_the_global_rng_and_other_adapters(case: str) -> None:
    alone = governed(case, base_seed=1)
    together = governed(case, "med-lora", base_seed=2)
    for name, tensor in alone.adapter_tensors("pii-lora").items():
        assert torch.equal(tensor, together.adapter_tensors("pii-lora")[name]), name
    other = governed(case, seed=8)
    assert any(
        not torch.equal(tensor, other.adapter_tensors("pii-lora")[name])
        for name, tensor in alone.adapter_tensors("pii-lora").items()
    )


@pytest.mark.parametrize("case", list(CASES))
def test_wrapping_leaves_the_global_rng_where_it_was(case: str) -> None:
    config, targets = CASES[case]
    base = built(config)
    rules = policy(targets, "med-lora")
    table = resolve_routes(rules, base, decoder_layers(base))
    torch.manual_seed(9)
    GovernedModel(base, table, rules.adapters, seed=7)
    after_wrap = torch.rand(4)
    torch.manual_seed(9)
    assert torch.equal(torch.rand(4), after_wrap)


@pytest.mark.parametrize("case", list(CASES))
def test_an_adapter_govray_trained_loads_with_peft_and_gives_the_same_logits(
    case: str, tmp_path: Path
) -> None:
    """Trained a few steps on its route (so A and B are nonzero), saved in PEFT's layout, loaded
    by PEFT onto a plain copy of the base: logits equal govray's with the adapter active, exactly
    (torch.equal: the same PEFT layer code runs in both)."""
    config, _ = CASES[case]
    model = governed(case)
    optimizer = torch.optim.SGD(model.adapter_parameters("pii-lora"), lr=0.5)
    model.train()
    with model.active("pii-lora"):
        for _ in range(3):
            trial_for(config).loss(model, batch(config)).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert all(parameter.abs().sum() > 0 for parameter in model.adapter_parameters("pii-lora"))

    directory = save_peft_adapter(model, "pii-lora", tmp_path / "pii-lora")
    assert sorted(path.name for path in directory.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    plain = built(config, seed=4)
    plain.load_state_dict(model.base_state(), strict=True)
    loaded = peft.PeftModel.from_pretrained(plain, str(directory))
    loaded.eval()
    model.eval()
    with model.active("pii-lora"):
        expected = logits(model, config)
    assert torch.equal(logits(loaded, config), expected)


def test_a_govray_lora_v1_adapter_file_still_loads(tmp_path: Path) -> None:
    """What govray wrote before adapters were PEFT layers: ledger names, ``lora_A`` [r, in],
    ``lora_B`` [out, r], metadata format ``govray-lora-v1`` — the same math as PEFT's Linear."""
    model = governed("gpt2-conv1d")
    generator = torch.Generator().manual_seed(2)
    tensors = {
        name: torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.adapter_tensors("pii-lora").items()
    }
    path = tmp_path / "adapter-pii-lora.safetensors"
    save_file(
        tensors,
        path,
        metadata={"adapter": "pii-lora", "format": "govray-lora-v1", "rank": "4", "alpha": "8.0"},
    )
    load_adapter(model, "pii-lora", path)
    for name, tensor in model.adapter_tensors("pii-lora").items():
        assert torch.equal(tensor, tensors[name]), name
    # c_attn's weight is [in, out] (Conv1D): the delta is x A^T B^T * alpha/r on top of it.
    block = model.base.transformer.h[0].attn.c_attn
    x = torch.randn(2, 32, generator=generator)
    a, b = (
        tensors["adapter/pii-lora/transformer.h.0.attn.c_attn.lora_A"],
        tensors["adapter/pii-lora/transformer.h.0.attn.c_attn.lora_B"],
    )
    with model.active("pii-lora"):
        assert torch.allclose(block(x), block.base_layer(x) + (x @ a.T) @ b.T * 2.0, atol=1e-6)


@pytest.mark.parametrize("case", ["llama-linear", "gpt2-conv1d"])
def test_a_causal_lms_peft_export_names_its_task_and_loads_with_auto_peft_model_for_causal_lm(
    case: str, tmp_path: Path
) -> None:
    """The base saved locally and built from there (its ``name_or_path``): the export says
    ``task_type: CAUSAL_LM``, and ``AutoPeftModelForCausalLM.from_pretrained(directory)`` (base
    and adapter, nothing downloaded) gives govray's logits with the adapter active."""
    import json

    config, targets = CASES[case]
    built(config).save_pretrained(tmp_path / "base")
    base = CausalLMTrial({"pretrained": str(tmp_path / "base"), "context": 32}).build_model()
    rules = policy(targets)
    model = GovernedModel(base, resolve_routes(rules, base, decoder_layers(base)), rules.adapters, seed=7)
    make_nonzero(model)
    directory = save_peft_adapter(model, "pii-lora", tmp_path / "pii-lora")
    assert json.loads((directory / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
    model.eval()
    with model.active("pii-lora"):
        expected = logits(model, config)
    assert torch.equal(logits(loaded, config), expected)
