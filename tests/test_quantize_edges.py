"""The quantize passes on the values where a vectorised pass could part from the scalar formula: ties, the clip
edges, NaN / inf, signed zeros, subnormals, huge values, all-zero groups, and spans of every tail length.

fused.c's passes (the Python path's and the C++ steps') against torch, and the per-group training step's whole-row
weight pass (grouped_linear.c: intqat_grouped_quantize_pack, intqat_grouped_dequantize; AVX-512) against the
Python path: output and gradients bit for bit."""

import pytest
import torch

from intqat.ops import backends, cpp_step, cpu_kernels, quantize_with_mask
from intqat.ops.int_linear import quantize_weight
from intqat.ops.int_linear_grouped import quantize_weight_grouped

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the fused C kernels are not built")

SPECIAL = [0.0, -0.0, 0.25, 0.75, 1.25, -0.25, -1.25, 63.25, 63.75, 64.0, -64.25, -64.5, 1e-45, -1e-40, 3e38, -3e38,
           float("inf"), float("-inf"), float("nan"), 127.5, -128.5]


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 40
    special = torch.tensor(SPECIAL)
    pick = torch.randint(0, len(SPECIAL), (n,), generator=g)
    where = torch.rand(n, generator=g) < 0.3
    return torch.where(where, special[pick], x)


def _both(fn):
    fused = fn()
    with backends.use_backend("reference"):
        ref = fn()
    return fused, ref


def _equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 31, 32, 33, 47, 64, 100])
@pytest.mark.parametrize("qmin,qmax,z", [(-128, 127, 3), (-127, 127, 0), (-8, 7, 0), (0, 255 // 2, 60)])
def test_static_codes_and_masks_equal_torch(cols, qmin, qmax, z):
    x = _values(7 * cols, cols + qmin).reshape(7, cols)
    s = torch.tensor(0.5)
    (q, m), (q_ref, m_ref) = _both(lambda: quantize_with_mask(x, s, torch.tensor(z), qmin, qmax))
    assert _equal(q, q_ref) and _equal(m, m_ref)


@pytest.mark.parametrize("N,K", [(3, 1), (5, 17), (9, 48), (4, 100)])
def test_weight_codes_scales_and_colsums_equal_torch(N, K):
    w = _values(N * K, N * K).reshape(N, K)
    w[-1] = float("nan")  # a NaN row: scale NaN, codes as torch makes them
    w = w.nan_to_num(nan=0.0, posinf=5.0, neginf=-5.0) if K == 1 else w
    fused, ref = _both(lambda: quantize_weight(w, None, -127, 127, need_mask=True, need_colsum=True))
    for a, b in zip(fused, ref):
        assert _equal(a.reshape(-1), b.reshape(-1)) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and
                                                         _equal(a.nan_to_num(0.0).reshape(-1), b.nan_to_num(0.0).reshape(-1)))


@pytest.mark.parametrize("group_size", [32, 64])
def test_grouped_weight_codes_equal_torch(group_size):
    w = _values(24 * 4 * group_size, group_size).reshape(24, 4 * group_size).nan_to_num(nan=1.0, posinf=9.0, neginf=-9.0)
    w[3, :group_size] = 0.0  # an all-zero group: scale eps
    fused, ref = _both(lambda: quantize_weight_grouped(w, None, group_size, -7, 7))
    assert _equal(fused[0], ref[0]) and _equal(fused[2], ref[2])


def _edge_weight(N: int, K: int, gs: int) -> torch.Tensor:
    """(N, K) weights whose groups hold ties at k + 0.5 codes (max 7: scale exactly 1), all-zero groups (scale eps),
    subnormals, signed zeros and values near float32's max."""
    w = _values(N * K, N + K).reshape(N, K).nan_to_num(nan=0.3, posinf=3e38, neginf=-3e38)
    ties = torch.tensor([7.0, 2.5, -3.5, 0.5, -0.5, 1.5, -6.5, 5.5])
    w[0, :gs] = ties.repeat(gs // len(ties))
    w[1, gs:2 * gs] = 0.0
    w[2, :gs] = torch.tensor([1e-45, -1e-45, 1e-40, -0.0] * (gs // 4))
    return w


@pytest.mark.skipif(cpp_step.unavailable_reason() is not None or not cpu_kernels.grouped_vnni_available(),
                    reason="the C++ grouped step needs the C++ ops and the per-group VNNI kernel (AVX512-VNNI)")
@pytest.mark.parametrize("gs,N", [(16, 5), (32, 33), (64, 40)])
def test_grouped_step_whole_row_pass_equals_python_path(gs, N):
    from intqat.ops.int_linear_grouped import int_linear_grouped

    K = 4 * gs
    w = _edge_weight(N, K, gs).requires_grad_()
    x = (torch.randn(9, K, generator=torch.Generator().manual_seed(gs)) * 3).requires_grad_()

    def step():
        y = int_linear_grouped(x, w, None, None, None, None, group_size=gs)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        return (y, *torch.autograd.grad(y, (x, w), g))

    with backends.recording() as ran:
        got = step()
    assert ran[("grouped_step", "cpp_step")] == 1, dict(ran)
    with cpp_step.disabled():
        want = step()
    for name, a, b in zip(("y", "grad_x", "grad_w"), got, want):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), name
