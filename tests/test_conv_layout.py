"""intqat::int_conv2d and memory formats: the output takes the input's format, as nn.Conv2d's does.

channels_last input -> channels_last output without a copy (the im2col rows are NHWC pixels);
NCHW input -> contiguous NCHW output, so model code that calls .view() on a conv output still runs.
The integer forward does not depend on the layout (torch.equal); the fp32 backward (oneDNN's
convolution_backward) may sum in another order per layout, so gradients agree to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import intqat
from intqat.ops.int_conv2d import int_conv2d, is_channels_last

CL = torch.channels_last


def _problem(seed=0, C=6, O=8, groups=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, C, 9, 7, generator=g)
    w = torch.randn(O, C // groups, 3, 3, generator=g) * 0.2
    b = torch.randn(O, generator=g)
    s_x, z_x = torch.tensor([x.abs().max().item() / 127 * 0.7]), torch.tensor([5.0])
    s_w = w.abs().amax(dim=(1, 2, 3)) / 127
    return x, w, b, s_x, z_x, s_w


@pytest.mark.parametrize("groups", [1, 2])
def test_output_follows_the_input_layout_with_the_same_values_and_grads(groups):
    x, w, b, s_x, z_x, s_w = _problem(groups=groups)
    results = {}
    for fmt in (torch.contiguous_format, CL):
        xx = x.clone().to(memory_format=fmt).requires_grad_()
        ww = w.clone().requires_grad_()
        y = int_conv2d(xx, ww, b, s_x, z_x, s_w, padding=1, groups=groups)
        assert is_channels_last(y) == (fmt is CL) and (y.is_contiguous() == (fmt is not CL))
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        results[fmt] = (y.detach().contiguous(), xx.grad.contiguous(), ww.grad)
    (y0, gx0, gw0), (y1, gx1, gw1) = results[torch.contiguous_format], results[CL]
    assert torch.equal(y0, y1)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw1, gw0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
def test_opcheck_in_both_layouts(fmt):
    x, w, b, s_x, z_x, s_w = _problem()
    x = x.to(memory_format=fmt)
    args = (x, w, b, s_x, z_x, s_w, [1, 1], [1, 1], [1, 1], 1, -128, 127, -127, 127, False, True)
    torch.library.opcheck(torch.ops.intqat.int_conv2d.default, args)  # fake strides == real strides


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL])
@pytest.mark.parametrize("groups,C,O", [(1, 6, 8), (6, 6, 6)])  # a plain and a depthwise conv
def test_eager_function_equals_the_custom_op(groups, C, O, fmt):
    """Eager calls skip torch.library's dispatch (an autograd.Function over the op's own forward and
    backward); tracers see the custom op: the same outputs and gradients, LSQ scales included."""
    x, w, b, s_x, z_x, s_w = _problem(groups=groups, C=C, O=O)
    x = x.to(memory_format=fmt).requires_grad_()
    inputs = [x, w.requires_grad_(), b.requires_grad_(), s_x.requires_grad_(), z_x.requires_grad_(),
              s_w.requires_grad_()]
    y = int_conv2d(x, w, b, s_x, z_x, s_w, padding=1, groups=groups)
    assert y.grad_fn.name() == "_IntConv2dEagerBackward"
    g = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    grads = torch.autograd.grad(y, inputs, g)
    y_op = torch.ops.intqat.int_conv2d(x, w, b, s_x, z_x, s_w, [1, 1], [1, 1], [1, 1], groups,
                                       -128, 127, -127, 127, False, True)[0]
    grads_op = torch.autograd.grad(y_op, inputs, g)
    assert torch.equal(y, y_op) and y.stride() == y_op.stride()
    for a, r in zip(grads, grads_op):
        assert torch.equal(a, r)


def test_lenet_style_view_after_the_swap():
    class LeNet(nn.Module):  # the classic tutorial model: .view() right after conv + pool
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)
            self.fc = nn.Linear(4 * 3 * 3, 5)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
            return self.fc(x.view(-1, 4 * 3 * 3))

    model = LeNet()
    x = torch.randn(6, 1, 8, 8)
    intqat.prepare_qat(model, "w8a8")
    intqat.calibrate(model, [x])
    intqat.to_integer(model)
    model(x).sum().backward()  # NCHW in, NCHW out: .view works
    with torch.no_grad():
        model.eval()
        assert model(x).shape == (6, 5)


def test_channels_last_model_end_to_end_matches_nchw():
    torch.manual_seed(0)
    # exact float ops only between the integer layers (ReLU, max pool, flatten), so outputs compare exactly
    float_model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten(),
                                nn.Linear(8 * 2 * 2, 4))
    x = torch.randn(4, 3, 12, 12)
    outs = []
    for fmt in (torch.contiguous_format, CL):
        m = intqat.prepare_qat(__import__("copy").deepcopy(float_model), "w8a8")
        intqat.calibrate(m, [x])
        intqat.to_integer(m)
        m = m.to(memory_format=fmt)
        y = m(x.to(memory_format=fmt))
        y.sum().backward()
        outs.append((y.detach(), m[0].weight.grad.clone()))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
