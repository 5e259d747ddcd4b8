"""The depthwise conv's STE backward (`depthwise_grad`): cpu_fused's channel-block kernel (kernels/cpu/depthwise_backward.c)
against a float64 sum and against the reference backend (aten's convolution_backward).

Both compute fp32 sums, each in its own order, so neither equals the other bit for bit. What is checked instead, per
element: |got - exact| <= (n + 3) 2^-24 * sum |terms|, the worst case of n sequential fp32 additions of the products
plus the final scaling (exact: the same sum in float64), n the element's number of terms. A wrong tap, a dropped lane
(19 channels: a partial 16-lane block), a wrong stride or padding moves an element by a whole term, far past it.
The kernel's own order is fixed: the same bits on 1 and 2 threads, and whichever gradients are asked for.
"""

from __future__ import annotations

import pytest
import torch

from intqat.ops import backends, cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the fused C kernels are not built here")

U = 2.0**-24  # fp32's unit roundoff
Z_X, S_X = -3, 0.02

# (B, C, H, W, (kh, kw), stride, padding, dilation, x layout, g layout)
CASES = {
    "convnext-7x7": (2, 19, 9, 11, (7, 7), (1, 1), (3, 3), (1, 1), "nchw", "nchw"),
    "3x3-s2-cl": (3, 32, 8, 8, (3, 3), (2, 2), (1, 1), (1, 1), "channels_last", "channels_last"),
    "3x3-dilated": (2, 5, 9, 11, (3, 3), (2, 2), (2, 2), (2, 2), "nchw", "nchw"),
    "3x5-uneven-pad": (1, 17, 6, 7, (3, 5), (1, 2), (1, 0), (1, 1), "strided", "expanded"),
    "1x1": (2, 16, 4, 4, (1, 1), (1, 1), (0, 0), (1, 1), "nchw", "channels_last"),
}


def _operands(B, C, H, W, k, stride, padding, dilation, x_layout, g_layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_x = torch.randint(-128, 128, (B, C, H, 2 * W if x_layout == "strided" else W), dtype=torch.int8, generator=gen)
    q_x = q_x[..., ::2] if x_layout == "strided" else q_x
    if x_layout == "channels_last":
        q_x = q_x.contiguous(memory_format=torch.channels_last)
    q_w = torch.randint(-127, 128, (C, 1, *k), dtype=torch.int8, generator=gen)
    s_w = torch.rand(C, generator=gen) * 0.01 + 1e-3
    Ho = (H + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
    if g_layout == "expanded":  # what sum().backward() hands over: one value, strides 0
        g = torch.randn(1, generator=gen).expand(B, C, Ho, Wo)
    else:
        g = torch.randn(B, C, Ho, Wo, generator=gen)
        g = g.contiguous(memory_format=torch.channels_last) if g_layout == "channels_last" else g
    return g, q_x, q_w, s_w, (stride, padding, dilation)


def _exact_and_bound(g, q_x, q_w, s_w, conv):
    """float64 gradients and each element's bound (n + 3) u sum|terms| (n: its number of terms)."""
    stride, padding, dilation = conv
    C = q_w.shape[0]
    x_hat = (q_x.double() - Z_X) * S_X
    w_hat = q_w.double() * s_w.double().reshape(-1, 1, 1, 1)

    def bw(gg, xx, ww):
        return torch.ops.aten.convolution_backward(gg, xx, ww, [C], stride, padding, dilation, False, [0, 0], C,
                                                   [True, True, True])

    exact = bw(g.double(), x_hat, w_hat)
    sums = bw(g.double().abs(), x_hat.abs(), w_hat.abs())  # sum |terms| per element
    counts = bw(torch.ones_like(g, dtype=torch.float64), torch.ones_like(x_hat), torch.ones_like(w_hat))
    return exact, [(n + 3) * U * s + 1e-30 for n, s in zip(counts, sums)]


def _check(got, exact, bound, what):
    for name, a, e, b in zip(("grad_x", "grad_w", "grad_b"), got, exact, bound):
        err = (a.double() - e).abs()
        assert a.shape == e.shape and bool((err <= b).all()), (
            f"{what} {name}: max |err| {err.max():.3g} over its bound by {float((err / b).max()):.3g}x")


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_and_the_reference_are_within_fp32_rounding_of_the_exact_sums(name):
    g, q_x, q_w, s_w, conv = _operands(*CASES[name])
    exact, bound = _exact_and_bound(g, q_x, q_w, s_w, conv)
    got = cpu_kernels.depthwise_backward(g, q_x, Z_X, S_X, q_w, s_w, *conv, True, True, True)
    _check(got, exact, bound, "kernel")
    assert got[0].stride() == q_x.contiguous().stride() if CASES[name][8] == "strided" else got[0].stride() == q_x.stride()
    ref = backends.get("reference").depthwise_grad(g, q_x, torch.tensor(float(Z_X)), torch.tensor(S_X), q_w, s_w,
                                                   *conv, True, True, True)
    _check(ref, exact, bound, "reference")


@pytest.mark.parametrize("name", ["convnext-7x7", "3x3-s2-cl"])
def test_the_kernel_s_bits_do_not_depend_on_threads_or_on_what_is_asked(name):
    g, q_x, q_w, s_w, conv = _operands(*CASES[name])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.depthwise_backward(g, q_x, Z_X, S_X, q_w, s_w, *conv, True, True, True)
        torch.set_num_threads(2)
        two = cpu_kernels.depthwise_backward(g, q_x, Z_X, S_X, q_w, s_w, *conv, True, True, True)
    finally:
        torch.set_num_threads(threads)
    alone = [cpu_kernels.depthwise_backward(g, q_x, Z_X, S_X, q_w, s_w, *conv, *(i == j for j in range(3)))[i]
             for i in range(3)]
    for a, b, c in zip(one, two, alone):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)) and torch.equal(a.view(torch.int32), c.view(torch.int32))


def test_an_empty_batch_has_zero_weight_and_bias_gradients():
    g, q_x, q_w, s_w, conv = _operands(0, 19, 6, 6, (3, 3), (1, 1), (1, 1), (1, 1), "nchw", "nchw")
    gx, gw, gb = cpu_kernels.depthwise_backward(g, q_x, Z_X, S_X, q_w, s_w, *conv, True, True, True)
    assert gx.shape == (0, 19, 6, 6) and gw.shape == (19, 1, 3, 3) and not gw.any() and gb.shape == (19,) and not gb.any()


def test_a_model_s_depthwise_conv_takes_the_kernel_and_names_it():
    """In a model, the table runs depthwise_grad on cpu_fused (what intqat-bench's backends column prints); forcing
    the reference runs aten's, and the two gradients agree within fp32 rounding."""
    import intqat
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 24, 1), nn.ReLU(), nn.Conv2d(24, 24, 5, padding=2, groups=24), nn.ReLU(),
                          nn.Flatten(), nn.Linear(24 * 36, 3))
    intqat.prepare_qat(model, "w8a8")
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    intqat.calibrate(model, [x])
    intqat.to_integer(model)
    grads = {}
    for force in (None, "reference"):
        model.zero_grad()
        with (backends.use_backend(force) if force else backends.recording()) as ran:
            model(x).square().sum().backward()
        if force is None:
            assert ran[("depthwise_grad", "cpu_fused")] == 1, dict(ran)
        grads[force] = model[2].weight.grad.clone()
    torch.testing.assert_close(grads[None], grads["reference"], rtol=1e-5, atol=1e-6 * float(grads[None].abs().max()))
