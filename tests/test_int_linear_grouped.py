"""intqat::int_linear_grouped: per-group weight scales, exact group sums, one fixed combine order.

Integer results exactly (torch.equal): the C kernel against the aten reference, the reference against
a float64-free definition written out group by group; gradients against fp32 references with stated
tolerances; LSQ per-group scale gradients against torch's learnable fake quant.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from intqat.ops import backends, cpu_kernels
from intqat.ops.int_linear import quantize_activation
from intqat.ops.int_linear_grouped import (
    dequantize_weight_grouped,
    group_sums,
    grouped_integer_linear,
    grouped_reference,
    int_linear_grouped,
    quantize_weight_grouped,
)
from intqat.ops.lsq import lsq_grad_factor


def _codes(M, K, N, gs, wbits=4, seed=0, dynamic=True):
    torch.manual_seed(seed)
    x, w, b = torch.randn(M, K), torch.randn(N, K) * 0.1, torch.randn(N)
    qmax = 2 ** (wbits - 1) - 1
    if dynamic:
        q_x, _, s_x = quantize_activation(x, None, None, -127, 127, True, False)
    else:
        z = torch.tensor([5], dtype=torch.int32)
        q_x, _, s_x = quantize_activation(x, torch.tensor([0.02]), z, -128, 127, False, False)
    q_w, _, s_w = quantize_weight_grouped(w, None, gs, -qmax, qmax)
    return x, w, b, q_x, s_x, q_w, s_w


def _definition(q_x, q_w, s_w, z, s_x, b):
    """The documented formula, one group at a time: int64 group sums, fp32 p_g, left-to-right adds."""
    M, K = q_x.shape
    N, G = s_w.shape
    gs = K // G
    t = None
    for g in range(G):
        sl = slice(g * gs, (g + 1) * gs)
        acc = (q_x[:, sl].long() - z) @ q_w[:, sl].long().t()  # exact
        p = acc.to(torch.float32) * s_w[:, g]
        t = p if t is None else t + p
    y = t * s_x.reshape(-1, 1)
    return y + b if b is not None else y


@pytest.mark.parametrize("M,K,N,gs", [(5, 64, 7, 32), (33, 256, 100, 128), (3, 96, 40, 32), (64, 512, 64, 256),
                                      (1, 1024, 33, 1024), (4, 48, 9, 16)])
@pytest.mark.parametrize("wbits", [4, 8])
def test_reference_is_the_definition(M, K, N, gs, wbits):
    _, _, b, q_x, s_x, q_w, s_w = _codes(M, K, N, gs, wbits)
    assert torch.equal(grouped_reference(q_x, q_w, s_w, None, s_x, b), _definition(q_x, q_w, s_w, 0, s_x, b))


def test_reference_static_zero_point_is_the_definition():
    _, _, b, q_x, s_x, q_w, s_w = _codes(17, 256, 24, 64, 8, dynamic=False)
    z = torch.tensor([5], dtype=torch.int32)
    assert torch.equal(grouped_reference(q_x, q_w, s_w, z, s_x, b), _definition(q_x, q_w, s_w, 5, s_x, b))


def test_group_sums_exact_at_the_extremes():
    # every code at its extreme: the group sums reach gs * 127 * 127 and must still be exact
    gs, G = 1024, 2
    q_x = torch.full((3, gs * G), -127, dtype=torch.int8)
    q_w = torch.full((5, gs * G), -127, dtype=torch.int8)
    acc = group_sums(q_x, q_w, G, None)
    assert torch.equal(acc, torch.full((G, 3, 5), float(gs * 127 * 127)))


def _runs_here(name):
    reason = backends.unavailable(name)
    if reason is not None:
        pytest.skip(f"backend {name} cannot run here: {reason}")


@pytest.mark.parametrize("M,K,N,gs", [(5, 64, 7, 32), (256, 1024, 1024, 32), (33, 256, 100, 128), (3, 96, 40, 32),
                                      (7, 48, 70, 16), (2, 60, 5, 20), (9, 512, 31, 256)])
@pytest.mark.parametrize("dynamic", [True, False])
def test_c_kernel_equals_reference(M, K, N, gs, dynamic):
    """cpu_fused's VNNI kernel (where this CPU has VNNI; its group sizes that are multiples of 4)."""
    _runs_here("cpu_fused")
    if not cpu_kernels.grouped_vnni_available():
        # (an AVX2-only build, e.g. AMD Zen 3: cpu_fused refuses linear_grouped, naming why, and the table runs it on
        # avx2_int16, whose kernel test_avx2_int16_grouped_kernel_both_paths_equal_reference checks)
        with backends.use_backend("cpu_fused"), backends.recording() as ran:
            _, _, b, q_x, s_x, q_w, s_w = _codes(M, K, N, gs, dynamic=dynamic)
            grouped_integer_linear(q_x, q_w, s_w, None if dynamic else torch.tensor([5], dtype=torch.int32), s_x, b)
        assert ("linear_grouped", "cpu_fused") not in ran
        pytest.skip("the fused kernels were built without AVX512-VNNI: no per-group VNNI kernel in this build")
    _, _, b, q_x, s_x, q_w, s_w = _codes(M, K, N, gs, dynamic=dynamic)
    z = None if dynamic else torch.tensor([5], dtype=torch.int32)
    with backends.use_backend("cpu_fused"), backends.recording() as ran:
        fast = grouped_integer_linear(q_x, q_w, s_w, z, s_x, b)
    assert ran[("linear_grouped", "cpu_fused")] == 1
    with backends.use_backend("reference"):
        ref = grouped_integer_linear(q_x, q_w, s_w, z, s_x, b)
    assert torch.equal(fast, ref)
    assert torch.equal(grouped_integer_linear(q_x, q_w, s_w, z, s_x, None), grouped_reference(q_x, q_w, s_w, z, s_x, None))


@pytest.mark.parametrize("gs", [32, 64, 128, 256])
def test_op_forward_is_the_deployed_arithmetic(gs):
    x, w, b, q_x, s_x, q_w, s_w = _codes(8, 256, 24, gs)
    y = int_linear_grouped(x, w.requires_grad_(), b, None, None, None, group_size=gs)
    assert torch.equal(y, grouped_reference(q_x, q_w, s_w, None, s_x, b))
    # the fp32 fake-quant product differs only by fp32 accumulation order: SQNR well above 40 dB
    y_fq = (q_x.float() * s_x) @ dequantize_weight_grouped(q_w, s_w).t() + b
    sqnr = 10 * torch.log10(y_fq.pow(2).sum() / (y - y_fq).pow(2).sum())
    assert sqnr > 80


def test_op_leading_dims_and_custom_op_path_agree():
    x, w, b, *_ = _codes(12, 128, 16, 32)
    x3 = x.reshape(3, 4, 128)
    eager = int_linear_grouped(x3, w, b, None, None, None, group_size=32)
    op = torch.ops.intqat.int_linear_grouped(x, w, b, torch.zeros(1), torch.zeros(1), None, 32, -127, 127, -7, 7,
                                             True, True)[0]
    assert eager.shape == (3, 4, 16) and torch.equal(eager.reshape(12, 16), op)


def test_opcheck():
    x, w, b, *_ = _codes(6, 64, 8, 32)
    args = (x, w.requires_grad_(), b.requires_grad_(), torch.zeros(1), torch.zeros(1), None, 32, -127, 127, -7, 7,
            True, True)
    torch.library.opcheck(torch.ops.intqat.int_linear_grouped.default, args)
    s = torch.full((8, 2), 0.02, requires_grad=True)
    args_static = (x.requires_grad_(), w, b, torch.tensor([0.05], requires_grad=True), torch.tensor([3.0]), s, 32,
                   -128, 127, -7, 7, False, True)
    torch.library.opcheck(torch.ops.intqat.int_linear_grouped.default, args_static)


def test_ste_backward_matches_fp32_reference():
    M, K, N, gs = 16, 256, 32, 64
    x, w, b, q_x, s_x, q_w, s_w = _codes(M, K, N, gs)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    g = torch.randn(M, N)
    int_linear_grouped(x, w, b, None, None, None, group_size=gs).backward(g)
    w_hat = dequantize_weight_grouped(q_w, s_w)
    x_hat = q_x.float() * s_x
    torch.testing.assert_close(x.grad, g @ w_hat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, g.t() @ x_hat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, g.sum(0), rtol=0, atol=1e-5)


def test_static_activation_clip_mask_zeroes_grad():
    M, K, N, gs = 8, 64, 4, 32
    torch.manual_seed(1)
    x = (torch.randn(M, K) * 4).requires_grad_()
    w = torch.randn(N, K)
    s, z = torch.tensor([0.01]), torch.tensor([0.0])
    int_linear_grouped(x, w, None, s, z, None, group_size=gs, x_qmin=-128, x_qmax=127, x_dynamic=False).sum().backward()
    r = torch.round(x.detach() * torch.reciprocal(s))
    inside = (r >= -128) & (r <= 127)
    assert (~inside).any() and inside.any()
    q_w, _, s_w = quantize_weight_grouped(w, None, gs, -7, 7)
    expected = torch.where(inside, torch.ones(M, N) @ dequantize_weight_grouped(q_w, s_w), 0.0)
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)


def _clipping_problem(learn: bool):
    """Static activations and a weight scale at 0.8 x min-max: both clip masks have ones and zeros."""
    M, K, N, gs = 24, 128, 40, 32
    torch.manual_seed(3)
    x = (torch.randn(M, K) * 4).requires_grad_()
    w = (torch.randn(N, K) * 0.1).requires_grad_()
    b = torch.randn(N, requires_grad=True)
    s_x, z_x = torch.tensor([0.02], requires_grad=learn), torch.tensor([3.0], requires_grad=learn)
    s_w = (w.detach().reshape(N, K // gs, gs).abs().amax(2) / 7 * 0.8).requires_grad_(learn)
    return (x, w, b, s_x, z_x, s_w), dict(group_size=gs, x_qmin=-128, x_qmax=127, x_dynamic=False)


def _grads(args, kw):
    leaves = [t for t in args if t.requires_grad]
    for t in leaves:
        t.grad = None
    g = torch.randn(args[0].shape[0], args[1].shape[0], generator=torch.Generator().manual_seed(4))
    int_linear_grouped(*args, **kw).backward(g)
    return [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("learn", [False, True])
def test_clip_masks_saved_as_bits_and_gradients_unchanged(learn, monkeypatch):
    mod = importlib.import_module("intqat.ops.int_linear_grouped")  # the module (intqat.ops exports the function)

    args, kw = _clipping_problem(learn)
    M, K = args[0].shape
    N = args[1].shape[0]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = int_linear_grouped(*args, **kw)
    # nothing saved as bool; the two masks are uint8 bit vectors of ceil(n / 8) bytes
    assert not any(t.dtype == torch.bool for t in saved), [(t.dtype, tuple(t.shape)) for t in saved]
    packed = sorted(tuple(t.shape) for t in saved if t.dtype == torch.uint8)
    assert packed == sorted([((M * K + 7) // 8,), ((N * K + 7) // 8,)])
    del y
    grads = _grads(args, kw)
    # the same backward with the masks kept as bools (what the op saved before): bit for bit
    monkeypatch.setattr(mod, "_packed", lambda m: m)
    monkeypatch.setattr(mod, "unpack_mask", lambda m, shape: m.reshape(shape))
    ref = _grads(args, kw)
    assert len(grads) == (6 if learn else 3)
    for a, r in zip(grads, ref):
        assert torch.equal(a, r)
    # and the masks did act: clipped activations and weights get no gradient
    x, w = args[0].detach(), args[1].detach()
    r_x = torch.round(x * torch.reciprocal(args[3].detach())) + 3
    inside_x = (r_x >= -128) & (r_x <= 127)
    assert (~inside_x).any() and inside_x.any() and torch.equal(grads[0][~inside_x], torch.zeros(int((~inside_x).sum())))
    s_w = args[5].detach().repeat_interleave(kw["group_size"], dim=1)
    r_w = torch.round(w * torch.reciprocal(s_w))
    inside_w = (r_w >= -7) & (r_w <= 7)
    assert (~inside_w).any() and torch.equal(grads[1][~inside_w], torch.zeros(int((~inside_w).sum())))


@pytest.mark.parametrize("gs", [32, 128])
def test_lsq_group_scale_grad_matches_torch_learnable_fake_quant(gs):
    M, K, N = 16, 256, 8
    torch.manual_seed(2)
    x, w = torch.randn(M, K), torch.randn(N, K) * 0.1
    G = K // gs
    s0 = (w.reshape(N, G, gs).abs().amax(2) / 7 * 0.8)  # 0.8 of min-max: some weights clip
    s = s0.clone().requires_grad_()
    g = torch.randn(M, N)
    wr = w.clone().requires_grad_()
    int_linear_grouped(x, wr, None, None, None, s, group_size=gs).backward(g)
    # reference: dL/dw_hat = gᵀ @ x_hat, through torch's learnable per-channel fake quant on (N * G, gs) rows
    q_x, _, s_x = quantize_activation(x, None, None, -127, 127, True, False)
    grad_what = g.t() @ (q_x.float() * s_x)
    s_ref = s0.reshape(-1).clone().requires_grad_()
    w_ref = w.reshape(N * G, gs).clone().requires_grad_()
    fq = torch._fake_quantize_learnable_per_channel_affine(w_ref, s_ref, torch.zeros(N * G), 0, -7, 7,
                                                           lsq_grad_factor(gs, 7))
    (fq * grad_what.reshape(N * G, gs)).sum().backward()
    torch.testing.assert_close(s.grad.reshape(-1), s_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(wr.grad, w_ref.grad.reshape(N, K), rtol=1e-5, atol=1e-6)  # STE with the clip mask


def test_errors_name_the_problem():
    x, w = torch.randn(4, 96), torch.randn(8, 96)
    with pytest.raises(ValueError, match="group_size=40 must be a positive divisor of K=96"):
        int_linear_grouped(x, w, None, None, None, None, group_size=40)
    with pytest.raises(ValueError, match=r"w_scale must have one scale per row and group, shape \(8, 3\)"):
        int_linear_grouped(x, w, None, None, None, torch.ones(8), group_size=32)
    with pytest.raises(ValueError, match="K mismatch"):
        int_linear_grouped(torch.randn(4, 64), w, None, None, None, None, group_size=32)
    with pytest.raises(ValueError, match="exceeds 1024"):
        int_linear_grouped(torch.randn(2, 2048), torch.randn(3, 2048), None, None, None, None, group_size=2048)
    with pytest.raises(ValueError, match="per-tensor x_scale"):
        int_linear_grouped(x, w, None, None, None, None, group_size=32, x_dynamic=False)


# -- the Triton kernel, through the interpreter (tests/conftest.py sets TRITON_INTERPRET=1) ----------


@pytest.mark.parametrize("M,K,N,gs", [(5, 64, 7, 32), (33, 128, 40, 64), (8, 256, 16, 128), (3, 256, 9, 256)])
@pytest.mark.parametrize("dynamic", [True, False])
def test_triton_grouped_kernel_matches_cpu(M, K, N, gs, dynamic):
    kernels = pytest.importorskip("intqat.kernels")
    _, _, b, q_x, s_x, q_w, s_w = _codes(M, K, N, gs, dynamic=dynamic)
    z = torch.tensor([0 if dynamic else 5], dtype=torch.int32)
    sums = kernels.int_linear_grouped_sums(q_x, q_w, s_w, z)
    assert torch.equal(sums, group_sums(q_x, q_w, K // gs, None if dynamic else z).to(torch.int32))  # exact
    y = kernels.int_linear_grouped_forward(q_x, q_w, s_x.reshape(-1), z, s_w, b)
    ref = grouped_reference(q_x, q_w, s_w, None if dynamic else z, s_x, b)
    # the interpreter rounds every step as the CPU does; a GPU's FMA may move y by an ulp per step
    torch.testing.assert_close(y, ref, rtol=2.0**-22, atol=0)
    assert torch.equal(y, ref)


def test_triton_backend_runs_the_op():
    _runs_here("triton")
    x, w, b, *_ = _codes(6, 128, 12, 32)
    expected = int_linear_grouped(x, w, b, None, None, None, group_size=32)
    with backends.use_backend("triton"), backends.recording() as ran:
        got = int_linear_grouped(x, w, b, None, None, None, group_size=32)
    assert ran[("linear_grouped", "triton")] == 1
    assert torch.equal(got, expected)


def test_triton_kernel_refuses_odd_group_size():
    kernels = pytest.importorskip("intqat.kernels")
    q = torch.zeros(2, 48, dtype=torch.int8)
    with pytest.raises(ValueError, match="power-of-two group size >= 16, got 24"):
        kernels.int_linear_grouped_forward(q, q, torch.ones(1), torch.zeros(1, dtype=torch.int32),
                                           torch.ones(2, 2), None)


@pytest.mark.parametrize("M,K,N,gs", [(128, 256, 256, 32), (37, 96, 45, 32), (6, 64, 17, 4), (13, 96, 33, 12),
                                      (5, 192, 16, 48), (4, 256, 31, 128), (1, 60, 5, 6), (11, 64, 19, 2)])
@pytest.mark.parametrize("wmax", [8, 9, 127])
def test_avx2_int16_grouped_kernel_both_paths_equal_reference(M, K, N, gs, wmax):
    """int16_gemm.c's two per-group paths, bit for bit: weight codes all in [-8, 8] with gs % 4 == 0 take
    vpmaddubsw (int16 sums over 32 k, then a (128 + z) * colsum_g correction); wider codes (9, 127) or
    gs % 4 != 0 take vpmaddwd. Ragged M / N (tiles of 4 or 6 rows, 16 columns), several groups per 32-k
    chunk and chunks per group, extreme codes (-128 activations against -8 / -wmax weights), z at both ends."""
    _runs_here("avx2_int16")
    g = torch.Generator().manual_seed(M * 1000 + K + N + gs + wmax)
    q_x = torch.randint(-128, 128, (M, K), generator=g, dtype=torch.int8)
    q_w = torch.randint(-wmax, wmax + 1, (N, K), generator=g, dtype=torch.int8)
    q_x[0, :] = -128  # |q_x - z| = 255 at z = 127 (vpmaddwd's largest operand)
    q_x[-1, :] = 127  # a = q_x + 128 = 255 against the -8 row: 8 pair sums of -4080 = -32640, int16's edge
    q_w[0, :] = -wmax
    q_w[1:, 1] = wmax  # row 0 stays all -wmax
    s_w = torch.rand(N, K // gs, generator=g) * 0.01 + 1e-4
    b = torch.randn(N, generator=g)
    kernel = backends.get("avx2_int16")
    for z in (None, -128, 5, 127):
        z_x = None if z is None else torch.tensor([z], dtype=torch.int32)
        for s_x in (torch.rand(M, 1, generator=g) + 0.01, torch.tensor([0.02])):
            for bias in (b, None):
                got = kernel.linear_grouped(q_x, q_w, s_w, z_x, s_x, bias)
                assert torch.equal(got, grouped_reference(q_x, q_w, s_w, z_x, s_x, bias)), (z, s_x.numel(), bias is None)
                assert torch.equal(got, _definition(q_x, q_w, s_w, 0 if z is None else z, s_x, bias))


@pytest.mark.parametrize("name", ["avx2_int16", "fp32_exact"])
@pytest.mark.parametrize("M,K,N,gs", [(5, 64, 70, 32), (33, 96, 40, 32), (64, 512, 130, 128), (3, 60, 5, 20)])
def test_fp32_kernel_for_cpus_without_int8_dot_products_equals_reference(name, M, K, N, gs):
    """The exact-fp32 kernel the no-int8-dot backends run, forced here (any CPU runs it)."""
    _runs_here(name)
    for dynamic in (True, False):
        _, _, b, q_x, s_x, q_w, s_w = _codes(M, K, N, gs, dynamic=dynamic)
        z = None if dynamic else torch.tensor([5], dtype=torch.int32)
        with backends.use_backend(name), backends.recording() as ran:
            got = grouped_integer_linear(q_x, q_w, s_w, z, s_x, b)
        assert ran[("linear_grouped", name)] == 1
        assert torch.equal(got, grouped_reference(q_x, q_w, s_w, z, s_x, b))
