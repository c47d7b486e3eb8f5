"""What the entropy profile is computed on: ``probe.layer_representations`` captures each monitored
layer's representation of every example a forward passes, and leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from govray.train.control.probe import layer_representations
from govray.train.trial import ProbeHooks


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def test_each_layer_holds_every_forwards_rows_in_order() -> None:
    model = two_layers()
    first, second = torch.randn(3, 4), torch.randn(2, 4)

    def forward() -> None:
        model(first)
        model(second)

    captured = layer_representations(ProbeHooks(), model, ["0", "1"], forward)
    with torch.no_grad():
        inputs = torch.cat([first, second])
        assert torch.equal(captured["0"], model[0](inputs))
        assert torch.equal(captured["1"], model(inputs))


def test_the_trials_representation_hook_shapes_each_output() -> None:
    class Doubled(ProbeHooks):
        def representation(self, layer: str, output: object) -> torch.Tensor:
            assert isinstance(output, torch.Tensor)
            return output * 2

    model = two_layers()
    x = torch.randn(5, 4)
    captured = layer_representations(Doubled(), model, ["1"], lambda: model(x))
    with torch.no_grad():
        assert torch.allclose(captured["1"], model(x) * 2)


def test_a_layer_no_forward_reached_is_left_out() -> None:
    model = two_layers()
    captured = layer_representations(ProbeHooks(), model, ["0", "1"], lambda: model[0](torch.randn(3, 4)))
    assert list(captured) == ["0"]


def test_the_hooks_are_removed_even_when_the_forward_fails() -> None:
    model = two_layers()

    def failing() -> None:
        model(torch.randn(3, 4))
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        layer_representations(ProbeHooks(), model, ["0", "1"], failing)
    assert all(not module._forward_hooks for module in model)
