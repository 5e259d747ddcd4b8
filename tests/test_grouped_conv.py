"""Grouped and depthwise integer convs as one computation, and in-place activations after integer convs.

The reference is the per-group computation docs/numerics.md defines (im2col, int_mm per group, the integer
epilogue): the one grouped fp32 convolution of the codes must give the same bits (torch.equal).
"""

import pytest
import torch
from torch import nn

import intqat
from intqat.ops.int_conv2d import _im2col, _weight_columns, conv_codes_forward
from intqat.ops.int_linear import integer_epilogue, weight_colsum
from intqat.ops.int_mm import int_mm


def _per_group_reference(q_x, z_x, s_x, q_w, colsum, w_scale, bias, stride, padding, dilation, groups):
    B = q_x.shape[0]
    O, _, kh, kw = q_w.shape
    cols, Ho, Wo = _im2col(q_x, int(z_x), (kh, kw), stride, padding, dilation, groups)
    qw2 = _weight_columns(q_w)
    kg, og = qw2.shape[1], O // groups
    outs = []
    for g in range(groups):
        acc = int_mm(cols[:, g * kg:(g + 1) * kg].contiguous(), qw2[g * og:(g + 1) * og].t())
        sl = slice(g * og, (g + 1) * og)
        outs.append(integer_epilogue(acc, z_x, colsum[sl], s_x, w_scale[sl], None if bias is None else bias[sl]))
    return torch.cat(outs, 1).reshape(B, Ho, Wo, O).permute(0, 3, 1, 2)


CASES = [  # (C, O, groups, kernel, stride, padding, dilation)
    (8, 8, 8, 3, 1, 1, 1),       # depthwise
    (16, 32, 16, 3, 2, 1, 1),    # depthwise with a channel multiplier 2, stride 2
    (16, 32, 4, 3, 2, 1, 1),     # grouped
    (8, 8, 2, 5, 1, 2, 2),       # dilation
    (128, 128, 2, 3, 1, 1, 1),   # 64 * 9 = 576 terms per group > 512: cut into channel chunks
    (96, 96, 96, 7, 1, 3, 1),    # depthwise 7x7
]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("z", [0, 17, -128])
def test_grouped_conv_equals_the_per_group_int_mm(case, channels_last, z):
    C, O, g, k, st, pd, dl = case
    torch.manual_seed(0)
    q_x = torch.randint(-128, 128, (2, C, 9, 9), dtype=torch.int8)
    q_x[0] = -128  # the extremes: every product at its largest magnitude
    q_w = torch.randint(-127, 128, (O, C // g, k, k), dtype=torch.int8)
    q_w[0] = 127
    if channels_last:
        q_x = q_x.to(memory_format=torch.channels_last)
    z_x, s_x = torch.tensor([z], dtype=torch.int32), torch.tensor([[0.013]])
    w_scale, bias = torch.rand(O) * 0.02 + 1e-3, torch.randn(O)
    colsum = weight_colsum(q_w.reshape(O, -1))
    args = (q_x, z_x, s_x, q_w, colsum, w_scale, bias, (st, st), (pd, pd), (dl, dl), g)
    y = conv_codes_forward(*args, pad_value=z)
    assert torch.equal(y, _per_group_reference(*args))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt)  # the input's memory format, as nn.Conv2d returns


def _depthwise_net():
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
                         nn.Conv2d(8, 16, 4), nn.ReLU6(inplace=True),  # 4x4 -> 1x1 output
                         nn.Conv2d(16, 16, 1, groups=16), nn.ReLU6(inplace=True), nn.Flatten(), nn.Linear(16, 3))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_inplace_activations_after_integer_convs_train(channels_last):
    """The op's output must not be a view (1x1 maps, channels_last rows): ReLU6(inplace=True) after it."""
    torch.manual_seed(0)
    model, x = _depthwise_net(), torch.randn(4, 4, 8, 8)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    intqat.prepare_qat(model, "w8a8")
    model(x)
    intqat.to_integer(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(4):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    model.eval()
    with torch.no_grad():
        y = model(x)
    assert torch.equal(model(x).detach(), y)  # grad-enabled (the op) == no_grad (aten ops), bit for bit
    assert torch.equal(intqat.to_deployed(model)(x), y)


def test_exported_depthwise_conv_is_one_node_not_a_loop():
    torch.manual_seed(0)
    model, x = _depthwise_net(), torch.randn(4, 4, 8, 8)
    intqat.prepare_qat(model, "w8a8")
    model(x)
    intqat.to_integer(model)
    program = torch.export.export(intqat.to_deployed(model), (x,))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten._int_mm.default) == 2 + 1  # the two groups == 1 convs, the linear
    assert targets.count(torch.ops.aten.conv2d.default) + targets.count(torch.ops.aten.convolution.default) == 2
    with torch.no_grad():
        assert torch.equal(program.module()(x), intqat.to_deployed(model)(x))
