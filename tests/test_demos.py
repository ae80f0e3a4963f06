"""`lightning_varuna.demos.MLP`: the model the benchmarks and tests train, with its options."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_varuna import CutPoint
from lightning_varuna.demos import MLP


def test_an_mlp_has_a_cutpoint_between_each_two_layers():
    model = MLP(8, 3)
    assert [type(m) for m in model.layers] == [nn.Linear] * 3 and [type(m) for m in model.cuts] == [CutPoint] * 2
    x = torch.randn(4, 8)
    expected = x
    for layer in model.layers:
        expected = torch.tanh(layer(expected))
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_the_options_choose_the_activation_dropout_and_optimizer():
    model = MLP(8, 2, activation="relu", dropout=0.5, optimizer="sgd", lr=0.25).eval()
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), torch.relu(model.layers[1](torch.relu(model.layers[0](x)))), rtol=0, atol=0)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["lr"] == 0.25
    assert optimizer.defaults["momentum"] == 0.9
    assert isinstance(MLP(8, 2).configure_optimizers(), torch.optim.AdamW)
    assert MLP(8, 1, activation=torch.sin)(torch.zeros(1, 8)).shape == (1, 8)


def test_layers_built_in_configure_model_come_once_and_where_it_runs():
    model = MLP(8, 2, build_in_configure_model=True)
    assert not list(model.parameters())
    with torch.device("meta"):
        model.configure_model()
    layers = model.layers
    model.configure_model()  # Lightning may call the hook again
    assert model.layers is layers and all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"width": 0}, "width=0"),
        ({"layers": 0}, "layers=0"),
        ({"activation": "swish"}, "activation='swish'"),
        ({"optimizer": "adam"}, "optimizer='adam'"),
        ({"dropout": 1.0}, "dropout=1.0"),
    ],
)
def test_a_bad_option_is_named(options, named):
    with pytest.raises(ValueError, match=rf"`MLP\(.*{named}"):
        MLP(**options)
