"""A pointwise (1x1) conv's fp32 STE backward as two batched GEMMs (int_conv2d._pointwise_grads, the Python path and
the C++ conv step alike) against a float64 sum and aten's convolution_backward.

Both are fp32 sums in different orders: each element is checked against the exact sum within
(n + 3) 2^-24 sum|terms| (n: its number of terms), the worst case of sequential fp32 summation; a wrong stride or a
transposed operand moves elements by whole terms. That the C++ step gives the Python path's bits is
tests/test_conv_nchw_step.py's and test_conv_paths.py's (their 1x1 cases)."""

from __future__ import annotations

import pytest
import torch

from intqat.ops.int_conv2d import _pointwise_grads, pointwise_nchw

U = 2.0**-24


@pytest.mark.parametrize("B, C, O, H, stride", [(3, 19, 33, 9, (1, 1)), (2, 16, 40, 11, (2, 2)), (2, 8, 5, 7, (2, 1)),
                                                (0, 8, 4, 5, (1, 1))])
def test_the_two_gemms_are_within_fp32_rounding_of_the_exact_sums(B, C, O, H, stride):
    gen = torch.Generator().manual_seed(B + C + O)
    x_hat = torch.randn(B, C, H, H + 1, generator=gen)
    w_hat = torch.randn(O, C, 1, 1, generator=gen)
    Ho, Wo = (H - 1) // stride[0] + 1, H // stride[1] + 1
    g = torch.randn(B, O, Ho, Wo, generator=gen)
    assert pointwise_nchw(g, x_hat, w_hat, (0, 0), 1)
    got = _pointwise_grads(g, x_hat, w_hat, stride, x_hat.shape, True, True, True)

    def bw(gg, xx, ww):
        return torch.ops.aten.convolution_backward(gg, xx, ww, [O], list(stride), [0, 0], [1, 1], False, [0, 0], 1,
                                                   [True, True, True])

    exact = bw(g.double(), x_hat.double(), w_hat.double())
    sums = bw(g.double().abs(), x_hat.double().abs(), w_hat.double().abs())
    counts = bw(torch.ones_like(g, dtype=torch.float64), torch.ones_like(x_hat, dtype=torch.float64),
                torch.ones_like(w_hat, dtype=torch.float64))
    aten = bw(g, x_hat, w_hat)
    for name, a, r, e, s, n in zip(("grad_x", "grad_w", "grad_b"), got, aten, exact, sums, counts):
        bound = (n + 3) * U * s + 1e-30
        assert a.shape == e.shape, name
        assert bool(((a.double() - e).abs() <= bound).all()), f"{name}: {float(((a.double() - e).abs() / bound).max()):.3g}x its bound"
        assert bool(((r.double() - e).abs() <= bound).all()), f"aten {name}"


def test_only_dense_nchw_unpadded_ungrouped_1x1_convs_take_it():
    g, q, w = torch.zeros(1, 4, 3, 3), torch.zeros(1, 4, 3, 3, dtype=torch.int8), torch.zeros(4, 4, 1, 1)
    assert pointwise_nchw(g, q, w, (0, 0), 1)
    assert not pointwise_nchw(g, q, w, (1, 1), 1)  # padded: the border pixels read zeros
    assert not pointwise_nchw(g, q, torch.zeros(4, 2, 1, 1), (0, 0), 2)
    assert not pointwise_nchw(g, q, torch.zeros(4, 4, 3, 3), (0, 0), 1)
    cl = torch.zeros(2, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    assert not pointwise_nchw(cl, q, w, (0, 0), 1) and not pointwise_nchw(g, cl.to(torch.int8), w, (0, 0), 1)
