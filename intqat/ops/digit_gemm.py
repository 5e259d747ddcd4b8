"""The straight-through backward GEMMs on the int8 units: fp32 gradients split into int8 digits.

Why: int_linear's backward is two GEMMs of fp32 gradients with int8 codes,
    grad_x = (g * s_w) @ float(q_w)          (M, N) @ (N, K)
    grad_w = (g * s_x)ᵀ @ (float(q_x) - z_x)  (N, M) @ (M, K)
and on CPUs with int8 dot units an fp32 GEMM costs 4x-9x an int8 one: with the forward on the int8 units, the two
fp32 GEMMs are most of a training step. The codes are exact small integers; only the gradient
side is fp32. Split it, per row, into three int8 digits on a power-of-two grid (the Ozaki scheme
for exact matrix products, Ozaki et al. 2012, cut at three digits):

    a[r, c] * 2^t[r] = d0 + d1 / 2^7 + d2 / 2^14 + e,    |d0| <= 127, |d1|, |d2| <= 64, |e| <= 2^-15
    (a @ q)[r, k]    = 2^-(t[r] + 14) * sum_j 2^(14 - 7j) * (d_j @ q)[r, k]          (+ e's share)

Each d_j @ q is an exact int8 GEMM, the weighted sum is an integer below 2^53 (exact in double),
and the final scaling by a power of two is exact: the result is the exact product of the
digit-rounded gradient with the codes, rounded once to fp32. The only approximation is the split:
each element of a row is kept to 21 bits below the row's largest element (absolute error <= 2^-15
grid steps, i.e. <= 4.8e-7 of the row's largest magnitude), against fp32's 24 bits per element and
an fp32 GEMM's own accumulation rounding. A bf16 backward keeps 8 bits per element.

Two kernels compute the same bits:
- AMX (kernels/cpu/amx_digits.c; CPUs with AMX-INT8 under Linux): the three planes are accumulated
  in AMX tiles, 32x32 output blocks at a time, and combined before anything leaves L1: one fp32
  write per output element.
- elsewhere: the three planes stacked into one `torch._int_mm` call, whose (3R, K) int32 product is
  written out and read back by the combine (fused C kernels in kernels/cpu/fused.c).

Where it pays (`digits_pay`) is the `slow("digit_matmul")` rule of the backend that would run it: the
thresholds are named constants beside those backends (intqat/ops/backends/amx.py, cpu_fused.py), each with the
CPU class it was measured on: with AMX, both backward GEMMs from M >= 128 and M*N*K >= 2^26; through
torch._int_mm on AMD Zen 5 with AVX-512 VNNI (int8 ~8x fp32's rate), both from M*N*K >= 2^21 (grad_w with
64 <= M <= 2 max(N, K)); on other CPUs with int8 dot units (int8 ~4x fp32), only grad_x, from N >= 512 and
M*N*K >= 2^24; elsewhere (fp32_exact, the reference's torch twin) never. `grad_gemm="fp32"` (QuantConfig /
int_linear) keeps the plain fp32 GEMMs of docs/numerics.md. Contractions longer than MAX_K_INT32 (int32 digit sums
could overflow) take that path.

The C kernels and the torch functions here compute the same bits; tests/test_digit_gemm.py checks
both kernels against them and the error bound.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from intqat.ops import backends
from intqat.ops.backends.formulas import _DIGIT, _SCALE_ALL, combine_digits, split_digits  # noqa: F401 (re-exported)

__all__ = ["GRAD_GEMMS", "check_grad_gemm", "digits_pay", "split_digits", "combine_digits", "digit_matmul"]

GRAD_GEMMS = ("int8x3", "fp32")


def check_grad_gemm(grad_gemm: str) -> str:
    if grad_gemm not in GRAD_GEMMS:
        raise ValueError(
            f"grad_gemm={grad_gemm!r}: choose 'int8x3' (backward GEMMs on the int8 units, gradients split "
            "into three int8 digits, ~21 bits) or 'fp32' (plain fp32 GEMMs)")
    return grad_gemm


def digits_pay(M: int, K: int, N: int, grad: str = "x") -> bool:
    """Is this backward GEMM of int_linear (x (M, K), W (N, K)) faster as a digit GEMM than in fp32?

    grad "x": grad_x = (M, N) @ (N, K); grad "w": grad_w = (N, M) @ (M, K). The table's answer
    (`backends.fast`): the backend an eager run would take for `digit_matmul` (also while compile traces the
    backward: the opaque intqat::digit_matmul runs the eager kernels, so the graph decides as eager does),
    and its `slow` rule for this shape."""
    return backends.fast("digit_matmul", (M, K, N), grad)


def digit_matmul(a: Tensor, col_scale: Tensor, q: Tensor, z: int | Tensor, mask: Tensor | None = None) -> Tensor:
    """where(mask, (a * col_scale) @ (float(q) - z), 0) for a fp32 (R, C), q int8 (C, K): (R, K) fp32.

    z: q's zero point, an int or a one-element integer tensor.

    The product runs as one int8 GEMM over the three digit planes (module docstring). a may be a
    transposed view (the kernels read it in place). Contractions longer than MAX_K_INT32 take the
    fp32 GEMM. Traced (torch.compile's backward graph, make_fx), the call is one opaque node,
    `intqat::digit_matmul`, which runs the same kernels when the compiled program runs: compiled and
    eager gradients are the same bits, and inductor does not regenerate the split and combine.
    """
    if backends.tracing(a, col_scale, q, mask, z if isinstance(z, Tensor) else None):
        zt = z.reshape(1) if isinstance(z, Tensor) else torch.tensor([z], dtype=torch.int32)
        return _digit_matmul_op(a, col_scale, q, zt, mask)
    return _digit_matmul(a, col_scale, q, z, mask)


@torch.library.custom_op("intqat::digit_matmul", mutates_args=())
def _digit_matmul_op(a: Tensor, col_scale: Tensor, q: Tensor, z: Tensor, mask: Optional[Tensor]) -> Tensor:
    """The traced form of `digit_matmul` (z a one-element integer tensor)."""
    return _digit_matmul(a, col_scale, q, z, mask)


@_digit_matmul_op.register_fake
def _(a, col_scale, q, z, mask):
    return a.new_empty((a.shape[0], q.shape[1]), dtype=torch.float32)


def _digit_matmul(a: Tensor, col_scale: Tensor, q: Tensor, z: int | Tensor, mask: Tensor | None) -> Tensor:
    """`digit_matmul` on real tensors: the backend the table picks (the C kernels, or the torch twin)."""
    b = backends.select("digit_matmul", a, col_scale, q, mask)
    if isinstance(z, Tensor) and not b.traceable:
        z = int(z.reshape(()))  # a constant for the kernels (the twin also takes the tensor)
    return b.digit_matmul(a, col_scale, q, z, mask)
