"""torchao's 8da4w QAT layers (per-group int4 weights, per-token int8 activations) -> GroupedIntLinear.

The converted layer keeps the group size and produces torchao's weight codes bit for bit; what remains
between the two is the activation scheme (torchao: asymmetric per token; intqat: symmetric per token),
measured here by SQNR on the layer and on a small transformer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import intqat
from intqat.nn import GroupedIntLinear

torchao_qat = pytest.importorskip("torchao.quantization.qat")
from torchao.quantization import quantize_  # noqa: E402
from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig  # noqa: E402


def _8da4w(group_size: int) -> QATConfig:
    return QATConfig(activation_config=IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
                     weight_config=IntxFakeQuantizeConfig(torch.int4, group_size=group_size), step="prepare")


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum()))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_torchao_per_group_layer_converts_with_its_group_size_and_codes(group_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64))
    quantize_(model, _8da4w(group_size))
    fq = model[0]
    w_torchao = fq.weight_fake_quantizer(fq.weight.detach())
    x = torch.randn(32, 256)
    with torch.no_grad():
        y_torchao = model(x)
    intqat.to_integer(model)
    layer = model[0]
    assert isinstance(layer, GroupedIntLinear) and layer.weight is fq.weight
    wq = layer.weight_quantizer
    assert (wq.group_size, wq.qmin, wq.qmax, wq.scale_div) == (group_size, -8, 7, 7.5)
    assert torch.equal(wq.fake_quant(layer.weight.detach()), w_torchao)  # torchao's int4 grid, same codes
    y = layer(x)
    assert _sqnr(y_torchao, y.detach()) > 35  # only the activation scheme differs (asym vs sym per token)
    y.sum().backward()
    assert layer.weight.grad is not None


class _Block(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc(self.ln(x))))


def test_train_deploy_mismatch_against_torchao_qat_model():
    torch.manual_seed(1)
    model = nn.Sequential(_Block(), _Block(), nn.Linear(128, 64))
    quantize_(model, _8da4w(32))
    x = torch.randn(4, 16, 128)
    with torch.no_grad():
        y_torchao = model(x)
    converted = intqat.to_integer(copy.deepcopy(model))
    program = torch.export.export(intqat.to_deployed(converted), (x,))
    y_program = program.module()(x).detach()
    with torch.no_grad():
        assert torch.equal(y_program, converted.eval()(x))  # intqat: train forward == program
    assert _sqnr(y_torchao, y_program) > 30  # torchao's fake quant vs the integer program it maps to
