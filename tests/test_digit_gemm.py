"""The backward GEMMs through int8 digits (intqat/ops/digit_gemm.py, kernels/cpu/fused.c and
kernels/cpu/amx_digits.c).

Every test runs twice: on the AMX kernel (planes combined in the tiles) and on the torch._int_mm
path (what CPUs without AMX run). Fused C kernels and torch twin must agree bit for bit; the result must be the exact product of
the digit-rounded operand, rounded once (error bound below); int_linear with grad_gemm="int8x3"
must give the gradients of grad_gemm="fp32" within fp32-grade tolerance.
"""

from __future__ import annotations

import pytest
import torch

import intqat
from intqat.config import resolve_config
from intqat.ops import backends, cpu_kernels, int_linear
from intqat.ops import digit_gemm
from intqat.ops.cpu_features import cpu_has_int8_dot, int8_gemm_outpaces_fp32_8x
from intqat.ops.digit_gemm import check_grad_gemm, digit_matmul, digits_pay, split_digits

needs_fused = pytest.mark.skipif(not cpu_kernels.available(), reason="fused CPU kernels need a C compiler")


@pytest.fixture(autouse=True, params=["amx", "cpu_fused"])
def kernel_path(request):
    """The digit path runs on any CPU; int_linear takes it only where int8 dot-product units make it
    pay. Each test runs with one digit backend forced (`use_backend`, slow or not on this CPU), so the
    same paths are checked on every machine: "amx" (AMX tiles; skipped, and said so, on a CPU or
    kernel build without them) and "cpu_fused" (split and combine in C around torch._int_mm)."""
    reason = backends.unavailable(request.param)
    if reason is not None:
        pytest.skip(f"backend {request.param} cannot run here: {reason}")
    with backends.use_backend(request.param):
        yield request.param


def _digit_backward_runs_here(M, K, N, grad="x"):
    """int_linear takes the digit backward at (M, K, N) on CPUs with int8 dot products (asserted). On one without
    (AVX2-only x86, or INTQAT_EMULATE_NO_INT8_DOT=1) the rule must keep the fp32 backward there: asserted, then the
    calling test stops, and says so; the digit GEMM itself is checked on every CPU by this file's direct tests."""
    if not cpu_has_int8_dot():
        assert not digits_pay(M, K, N, grad=grad)
        pytest.skip("no int8 dot-product units: int_linear keeps its fp32 backward GEMMs here (asserted); the digit "
                    "GEMM itself is checked by this file's direct tests")
    assert digits_pay(M, K, N, grad=grad)


def _operands(R, C, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: each row gets its own power-of-two grid
    a = torch.randn(R, C, generator=g) * torch.logspace(-6, 3, R).unsqueeze(1)
    col_scale = torch.rand(C, generator=g) + 0.05
    q = torch.randint(-128, 128, (C, K), dtype=torch.int8, generator=g)
    return a, col_scale, q


def _both(a, col_scale, q, z, mask):
    fused = digit_matmul(a, col_scale, q, z, mask)
    with backends.use_backend("reference"):
        ref = digit_matmul(a, col_scale, q, z, mask)
    return fused, ref


def _exact(a, col_scale, q, z):
    v = (a.float() * col_scale.float().reshape(1, -1)).double()  # the fp32 product both paths round once
    return v @ (q.double() - z)


@needs_fused
# shapes from one element to a few hundred per dimension
@pytest.mark.parametrize("R,C,K", [(1, 1, 1), (7, 13, 5), (33, 300, 17), (64, 512, 256), (600, 70, 300), (1100, 40, 129)])
@pytest.mark.parametrize("z", [0, 3, -17])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_kernels_equal_torch_twin(R, C, K, z, masked):
    a, s, q = _operands(R, C, K)
    mask = torch.rand(R, K, generator=torch.Generator().manual_seed(1)) > 0.3 if masked else None
    fused, ref = _both(a, s, q, z, mask)
    assert fused.dtype == torch.float32 and fused.shape == (R, K)
    assert torch.equal(fused, ref)


@needs_fused
@pytest.mark.parametrize("R,C,K", [(40, 64, 24), (700, 33, 257)])
def test_strided_operands_read_in_place(R, C, K):
    a, s, q = _operands(R, C, K)
    at = a.t().contiguous().t()  # same values, column-major
    expanded = torch.randn(1, C).expand(R, C)  # stride 0, as autograd hands out for sum().backward()
    mask = torch.rand(R, K, generator=torch.Generator().manual_seed(2)) > 0.2
    for operand in (at, expanded):
        for z, m in ((0, None), (3, mask)):
            fused, ref = _both(operand, s, q, z, m)
            assert torch.equal(fused, ref)
            assert torch.equal(fused, digit_matmul(operand.contiguous(), s, q, z, m))
    per_tensor = torch.tensor([0.37])  # one scale for every column (stride 0 in the kernel)
    fused, ref = _both(a, per_tensor, q, 5, None)
    assert torch.equal(fused, ref)


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_fused), False])
def test_error_bound_is_the_split_alone(fused):
    """|y - exact| <= 2^-(t+15) * sum_c |q - z| (the split's residual) + half an fp32 ulp of exact."""
    a, s, q = _operands(48, 700, 40, seed=3)
    z = 7
    ctx = backends.use_backend("reference") if not fused else torch.no_grad()
    with ctx:
        y = digit_matmul(a, s, q, z)
        _, shift, _ = split_digits(a, s, need_rowsum=False)
    exact = _exact(a, s, q, z)
    residual = torch.exp2(-(shift.double() + 15)).unsqueeze(1) * (q.double() - z).abs().sum(0).unsqueeze(0)
    bound = residual + exact.abs() * 2.0**-24
    assert ((y.double() - exact).abs() <= bound).all()
    # and it is fp32-grade: relative error of the whole product well under 1e-5
    assert ((y.double() - exact).norm() / exact.norm()).item() < 2e-6


def test_exactly_representable_operand_gives_the_correctly_rounded_product():
    # integers of at most 7 bits times powers of two: the split is exact, only the final rounding remains
    g = torch.Generator().manual_seed(4)
    a = torch.randint(-127, 128, (16, 96), generator=g).float() * torch.exp2(torch.randint(-9, 9, (16, 1), generator=g).float())
    q = torch.randint(-128, 128, (96, 24), dtype=torch.int8, generator=g)
    one = torch.ones(96)
    for ctx in (torch.no_grad(), backends.use_backend("reference")):
        with ctx:
            y = digit_matmul(a, one, q, -3)
        assert torch.equal(y, (a.double() @ (q.double() + 3)).float())


def test_nonfinite_rows_give_nan_and_zero_rows_zero():
    a, s, q = _operands(6, 32, 8)
    a[1, 3] = float("nan")
    a[2, 0] = float("inf")
    a[3] = 0.0
    mask = torch.ones(6, 8, dtype=torch.bool)
    mask[1, :4] = False
    column_major = a.t().contiguous().t()  # gᵀ of a contiguous g, as in the grad_w GEMM
    for ctx, operand in ((torch.no_grad(), a), (torch.no_grad(), column_major), (backends.use_backend("reference"), a)):
        with ctx:
            y = digit_matmul(operand, s, q, 2, mask)
        assert y[1, :4].eq(0).all() and y[1, 4:].isnan().all()  # the clip mask still zeroes
        assert y[2].isnan().all()
        assert y[3].eq(0).all()
        assert torch.isfinite(y[[0, 4, 5]]).all()


def test_extreme_magnitudes_keep_their_grid():
    # tiny (subnormal-adjacent) and huge rows: the power-of-two grid follows each row
    a = torch.tensor([[1e-38, -3e-39, 2e-38], [3e38, -1e38, 2e38]])
    q = torch.tensor([[1], [1], [1]], dtype=torch.int8)
    exact = _exact(a, torch.ones(3), q, 0).float()
    for ctx in (torch.no_grad(), backends.use_backend("reference")):
        with ctx:
            y = digit_matmul(a, torch.ones(3), q, 0)
        torch.testing.assert_close(y[0], exact[0], rtol=1e-6, atol=0)
        assert torch.isinf(y[1, 0]) == torch.isinf(exact[1, 0])  # 4e38 overflows fp32 in both


def test_empty_and_too_long_contractions():
    assert digit_matmul(torch.randn(3, 0), torch.ones(0), torch.empty(0, 4, dtype=torch.int8), 0).eq(0).all()
    assert digit_matmul(torch.randn(0, 5), torch.ones(5), torch.ones(5, 4, dtype=torch.int8), 0).shape == (0, 4)
    # C > MAX_K_INT32: int32 digit sums could overflow, the fp32 GEMM takes over
    C = intqat.ops.MAX_K_INT32 + 1
    a = torch.randn(2, C)
    q = torch.randint(-128, 128, (C, 3), dtype=torch.int8)
    y = digit_matmul(a, torch.ones(C), q, 0)
    exact = _exact(a, torch.ones(C), q, 0)
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-5


def _linear_grads(grad_gemm, M, K, N, dynamic, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).requires_grad_()
    W = (torch.randn(N, K, generator=g) * 0.05).requires_grad_()
    b = torch.randn(N, generator=g).requires_grad_()
    s_x = torch.tensor([x.detach().abs().max().item() / 127 * 0.6])  # some activations clip
    z_x = torch.tensor([4.0])
    y = int_linear(x, W, b, s_x, z_x, None, x_dynamic=dynamic, grad_gemm=grad_gemm)
    y.backward(torch.randn(M, N, generator=g))
    return y.detach(), x.grad, W.grad, b.grad


@pytest.mark.parametrize("dynamic", [False, True])
def test_int_linear_digit_backward_matches_fp32_backward(dynamic, kernel_path):
    M, K, N = 128, 512, 1024
    _digit_backward_runs_here(M, K, N, grad="x")
    y8, gx8, gw8, gb8 = _linear_grads("int8x3", M, K, N, dynamic)
    y32, gx32, gw32, gb32 = _linear_grads("fp32", M, K, N, dynamic)
    assert torch.equal(y8, y32)  # the forward is the same integer arithmetic
    assert torch.equal(gb8, gb32)  # grad_b is a sum either way
    assert not torch.equal(gx8, gx32)  # grad_x really took the digit GEMM ...
    assert ((gx8 - gx32).norm() / gx32.norm()).item() < 1e-5  # ... and agrees to fp32 grade
    assert torch.equal(gx8 == 0, gx32 == 0)  # the same STE clip mask
    # grad_w too on the AMX kernel, and through torch._int_mm where int8 runs ~8x fp32 (AMD Zen 5)
    assert digits_pay(M, K, N, grad="w") == (kernel_path == "amx" or int8_gemm_outpaces_fp32_8x())
    if digits_pay(M, K, N, grad="w"):
        assert not torch.equal(gw8, gw32)
        assert ((gw8 - gw32).norm() / gw32.norm()).item() < 1e-5
    else:  # grad_w stays an fp32 GEMM
        assert torch.equal(gw8, gw32)


def test_small_layers_and_cpus_without_int8_dot_units_keep_fp32_gemms(kernel_path):
    for grad in ("x", "w"):
        assert not digits_pay(64, 128, 128, grad=grad)
    # a short batch: grad_w's contraction; on AMX the output write dominates grad_x as well
    assert not digits_pay(32, 1024, 1024, grad="w")
    assert digits_pay(32, 1024, 1024, grad="x") == (kernel_path == "cpu_fused" and cpu_has_int8_dot())
    # a CPU without int8 dot products: its digit GEMM (fp32_exact) would be three fp32 GEMMs; the reference never pays
    for name in ("fp32_exact", "reference"):
        with backends.use_backend(name):
            assert not digits_pay(256, 1024, 1024) and not digits_pay(256, 1024, 1024, grad="w")
    for a, b in zip(_linear_grads("int8x3", 64, 128, 128, False), _linear_grads("fp32", 64, 128, 128, False)):
        assert torch.equal(a, b)


def test_grad_gemm_is_validated_and_configurable():
    with pytest.raises(ValueError, match="grad_gemm='bf16'.*int8x3.*fp32"):
        check_grad_gemm("bf16")
    with pytest.raises(ValueError, match="grad_gemm"):
        int_linear(torch.randn(2, 3), torch.randn(4, 3), None, torch.ones(1), torch.zeros(1), None, grad_gemm="tf32")
    with pytest.raises(ValueError, match=r"QuantConfig\(grad_gemm='x'"):
        intqat.QuantConfig(grad_gemm="x")
    assert resolve_config({"preset": "w8a8_dynamic", "grad_gemm": "fp32"}).grad_gemm == "fp32"
    assert resolve_config("w8a8").grad_gemm == "int8x3"
    # the choice travels from the config through prepare_qat and to_integer to the integer layer
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    intqat.prepare_qat(model, resolve_config({"grad_gemm": "fp32"}))
    intqat.calibrate(model, [torch.randn(16, 8)])
    intqat.to_integer(model)
    assert [m.grad_gemm for m in model if isinstance(m, intqat.nn.IntLinear)] == ["fp32", "fp32"]
    assert "grad_gemm=fp32" in repr(model)


def _loss_of_a_digit_layer(seed):
    """(loss fn of (x, W, b), leaf inputs) for an int_linear whose backward takes the digit GEMM;
    dynamo reset first: the other kernel_path's compiled graph chose its backward differently."""
    M, K, N = 128, 512, 1024
    _digit_backward_runs_here(M, K, N, grad="x")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).requires_grad_()
    W = (torch.randn(N, K, generator=g) * 0.05).requires_grad_()
    b = torch.zeros(N, requires_grad=True)
    s_x, z_x = torch.tensor([0.02]), torch.tensor([3.0])
    weight_out = torch.randn(M, N, generator=g)

    def step(x, W, b):
        return (int_linear(x, W, b, s_x, z_x, None) * weight_out).sum()

    torch._dynamo.reset()
    return step, (x, W, b)


def test_compiled_backward_runs_the_same_kernels_bit_for_bit():
    # under torch.compile the backward graph holds one intqat::digit_matmul node, which runs the
    # eager path's kernels when the compiled program runs: the same bits
    step, (x, W, b) = _loss_of_a_digit_layer(seed=5)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grads_compiled = torch.autograd.grad(compiled(x, W, b), [x, W, b])
    grads_eager = torch.autograd.grad(step(x, W, b), [x, W, b])
    for c, e in zip(grads_compiled, grads_eager):
        assert torch.equal(c, e), (c.shape, (c - e).abs().max())


def test_inductor_compiles_the_digit_backward(kernel_path):
    # with inductor too: the digit GEMMs give the eager bits (the opaque op runs the same kernels);
    # fp32 GEMMs and grad_b's sum, which inductor may reorder, agree to fp32 rounding
    step, (x, W, b) = _loss_of_a_digit_layer(seed=7)
    gx_c, gw_c, gb_c = torch.autograd.grad(torch.compile(step, fullgraph=True)(x, W, b), [x, W, b])
    gx_e, gw_e, gb_e = torch.autograd.grad(step(x, W, b), [x, W, b])
    assert torch.equal(gx_c, gx_e)
    if kernel_path == "amx":  # grad_w through the digits too
        assert torch.equal(gw_c, gw_e)
    else:  # an fp32 GEMM, which inductor may block differently: fp32 rounding apart
        assert ((gw_c - gw_e).norm() / gw_e.norm()).item() < 1e-6
    torch.testing.assert_close(gb_c, gb_e, rtol=1e-6, atol=1e-4)


def test_lsq_scale_gradients_with_the_digit_gemm():
    # learned activation scale / zero point: their LSQ terms read grad_xhat before the clip mask
    M, K, N = 128, 512, 1024
    _digit_backward_runs_here(M, K, N)
    grads = {}
    for grad_gemm in ("int8x3", "fp32"):
        g = torch.Generator().manual_seed(6)
        x = torch.randn(M, K, generator=g).requires_grad_()
        W = (torch.randn(N, K, generator=g) * 0.05).requires_grad_()
        s_x = torch.tensor([0.015], requires_grad=True)  # clips part of x
        z_x = torch.tensor([2.0], requires_grad=True)
        s_w = (W.detach().abs().amax(dim=1) / 127 * 0.9).requires_grad_()  # clips part of W
        y = int_linear(x, W, None, s_x, z_x, s_w, grad_gemm=grad_gemm)
        y.backward(torch.randn(M, N, generator=g))
        grads[grad_gemm] = (x.grad, W.grad, s_x.grad, z_x.grad, s_w.grad)
    for a, b in zip(grads["int8x3"], grads["fp32"]):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    assert torch.equal(grads["int8x3"][0] == 0, grads["fp32"][0] == 0)


@needs_fused
def test_padded_tiles_never_see_stale_scratch_data():
    # the AMX path pads rows to 32 and the contraction to 64 inside reused scratch buffers: a large
    # call leaves nonzero digits behind that a smaller, oddly shaped call must not pick up
    for R, C, K in [(96, 640, 96), (33, 65, 31), (128, 256, 64), (31, 63, 33), (1, 1, 1)]:
        a, s, q = _operands(R, C, K, seed=R)
        at = a.t().contiguous().t()
        for operand, z in ((a, 0), (at, -5)):
            fused, ref = _both(operand, s, q, z, None)
            assert torch.equal(fused, ref), (R, C, K, z)


@pytest.mark.parametrize("z", [0, -9])
def test_digit_matmul_op_passes_opcheck(z):
    # the traced form: schema, fake (meta) implementation, no aliasing, same results under tracing
    a, s, q = _operands(40, 96, 24)
    mask = torch.rand(40, 24, generator=torch.Generator().manual_seed(3)) > 0.2
    zt = torch.tensor([z], dtype=torch.int32)
    for operand, m in ((a, None), (a.t().contiguous().t(), mask)):
        torch.library.opcheck(digit_gemm._digit_matmul_op, (operand, s, q, zt, m))
    traced = torch.fx.experimental.proxy_tensor.make_fx(lambda a, s, q, m: digit_matmul(a, s, q, z, m))(a, s, q, mask)
    assert "intqat.digit_matmul" in str(traced.graph)
    assert torch.equal(traced(a, s, q, mask), digit_matmul(a, s, q, z, mask))


@pytest.mark.parametrize("fast_int8", [True, False], ids=["int8-8x-fp32", "int8-4x-fp32"])
def test_the_torch_int_mm_rule_of_each_cpu_class(fast_int8, monkeypatch):
    """Both cpu_fused rules, whatever this CPU is: AMD Zen 5 (int8 ~8x fp32) takes both backward GEMMs
    from 2^21 multiply-adds (grad_w only for 64 <= M <= 2 max(N, K)); the ~4x classes grad_x only, N >= 512."""
    import intqat.ops.digit_gemm as dg

    if backends.unavailable("cpu_fused") is not None:
        pytest.skip(f"backend cpu_fused cannot run here: {backends.unavailable('cpu_fused')}")
    import intqat.ops.backends.cpu_fused as cpu_fused  # the rule is cpu_fused's slow("digit_matmul")

    monkeypatch.setattr(cpu_fused, "int8_gemm_outpaces_fp32_8x", lambda: fast_int8)
    monkeypatch.setattr(cpu_fused, "cpu_has_int8_dot", lambda: True)  # (the rules of the int8 classes, on any CPU)
    encoder_layers = [(256, 128, 384), (256, 128, 128), (256, 128, 512), (256, 512, 128)]  # BERT-tiny, 256 tokens
    with backends.use_backend("cpu_fused"):
        assert not dg.digits_pay(64, 128, 128, grad="x") and not dg.digits_pay(8, 128, 10, grad="x")  # < 2^21
        assert all(dg.digits_pay(*s, grad="x") == (fast_int8 or s[2] >= 512) for s in encoder_layers)
        assert all(dg.digits_pay(*s, grad="w") == fast_int8 for s in encoder_layers)
        assert not dg.digits_pay(1024, 128, 128, grad="w") and not dg.digits_pay(32, 1024, 1024, grad="w")
        assert dg.digits_pay(256, 1024, 1024, grad="w") == fast_int8


@needs_fused
def test_split_equals_the_torch_twin_at_every_exponent():
    """The C split (float32 arithmetic where the row's grid 2^t fits float32, double for rows of
    subnormals) gives the torch twin's digits, shifts and row sums, for rows whose largest element spans
    float32's exponents (subnormal to 3e38), elements far below their row's largest, and ties."""
    g = torch.Generator().manual_seed(5)
    exps = torch.arange(-149, 128, 2, dtype=torch.float64)
    a = (torch.randn(len(exps), 64, generator=g, dtype=torch.float64) * torch.exp2(exps).unsqueeze(1)).float()
    a[:, 0] = torch.exp2(exps).float()  # each row's largest on a power of two
    a[:, 1] = a[:, 0] * 2.0 ** -30  # far below the row's grid: zero digits
    a[:, 2] = a[:, 0] * (1 + 2.0 ** -8) / 2 ** 7  # a tie on the second digit's grid
    a[:, 3] = -a[:, 2]
    a = torch.where(torch.isfinite(a), a, 0.0)
    for col_scale in (torch.ones(64), torch.rand(64, generator=g) + 0.5):
        got = cpu_kernels.split_digits(a, col_scale, need_rowsum=True)
        want = split_digits(a, col_scale, need_rowsum=True)
        for u, v in zip(got, want):
            assert torch.equal(u, v)
