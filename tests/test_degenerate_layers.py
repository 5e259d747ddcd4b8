"""Layers with one input feature / channel: every path against the reference, bit for bit.

Why: torch._int_mm (CPU, torch 2.13) multiplies some operands with a size-1 dim wrongly, e.g. q_wᵀ of a
layer with K = 1, a (1, N) view with strides (1, 1) (tests/test_int_mm.py keeps the raw cases). The
public int_mm copied such operands, but the fused linear forward (cpu_fused), the C++ training ops and
the conv's GEMM called torch._int_mm themselves: an `nn.Linear(1, 8)` or a 1-channel 1x1 conv trained
on numbers around 1e4 where the layer computes ~1 (found in review; eval and export were right).
Each path here is compared with the reference backend, y and every gradient, and a whole model's
training forward with its exported program.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import intqat
from intqat.ops import backends, cpp_step, int_linear
from intqat.ops.int_conv2d import int_conv2d

PATHS = ["default", "python", "cpu_fused", "avx2_int16", "fp32_exact"]  # default: the C++ op where it runs


def _context(path):
    if path == "python":
        return cpp_step.disabled()
    if path == "default":
        return torch.enable_grad()
    reason = backends.unavailable(path)
    if reason is not None:
        pytest.skip(f"backend {path} cannot run here: {reason}")
    return backends.use_backend(path)


def _bits(t):
    return t.view(torch.int32)  # NaN == NaN, -0.0 != 0.0


def _linear_step(M, K, N, dynamic):
    g = torch.Generator().manual_seed(K * 100 + N)
    x = (torch.randn(M, K, generator=g) * 2).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.3).requires_grad_()
    b = torch.randn(N, generator=g).requires_grad_()
    y = int_linear(x, w, b, torch.tensor([0.02]), torch.tensor([3.0]), None, x_dynamic=dynamic)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,K,N,dynamic", [(5, 1, 3, False), (64, 1, 8, False), (64, 1, 8, True), (1, 1, 7, False)])
def test_linear_with_one_input_feature_equals_the_reference(path, M, K, N, dynamic):
    with _context(path):
        got = _linear_step(M, K, N, dynamic)
    with backends.use_backend("reference"):
        want = _linear_step(M, K, N, dynamic)
    for name, a, b in zip(("y", "grad_x", "grad_w", "grad_b"), got, want):
        assert torch.equal(_bits(a), _bits(b)), f"{name}: max |diff| {(a - b).abs().max()}"
    # and the formula itself (docs/numerics.md), in float64: |y| of a K = 1 layer is a few units, not ~1e4
    assert got[0].abs().max() < 20


def _conv_step(layout, O):
    g = torch.Generator().manual_seed(O)
    x = torch.randn(2, 1, 5, 5, generator=g)
    x = (x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x).requires_grad_()
    w = (torch.randn(O, 1, 1, 1, generator=g) * 0.3).requires_grad_()
    b = torch.randn(O, generator=g).requires_grad_()
    s_w = w.detach().abs().amax(dim=(1, 2, 3)) / 127
    y = int_conv2d(x, w, b, torch.tensor([0.03]), torch.tensor([-4.0]), s_w)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_pointwise_conv_with_one_input_channel_equals_the_reference(path, layout):
    with _context(path):
        got = _conv_step(layout, O=4)
    with backends.use_backend("reference"):
        want = _conv_step(layout, O=4)
    assert torch.equal(_bits(got[0]), _bits(want[0])), f"y: max |diff| {(got[0] - want[0]).abs().max()}"
    assert torch.equal(_bits(got[1]), _bits(want[1])) and torch.equal(_bits(got[3]), _bits(want[3]))
    # grad_w: one fp32 convolution_backward on either side; with C = 1 channels_last and NCHW are the same
    # bytes, which mkldnn may sum in another order (~1 ulp of the sum over 50 pixels)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


def test_a_model_with_one_input_feature_trains_on_what_it_deploys():
    """nn.Linear(1, 8) and Conv2d(1, 4, 1) through the whole flow: the training forward (the C++ op where
    it runs) equals the eval forward and the exported program, bit for bit."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(1, 8), nn.ReLU(), nn.Linear(8, 2))
    cnn = nn.Sequential(nn.Conv2d(1, 4, 1), nn.ReLU(), nn.Conv2d(4, 2, 3))
    for model, x in ((mlp, torch.randn(32, 1)), (cnn, torch.randn(4, 1, 6, 6))):
        model = intqat.prepare_qat(model, "w8a8")
        intqat.calibrate(model, [x])
        intqat.freeze_observers(model)
        model = intqat.to_integer(model)
        model.train()
        train_y = model(x).detach()  # grad enabled: the differentiable op
        model.eval()
        with torch.no_grad():
            eval_y = model(x)
        exported = torch.export.export(model, (x,)).module()(x)
        assert torch.equal(train_y, eval_y) and torch.equal(eval_y, exported)


@pytest.mark.parametrize("path", PATHS)
def test_empty_weights_and_a_permuted_input_equal_the_reference(path):
    """A layer with no output (N = 0) or no input (K = 0) feature trains on every backend (the reference raised),
    and a permuted 3-D input gives the reference's grad_w bit for bit (the reference kept x's layout for x_hat,
    and its fp32 GEMM summed in another order: 1 ulp)."""

    def step(x, w):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = int_linear(x, w, None, torch.tensor([0.02]), torch.tensor([3.0]), None)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        return y.detach(), x.grad, w.grad

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(4, 7, generator=g), torch.randn(0, 7, generator=g)),
             (torch.randn(4, 0, generator=g), torch.randn(3, 0, generator=g)),
             (torch.randn(6, 7, 5, generator=g).permute(0, 2, 1), torch.randn(3, 7, generator=g))]
    for x, w in cases:
        with _context(path):
            got = step(x, w)
        with backends.use_backend("reference"):
            want = step(x, w)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), (tuple(x.shape), tuple(w.shape))
