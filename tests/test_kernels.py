"""Triton kernels against the CPU formulas of docs/numerics.md.

Exact (torch.equal) where the arithmetic is integer or the kernel rounds like torch; within
1 ulp where docs/numerics.md allows an FMA (the fp32 epilogue); fp32 GEMM results within
rtol 1e-5, atol 1e-5 * max|ref| (a different summation order). Without a GPU the kernels run
in Triton's interpreter, which must be switched on before triton is first imported (conftest
does it for the whole suite; the line below covers running this file alone).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from intqat.kernels import (  # noqa: E402
    int_linear_accumulator,
    int_linear_forward,
    int_mm,
    ste_grad_input,
    ste_grad_weight,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def codes(*shape, generator=None):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator).to(DEVICE)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # fp32 bit patterns mapped to a monotonic integer line: the difference counts ulps.
    def line(t):
        i = t.float().contiguous().view(torch.int32).long()
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)

    return (line(a) - line(b)).abs()


def assert_fp32_close(out, ref):
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * max(ref.abs().max().item(), 1e-30))


# ---------------------------------------------------------------------------------------------
# int_mm: exact
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (1, 70, 33), (37, 70, 45), (64, 96, 32), (33, 17, 1)])
def test_int_mm_exact(M, K, N):
    g = torch.Generator().manual_seed(M * 1000 + K * 10 + N)
    a, b = codes(M, K, generator=g), codes(K, N, generator=g)
    a[0, 0] = b[0, 0] = -128  # the extreme code
    c = int_mm(a, b)
    assert c.dtype == torch.int32 and c.shape == (M, N)
    assert torch.equal(c, (a.long() @ b.long()).int())
    assert torch.equal(c, torch._int_mm(a, b))


def test_int_mm_any_strides():
    a_t, b_t = codes(70, 37), codes(45, 70)
    a, b = a_t.t(), b_t.t()  # transposed views, (37, 70) and (70, 45)
    assert not a.is_contiguous() and not b.is_contiguous()
    assert torch.equal(int_mm(a, b), (a.long() @ b.long()).int())
    big_a, big_b = codes(80, 150), codes(100, 99)
    a, b = big_a[::2, ::3], big_b[::2, 1::2]  # non-unit strides on both axes
    assert torch.equal(int_mm(a, b), (a.long() @ b.long()).int())


@pytest.mark.parametrize("M, K, N", [(0, 5, 3), (4, 5, 0), (4, 0, 3), (0, 0, 0)])
def test_int_mm_zero_size(M, K, N):
    c = int_mm(codes(M, K), codes(K, N))
    assert c.shape == (M, N) and c.dtype == torch.int32
    assert torch.equal(c, torch.zeros(M, N, dtype=torch.int32, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# Integer linear forward
# ---------------------------------------------------------------------------------------------


def linear_case(M, K, N, per_row, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_x, q_w = codes(M, K, generator=g), codes(N, K, generator=g)
    rows = M if per_row else 1
    x_scale = (torch.rand(rows, generator=g) * 0.05 + 0.01).to(DEVICE)
    x_zero_point = torch.randint(-20, 20, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    w_scale = (torch.rand(N, generator=g) * 0.01 + 1e-3).to(DEVICE)
    bias = torch.randn(N, generator=g).to(DEVICE)
    w_colsum = q_w.sum(1, dtype=torch.int32)
    return q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias


def reference_accumulator(q_x, q_w, x_zero_point):
    return ((q_x.long() - x_zero_point.long()[:, None]) @ q_w.long().t()).int()


def reference_y(acc, x_scale, w_scale, bias):
    y = acc.float() * (x_scale[:, None] * w_scale[None, :])
    return y if bias is None else y + bias


@pytest.mark.parametrize("per_row", [False, True])
def test_accumulator_exact(per_row):
    q_x, q_w, _, x_zero_point, _, w_colsum, _ = linear_case(37, 70, 45, per_row)
    acc = int_linear_accumulator(q_x, q_w, x_zero_point, w_colsum)
    assert torch.equal(acc, reference_accumulator(q_x, q_w, x_zero_point))


def test_accumulator_extremes_strides_and_int64_zero_point():
    q_x = torch.full((40, 3, 96), -128, dtype=torch.int8, device=DEVICE)[:, 1, :]  # row stride 288
    q_w = torch.full((96, 33), -128, dtype=torch.int8, device=DEVICE).t()  # (33, 96) transposed view
    x_zero_point = torch.tensor([127], dtype=torch.int64, device=DEVICE)
    w_colsum = q_w.sum(1, dtype=torch.int32)
    acc = int_linear_accumulator(q_x, q_w, x_zero_point, w_colsum)
    assert torch.equal(acc, reference_accumulator(q_x, q_w, x_zero_point))


def test_accumulator_empty_k_keeps_zero_point_term():
    q_x, q_w = codes(3, 0), codes(4, 0)
    x_zero_point = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    w_colsum = torch.arange(4, dtype=torch.int32, device=DEVICE)  # as given by the caller
    acc = int_linear_accumulator(q_x, q_w, x_zero_point, w_colsum)
    assert torch.equal(acc, (-5 * w_colsum).expand(3, 4))


@pytest.mark.parametrize("per_row, with_bias", [(False, True), (True, True), (True, False)])
def test_forward_fp32_within_one_ulp(per_row, with_bias):
    q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias = linear_case(33, 80, 47, per_row, seed=1)
    bias = bias if with_bias else None
    y = int_linear_forward(q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias)
    ref = reference_y(reference_accumulator(q_x, q_w, x_zero_point), x_scale, w_scale, bias)
    assert y.dtype == torch.float32 and y.shape == (33, 47)
    assert ulp_distance(y, ref).max().item() <= 1


def test_forward_m1_and_transposed_weight():
    q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias = linear_case(1, 50, 19, per_row=False, seed=2)
    q_w_view = q_w.t().contiguous().t()  # same values, column-major
    y = int_linear_forward(q_x, q_w_view, x_scale, x_zero_point, w_scale, w_colsum, bias)
    ref = reference_y(reference_accumulator(q_x, q_w, x_zero_point), x_scale, w_scale, bias)
    assert ulp_distance(y, ref).max().item() <= 1


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_forward_half_outputs_are_the_rounded_fp32_result(out_dtype):
    args = linear_case(20, 40, 36, per_row=True, seed=3)
    y32 = int_linear_forward(*args)
    y = int_linear_forward(*args, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    assert torch.equal(y, y32.to(out_dtype))  # round to nearest even, as torch


def _bias_through(values: torch.Tensor, **kwargs):
    # acc = 0 and unit scales: y is the bias, bit for bit. Feeds chosen fp32 values to the epilogue.
    n = values.numel()
    one = torch.ones(1, device=DEVICE)
    zero_i = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    q_x = torch.zeros(2, 16, dtype=torch.int8, device=DEVICE)
    q_w = torch.zeros(n, 16, dtype=torch.int8, device=DEVICE)
    colsum = torch.zeros(n, dtype=torch.int32, device=DEVICE)
    return int_linear_forward(q_x, q_w, one, zero_i, torch.ones(n, device=DEVICE), colsum, values.to(DEVICE), **kwargs)[0]


def test_bfloat16_rounding_ties_to_even():
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0xBF808000, 0x7F7FFFFF, 0x00008000], dtype=torch.int64)
    values = bits.to(torch.int32).view(torch.float32)
    assert torch.equal(_bias_through(values, out_dtype=torch.bfloat16), values.to(DEVICE).bfloat16())


def test_requantize_rounds_half_to_even_and_clamps():
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49999976, 126.5, 127.5, -128.5, 1e30, -1e30])
    out_scale = torch.ones(1, device=DEVICE)
    zp = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    q = _bias_through(values, out_dtype=torch.int8, out_scale=out_scale, out_zero_point=zp)
    expected = torch.clamp(torch.round(values), -128, 127).to(torch.int8)
    assert torch.equal(q.cpu(), expected)


@pytest.mark.parametrize("out_qmin, out_qmax", [(-128, 127), (-100, 90)])
def test_requantize_exact(out_qmin, out_qmax):
    args = linear_case(31, 64, 40, per_row=True, seed=4)
    out_scale = torch.tensor([0.037], device=DEVICE)
    out_zero_point = torch.tensor([7], dtype=torch.int32, device=DEVICE)
    y = int_linear_forward(*args)  # the kernel's own fp32 y: the reference is then exact
    q = int_linear_forward(*args, out_dtype=torch.int8, out_scale=out_scale, out_zero_point=out_zero_point,
                           out_qmin=out_qmin, out_qmax=out_qmax)
    ref = torch.clamp(torch.round(y * (1.0 / out_scale)) + out_zero_point, out_qmin, out_qmax).to(torch.int8)
    assert q.dtype == torch.int8
    assert torch.equal(q, ref)
    # and it is torch's own fake-quant of y
    fq = torch.fake_quantize_per_tensor_affine(y, out_scale.item(), 7, out_qmin, out_qmax)
    assert torch.equal((q.float() - 7) * out_scale, fq)


def test_forward_zero_rows():
    q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias = linear_case(0, 8, 5, per_row=False)
    assert int_linear_forward(q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias).shape == (0, 5)


# ---------------------------------------------------------------------------------------------
# Straight-through backward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M, N, K", [(37, 45, 70), (1, 33, 17)])
def test_grad_input(M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    grad_out = torch.randn(N, M, generator=g).to(DEVICE).t()  # non-contiguous (M, N)
    q_w = codes(K, N, generator=g).t()  # (N, K) transposed view
    w_scale = (torch.rand(N, generator=g) * 0.01 + 1e-3).to(DEVICE)
    mask_x = (torch.rand(M, K, generator=g) > 0.2).to(DEVICE)
    grad_x, grad_xhat = ste_grad_input(grad_out, q_w, w_scale, mask_x)
    ref = (grad_out * w_scale[None, :]) @ q_w.float()
    assert_fp32_close(grad_xhat, ref)
    assert torch.equal(grad_x, grad_xhat * mask_x)
    no_mask_x, no_mask_xhat = ste_grad_input(grad_out, q_w, w_scale)
    assert no_mask_x is no_mask_xhat
    assert_fp32_close(no_mask_xhat, ref)


def test_grad_input_bfloat16_grad_out():
    grad_out = torch.randn(20, 24, device=DEVICE).bfloat16()
    q_w, w_scale = codes(24, 40), torch.rand(24, device=DEVICE) * 0.01
    _, grad_xhat = ste_grad_input(grad_out, q_w, w_scale)
    assert_fp32_close(grad_xhat, (grad_out.float() * w_scale[None, :]) @ q_w.float())


@pytest.mark.parametrize("per_row, with_mask", [(False, True), (True, False)])
def test_grad_weight(per_row, with_mask):
    M, N, K = 50, 36, 41
    q_x, _, x_scale, x_zero_point, _, _, _ = linear_case(M, K, N, per_row, seed=5)
    q_x = q_x.t().contiguous().t()  # column-major codes
    grad_out = torch.randn(N, M, device=DEVICE).t()  # non-contiguous (M, N)
    mask_w = (torch.rand(N, K, device=DEVICE) > 0.1) if with_mask else None
    grad_w, grad_w_scale = ste_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w)
    x_hat = (q_x.float() - x_zero_point[:, None]) * x_scale[:, None]
    ref = grad_out.t() @ x_hat
    assert grad_w_scale is None
    assert_fp32_close(grad_w, ref if mask_w is None else ref * mask_w)
    # the code range alone (no weight / w_scale) asks for no scale gradient
    grad_w_again, none = ste_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w, None, None, -127, 127, 0.1)
    assert none is None and torch.equal(grad_w_again, grad_w)


@pytest.mark.parametrize("clip", [0.6, 1.0])
def test_grad_weight_lsq_scale_matches_torch(clip):
    M, N, K = 40, 24, 70
    qmin, qmax, grad_factor = -127, 127, 1.0 / (K * 127) ** 0.5
    q_x, _, x_scale, x_zero_point, _, _, _ = linear_case(M, K, N, per_row=False, seed=6)
    grad_out = torch.randn(M, N, device=DEVICE)
    weight = torch.randn(N, K, device=DEVICE) * 0.2
    # power-of-two scales with weights placed on .5 code ties: half-to-even decides ds there
    w_scale = torch.exp2(torch.round(torch.log2(weight.abs().amax(1) * clip / qmax)))
    weight[:, :4] = torch.tensor([0.5, 1.5, -2.5, 3.5], device=DEVICE) * w_scale[:, None]
    v = weight * (1.0 / w_scale[:, None])
    mask_w = (torch.round(v) >= qmin) & (torch.round(v) <= qmax)

    grad_w, grad_w_scale = ste_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w, weight, w_scale,
                                           qmin, qmax, grad_factor)

    grad_what = grad_out.t() @ ((q_x.float() - x_zero_point) * x_scale)
    w_ref = weight.clone().requires_grad_()
    s_ref = w_scale.clone().requires_grad_()
    w_hat = torch._fake_quantize_learnable_per_channel_affine(
        w_ref, s_ref, torch.zeros(N, device=DEVICE), 0, qmin, qmax, grad_factor)
    w_hat.backward(grad_what)
    assert_fp32_close(grad_w, w_ref.grad)
    # The per-channel sum cancels (ds changes sign), so relative error is measured against
    # the sum of |terms|: rel 1e-5 of sum_k |grad_what * ds| * grad_factor.
    r = torch.round(v)
    ds = torch.where(r < qmin, float(qmin), torch.where(r > qmax, float(qmax), r - v))
    scale_of_terms = (grad_what.abs() * ds.abs()).sum(1) * grad_factor
    assert ((grad_w_scale - s_ref.grad).abs() <= 1e-5 * scale_of_terms).all()


def test_empty_reductions_give_zero_gradients():
    one, zero_i = torch.ones(1, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    grad_w, grad_s = ste_grad_weight(torch.randn(0, 6, device=DEVICE), codes(0, 9), one, zero_i, None,
                                     torch.randn(6, 9, device=DEVICE), torch.ones(6, device=DEVICE), -127, 127)
    assert torch.equal(grad_w, torch.zeros(6, 9, device=DEVICE))
    assert torch.equal(grad_s, torch.zeros(6, device=DEVICE))
    grad_x, _ = ste_grad_input(torch.randn(4, 0, device=DEVICE), codes(0, 9), torch.ones(0, device=DEVICE),
                               torch.ones(4, 9, dtype=torch.bool, device=DEVICE))
    assert torch.equal(grad_x, torch.zeros(4, 9, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_value_error_naming_shapes_and_dtypes():
    a = codes(4, 8)
    with pytest.raises(ValueError, match=r"torch.int8.*\(4, 8\) torch.float32"):
        int_mm(a.float(), a.t())
    with pytest.raises(ValueError, match=r"2-D.*\(2, 4, 8\)"):
        int_mm(codes(2, 4, 8), a.t())
    with pytest.raises(ValueError, match=r"a \(4, 8\) and b \(7, 3\)"):
        int_mm(a, codes(7, 3))
    q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias = linear_case(4, 8, 3, per_row=False)
    with pytest.raises(ValueError, match=r"q_x \(4, 8\) and q_w \(3, 9\)"):
        int_linear_forward(q_x, codes(3, 9), x_scale, x_zero_point, w_scale, w_colsum, bias)
    with pytest.raises(ValueError, match=r"x_scale must be a \(1,\) or \(4,\).*shape \(3,\)"):
        int_linear_forward(q_x, q_w, torch.ones(3), x_zero_point, w_scale, w_colsum, bias)
    with pytest.raises(ValueError, match=r"x_zero_point.*torch.float32"):
        int_linear_forward(q_x, q_w, x_scale, x_zero_point.float(), w_scale, w_colsum, bias)
    with pytest.raises(ValueError, match="out_scale"):
        int_linear_forward(q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="out_dtype"):
        int_linear_forward(q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"grad_out \(4, 5\) and q_w \(3, 8\)"):
        ste_grad_input(torch.randn(4, 5), q_w, w_scale)
    with pytest.raises(ValueError, match=r"mask_x must have shape \(M, K\) = \(4, 8\), got \(8, 4\)"):
        ste_grad_input(torch.randn(4, 3), q_w, w_scale, torch.ones(8, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"grad_out \(5, 3\) and q_x \(4, 8\)"):
        ste_grad_weight(torch.randn(5, 3), q_x, x_scale, x_zero_point)
    with pytest.raises(ValueError, match="needs all of weight, w_scale"):
        ste_grad_weight(torch.randn(4, 3), q_x, x_scale, x_zero_point, weight=torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"weight must have shape \(N, K\) = \(3, 8\), got \(8, 3\)"):
        ste_grad_weight(torch.randn(4, 3), q_x, x_scale, x_zero_point, None, torch.randn(8, 3), w_scale, -127, 127)


# ---------------------------------------------------------------------------------------------
# Registration: opcheck and torch.compile see one op
# ---------------------------------------------------------------------------------------------

def _opcheck_cases():
    q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias = linear_case(5, 16, 6, per_row=True)
    out_q = dict(out_dtype=torch.int8, out_scale=torch.tensor([0.1]), out_zero_point=torch.tensor([1], dtype=torch.int32))
    grad_out = torch.randn(5, 6)
    mask_x, mask_w = torch.rand(5, 16) > 0.5, torch.rand(6, 16) > 0.5
    weight, s = torch.randn(6, 16), torch.rand(6) * 0.01 + 0.01
    ops = torch.ops.intqat
    return [
        (ops.int_mm, (q_x, q_w.t()), {}),
        (ops.int_linear_accumulator, (q_x, q_w, x_zero_point, w_colsum), {}),
        (ops.int_linear_forward, (q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias), {}),
        (ops.int_linear_forward, (q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, None), out_q),
        (ops.ste_grad_xhat, (grad_out, q_w, w_scale), {}),
        (ops.ste_grad_input_masked, (grad_out, q_w, w_scale, mask_x), {}),
        (ops.ste_grad_weight_plain, (grad_out, q_x, x_scale, x_zero_point, mask_w), {}),
        (ops.ste_grad_weight_lsq, (grad_out, q_x, x_scale, x_zero_point, mask_w, weight, s, -127, 127, 0.1), {}),
    ]


@pytest.mark.parametrize("case", range(8))
def test_opcheck(case):
    op, args, kwargs = _opcheck_cases()[case]
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    torch.library.opcheck(op, args, kwargs)  # schema, fake tensor, autograd registration, aot_dispatch


def test_torch_compile_sees_the_ops():
    q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias = linear_case(9, 32, 12, per_row=False)
    grad_out = torch.randn(9, 12, device=DEVICE)

    def step(q_x, grad_out):
        y = int_linear_forward(q_x, q_w, x_scale, x_zero_point, w_scale, w_colsum, bias)
        grad_x, _ = ste_grad_input(grad_out, q_w, w_scale)
        grad_w, _ = ste_grad_weight(grad_out, q_x, x_scale, x_zero_point)
        return y, grad_x, grad_w

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(q_x, grad_out), step(q_x, grad_out)):
        assert torch.equal(got, want)
