"""Removable adapters: exactly inactive off their route, independent init, stable base file, no pickle."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from govray.governance.adapter_files import load_adapter, save_adapter, save_base
from govray.governance.adapters import AdapterError, GovernedModel
from govray.governance.policy import DepthPolicy
from govray.governance.routing import RoutingTable, resolve_routes

ADAPTERS: dict[str, dict[str, Any]] = {
    "pii-lora": {"targets": ["hidden"], "rank": 4, "alpha": 8},
    "med-lora": {"targets": ["hidden", "head"], "rank": 2, "alpha": 4},
}


class DigitsMLP(nn.Module):
    """The digits example's model (embed, hidden, head), without dropout."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(64, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.embed(pixels / 16.0))
        x = torch.relu(self.hidden(x))
        return self.head(x)


class TiedModel(nn.Module):
    """A token embedding tied to the output head, as in language models."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(tokens))))


def policy_with(*adapters: str) -> DepthPolicy:
    rules: list[dict[str, Any]] = [
        {"name": "public", "match": {"license_class": "public-domain"}, "route": "all"}
    ]
    rules += [
        {"name": f"r-{name}", "match": {"corpus_id": name}, "route": {"adapter": name}} for name in adapters
    ]
    return DepthPolicy.model_validate(
        {
            "name": "digits",
            "version": 1,
            "adapters": {name: ADAPTERS[name] for name in adapters},
            "rules": rules,
        }
    )


def wrap(base: nn.Module, *adapters: str, seed: int = 7) -> GovernedModel:
    policy = policy_with(*adapters)
    table: RoutingTable = resolve_routes(policy, base)
    return GovernedModel(base, table, policy.adapters, seed=seed)


def base_and_model(*adapters: str, base_seed: int = 0, seed: int = 7) -> tuple[DigitsMLP, GovernedModel]:
    """A bare base and a governed model around an identically initialised copy."""
    torch.manual_seed(base_seed)
    bare = DigitsMLP()
    torch.manual_seed(base_seed)
    return bare, wrap(DigitsMLP(), *adapters, seed=seed)


def pixels() -> torch.Tensor:
    return torch.rand(5, 64, generator=torch.Generator().manual_seed(3)) * 16


def make_nonzero(model: GovernedModel, adapter: str) -> None:
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.adapter_parameters(adapter):
            parameter.copy_(torch.randn(parameter.shape, generator=generator))


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in state.items()}


def assert_same_tensors(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert sorted(left) == sorted(right)
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_base_names_are_the_users_and_adapters_live_apart() -> None:
    bare, model = base_and_model("pii-lora")
    assert list(model.base_state()) == list(bare.state_dict())
    assert model.adapter_names() == ("pii-lora",)
    assert list(model.adapter_tensors("pii-lora")) == [
        "adapter/pii-lora/hidden.lora_A",
        "adapter/pii-lora/hidden.lora_B",
    ]
    assert model.adapter_tensors("pii-lora")["adapter/pii-lora/hidden.lora_A"].shape == (4, 16)
    assert not model.adapter_tensors("pii-lora")["adapter/pii-lora/hidden.lora_B"].any()


def test_inactive_adapter_leaves_the_output_bit_identical() -> None:
    bare, model = base_and_model("pii-lora")
    make_nonzero(model, "pii-lora")
    assert model.active_adapter is None
    assert torch.equal(model(pixels()), bare(pixels()))
    with model.active("pii-lora"):
        assert not torch.equal(model(pixels()), bare(pixels()))
    assert model.active_adapter is None
    assert torch.equal(model(pixels()), bare(pixels()))


def test_active_adapter_adds_exactly_the_lora_delta() -> None:
    bare, model = base_and_model("pii-lora")
    make_nonzero(model, "pii-lora")
    tensors = model.adapter_tensors("pii-lora")
    a, b = tensors["adapter/pii-lora/hidden.lora_A"], tensors["adapter/pii-lora/hidden.lora_B"]
    x = torch.relu(bare.embed(pixels() / 16.0))
    hidden = bare.hidden(x) + (8 / 4) * (x @ a.T) @ b.T
    expected = bare.head(torch.relu(hidden))
    model.activate("pii-lora")
    assert torch.allclose(model(pixels()), expected, atol=1e-6)


def test_gradients_reach_the_active_adapter_only() -> None:
    _, model = base_and_model("pii-lora")
    make_nonzero(model, "pii-lora")
    with model.active("pii-lora"):
        model(pixels()).square().mean().backward()
    base = [parameter for _, parameter in model.base_named_parameters()]
    for parameter in [*model.adapter_parameters("pii-lora"), *base]:
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    model(pixels()).square().mean().backward()
    assert all(parameter.grad is None for parameter in model.adapter_parameters("pii-lora"))
    assert all(parameter.grad is not None for parameter in base)


def test_activate_refuses_an_unknown_adapter() -> None:
    _, model = base_and_model("pii-lora")
    with pytest.raises(AdapterError, match=r"no adapter 'med-lora' \(adapters: pii-lora\)"):
        model.activate("med-lora")


@pytest.mark.parametrize("adapters", [(), ("pii-lora",), ("pii-lora", "med-lora")])
def test_adapters_never_shift_base_initialisation(adapters: tuple[str, ...]) -> None:
    torch.manual_seed(5)
    expected = DigitsMLP().state_dict()
    after_bare = torch.rand(3)
    torch.manual_seed(5)
    model = wrap(DigitsMLP(), *adapters)
    assert_same_tensors(model.base_state(), expected)
    assert torch.equal(torch.rand(3), after_bare), "wrapping consumed the global RNG"


def test_adapter_init_ignores_other_adapters_and_the_global_rng() -> None:
    _, alone = base_and_model("pii-lora", base_seed=1)
    _, together = base_and_model("pii-lora", "med-lora", base_seed=2)
    assert_same_tensors(alone.adapter_tensors("pii-lora"), together.adapter_tensors("pii-lora"))
    _, other_seed = base_and_model("pii-lora", seed=8)
    a_name = "adapter/pii-lora/hidden.lora_A"
    assert not torch.equal(
        alone.adapter_tensors("pii-lora")[a_name], other_seed.adapter_tensors("pii-lora")[a_name]
    )
    assert not torch.equal(
        together.adapter_tensors("pii-lora")[a_name],
        together.adapter_tensors("med-lora")["adapter/med-lora/hidden.lora_A"],
    )


def test_drop_adapter_restores_the_base_model() -> None:
    bare, model = base_and_model("pii-lora", "med-lora")
    make_nonzero(model, "pii-lora")
    before = clone_state(model.base_state())
    model.activate("pii-lora")
    model.drop_adapter("pii-lora")
    assert model.active_adapter is None
    assert torch.equal(model(pixels()), bare(pixels()))
    assert_same_tensors(model.base_state(), before)
    assert model.adapter_names() == ("med-lora",)
    assert not any("pii-lora" in name for name, _ in model.named_parameters())
    with pytest.raises(AdapterError, match="no adapter 'pii-lora'"):
        model.adapter_tensors("pii-lora")
    with pytest.raises(AdapterError):
        model.activate("pii-lora")
    model.drop_adapter("med-lora")  # the last adapter gone, the user's modules are back as they were
    assert type(model.base.hidden) is nn.Linear and type(model.base.head) is nn.Linear
    assert list(model.base.state_dict()) == list(bare.state_dict())


def test_base_file_digest_does_not_depend_on_adapters(tmp_path: Path) -> None:
    _, plain = base_and_model()
    _, governed = base_and_model("pii-lora", "med-lora")
    make_nonzero(governed, "pii-lora")
    digest = save_base(plain, tmp_path / "plain.safetensors")
    assert save_base(governed, tmp_path / "governed.safetensors") == digest
    assert (tmp_path / "plain.safetensors").read_bytes() == (tmp_path / "governed.safetensors").read_bytes()
    assert_same_tensors(load_file(tmp_path / "governed.safetensors"), dict(plain.base_state()))


def test_adapter_file_round_trips_exactly(tmp_path: Path) -> None:
    _, trained = base_and_model("pii-lora")
    make_nonzero(trained, "pii-lora")
    path = tmp_path / "pii-lora.safetensors"
    digest = save_adapter(trained, "pii-lora", path)
    assert save_adapter(trained, "pii-lora", tmp_path / "again.safetensors") == digest
    assert_same_tensors(load_file(path), trained.adapter_tensors("pii-lora"))

    _, fresh = base_and_model("pii-lora", seed=99)
    load_adapter(fresh, "pii-lora", path)
    assert_same_tensors(fresh.adapter_tensors("pii-lora"), trained.adapter_tensors("pii-lora"))
    with fresh.active("pii-lora"), trained.active("pii-lora"):
        assert torch.equal(fresh(pixels()), trained(pixels()))


def test_adapter_file_metadata_is_canonical(tmp_path: Path) -> None:
    # safetensors writes metadata in hash-map order; sorted keys keep the bytes (digest) stable.
    _, model = base_and_model("pii-lora")
    path = tmp_path / "pii-lora.safetensors"
    save_adapter(model, "pii-lora", path)
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"].items()) == [
        ("adapter", "pii-lora"),
        ("alpha", "8.0"),
        ("format", "govray-lora-v1"),
        ("rank", "4"),
    ]


def tampered(tmp_path: Path, model: GovernedModel, edit: str) -> Path:
    tensors = {name: tensor.clone() for name, tensor in model.adapter_tensors("pii-lora").items()}
    if edit == "shape":
        tensors["adapter/pii-lora/hidden.lora_A"] = torch.zeros(5, 16)
    elif edit == "missing":
        del tensors["adapter/pii-lora/hidden.lora_B"]
    else:
        tensors["adapter/pii-lora/embed.lora_A"] = torch.zeros(4, 64)
    path = tmp_path / f"{edit}.safetensors"
    metadata = {"adapter": "pii-lora", "format": "govray-lora-v1", "rank": "4", "alpha": "8.0"}
    save_file(tensors, path, metadata=metadata)
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("shape", r"tensor 'adapter/pii-lora/hidden\.lora_A' has shape \(5, 16\), expected \(4, 16\)"),
        ("missing", r"missing tensor 'adapter/pii-lora/hidden\.lora_B'"),
        ("extra", r"unexpected tensor 'adapter/pii-lora/embed\.lora_A'"),
    ],
)
def test_mismatched_adapter_file_is_refused(tmp_path: Path, edit: str, message: str) -> None:
    _, model = base_and_model("pii-lora")
    before = clone_state(model.adapter_tensors("pii-lora"))
    path = tampered(tmp_path, model, edit)
    with pytest.raises(AdapterError, match=f"adapter file {path}: {message}"):
        load_adapter(model, "pii-lora", path)
    assert_same_tensors(model.adapter_tensors("pii-lora"), before)


def test_adapter_file_of_another_adapter_or_garbage_is_refused(tmp_path: Path) -> None:
    _, model = base_and_model("pii-lora", "med-lora")
    other = tmp_path / "med-lora.safetensors"
    save_adapter(model, "med-lora", other)
    with pytest.raises(
        AdapterError, match=f"adapter file {other}: .*adapter 'med-lora'.*expected .*'pii-lora'"
    ):
        load_adapter(model, "pii-lora", other)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(pickle.dumps({"adapter/pii-lora/hidden.lora_A": [0.0]}))
    with pytest.raises(AdapterError, match=f"adapter file {garbage}: not a readable safetensors file"):
        load_adapter(model, "pii-lora", garbage)


def test_files_are_read_without_unpickling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, model = base_and_model("pii-lora")
    save_base(model, tmp_path / "model.safetensors")
    save_adapter(model, "pii-lora", tmp_path / "pii-lora.safetensors")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    load_adapter(model, "pii-lora", tmp_path / "pii-lora.safetensors")
    assert set(load_file(tmp_path / "model.safetensors")) == set(model.base_state())


def test_tied_weights_save_and_reload_equal(tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = TiedModel()
    model = wrap(base, "pii-lora")
    path = tmp_path / "model.safetensors"
    save_base(model, path)
    loaded = load_file(path)
    assert set(loaded) == {"embed.weight", "hidden.weight", "hidden.bias", "head.weight"}
    assert torch.equal(loaded["head.weight"], loaded["embed.weight"])

    torch.manual_seed(1)
    fresh = TiedModel()
    fresh.load_state_dict(loaded, strict=True)
    assert fresh.head.weight is fresh.embed.weight
    assert_same_tensors(fresh.state_dict(), model.base_state())
    assert base.head.weight is base.embed.weight, "saving untied the model"
