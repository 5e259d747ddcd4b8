"""The STE backward of integer convolutions as digit GEMMs on the im2col form (intqat/ops/int_conv2d.py `_digit_grads`,
kernels/cpu/train_conv.cpp).

A groups == 1 conv's two backward GEMMs are int_linear's on im2col: grad_w = (g_mat s_x)ᵀ @ (cols - z_x) and
grad_cols = (g_mat s_w) @ q_w_cols, then a fold (col2im) into grad_x. The C++ step and the Python path must give the
same bits; both must stay within the digit GEMM's bound (plus the fold's fp32 additions) of the exact STE gradient;
grad_gemm="fp32" must keep today's fp32 convolution_backward bit for bit; and which layers take digits is visible.

The digit path is forced on (the rule's constants lowered, so it runs on any CPU whose table has a digit kernel: AMX
tiles, or torch._int_mm) and off (raised) by `digits`; the layer decision itself is the table's (`digits_pay`).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat.ops import backends, cpp_step
from intqat.ops.backends.formulas import CONV_DIGITS_X_MIN_OUT_CHANNELS
from intqat.ops.digit_gemm import digits_pay
from intqat.ops.int_conv2d import conv_backward_gemms, int_conv2d

S_X, Z_X = 0.02, -4  # activations clip at |x| > ~2.5: many of the randn * 2 inputs do (the mask is active)


def _rule(monkeypatch, on: bool) -> None:
    """Make the digit GEMM's rule say `on` for every shape, on whichever backend runs it (amx, cpu_fused)."""
    import intqat.ops.backends.amx as amx
    import intqat.ops.backends.cpu_fused as cpu_fused
    import intqat.ops.backends.formulas as formulas

    big = 2**62
    monkeypatch.setattr(formulas, "CONV_DIGITS_X_MIN_OUT_CHANNELS", 0 if on else big)
    monkeypatch.setattr(cpu_fused, "DIGITS_MIN_MACS", 0 if on else big)
    monkeypatch.setattr(cpu_fused, "cpu_has_int8_dot", lambda: True)  # (CPUs without: torch._int_mm, exact, slow)
    monkeypatch.setattr(cpu_fused, "int8_gemm_outpaces_fp32_8x", lambda: on)
    monkeypatch.setattr(cpu_fused, "DIGITS_8X_GRAD_W_MIN_M", 0)
    monkeypatch.setattr(cpu_fused, "DIGITS_8X_GRAD_W_MAX_M_PER_NK", big)
    monkeypatch.setattr(amx, "AMX_DIGITS_MIN_M", 0 if on else big)
    monkeypatch.setattr(amx, "AMX_DIGITS_MIN_MACS", 0 if on else big)
    # decisions cached per call shape (the table's, the C++ step's plans) were taken under the old rule
    monkeypatch.setattr(backends, "_decided", {})
    monkeypatch.setattr(backends.get("cpp_step"), "_plans", {})


@pytest.fixture(params=["digits-on", "digits-off"])
def digits(request, monkeypatch):
    on = request.param == "digits-on"
    _rule(monkeypatch, on)
    if on:
        b = backends.select("digit_matmul", record=False, at_run_time=True)
        if b is None or b.name not in ("amx", "cpu_fused"):
            pytest.skip(f"no digit GEMM kernel runs here (the table picks {b and b.name}): "
                        f"{backends.explain('digit_matmul', shape=(64, 64, 64), spec='x', at_run_time=True, file=None)}")
    return on


def _operands(B, C, O, H, W, k, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, H, W, generator=gen) * 2
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(O, C, k, k, generator=gen) * 0.3
    b = torch.randn(O, generator=gen)
    s_w = w.abs().amax(dim=(1, 2, 3)) / 127 * 0.7  # 0.7: the largest weights clip (the weight mask is active)
    return x, w, b, s_w, gen


def _step(python: bool, x, w, b, s_w, g_seed, grad_gemm="int8x3", **conv):
    """int_conv2d forward + backward on fresh leaves -> (node name, y, grad_x, grad_w, grad_b, which ran)."""
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with backends.recording() as ran, (cpp_step.disabled() if python else torch.enable_grad()):
        y = int_conv2d(x, w, b, torch.tensor([S_X]), torch.tensor([float(Z_X)]), s_w, grad_gemm=grad_gemm, **conv)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(g_seed))
        y.backward(g)
    return y.grad_fn.name(), y.detach(), x.grad, w.grad, b.grad, ran, g


def _same_bits(a, b, name):
    assert a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)), (
        f"{name}: max |diff| {(a - b).abs().nan_to_num().max()}")


CASES = [  # (B, C, O, H, W, k, stride, padding, dilation, layout): ids say which
    (2, 8, 16, 10, 10, 3, 1, 1, 1, "nchw"),  # 3x3 s1 p1: ResNet's block conv
    (2, 8, 16, 11, 9, 3, 2, 1, 1, "nchw"),  # 3x3 s2, odd sizes
    (2, 8, 16, 9, 9, 1, 1, 0, 1, "nchw"),  # 1x1: a plain GEMM, no fold
    (2, 8, 16, 11, 9, 1, 2, 0, 1, "channels_last"),  # 1x1 s2: a fold that only places values
    (2, 8, 16, 12, 11, 3, 1, 2, 2, "nchw"),  # dilation 2
    (1, 5, 7, 13, 8, 5, 3, 2, 1, "channels_last"),  # 5x5 s3, odd channel counts
]
IDS = ["3x3s1", "3x3s2-odd", "1x1", "1x1s2-cl", "3x3d2", "5x5s3-odd-cl"]


def _conv_kw(case):
    _, _, _, _, _, _, s, p, d, _ = case
    return dict(stride=s, padding=p, dilation=d)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpp_step_and_python_path_give_the_same_bits(case, digits):
    B, C, O, H, W, k, _, _, _, layout = case
    x, w, b, s_w, _ = _operands(B, C, O, H, W, k, layout)
    got = _step(False, x, w, b, s_w, 1, **_conv_kw(case))
    want = _step(True, x, w, b, s_w, 1, **_conv_kw(case))
    assert "IntConv2dTrain" in got[0] and want[0] == "_IntConv2dEagerBackward"  # each path really ran
    for name, a, bb in zip(("y", "grad_x", "grad_w", "grad_b"), got[1:5], want[1:5]):
        _same_bits(a, bb, name)
    # the digit GEMMs ran (both, in both paths) exactly when the rule says so
    for ran in (got[5], want[5]):
        n = sum(c for (p, _), c in ran.items() if p == "digit_matmul")
        assert n == (2 if digits else 0), dict(ran)
    assert (got[2] == 0).any() and (got[3] == 0).any()  # clip masks active on x and W


@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_grad_w_on_digits_with_grad_x_below_the_channel_floor(case, monkeypatch):
    """A conv with fewer output channels than CONV_DIGITS_X_MIN_OUT_CHANNELS: grad_w takes digits, grad_x fp32's
    convolution_backward, in both paths, with the same bits (the mixed plan ResNet's 64 -> 64 convs take)."""
    import intqat.ops.backends.formulas as formulas

    _rule(monkeypatch, True)
    b = backends.select("digit_matmul", record=False, at_run_time=True)
    if b is None or b.name not in ("amx", "cpu_fused"):
        pytest.skip(f"no digit GEMM kernel runs here (the table picks {b and b.name})")
    monkeypatch.setattr(formulas, "CONV_DIGITS_X_MIN_OUT_CHANNELS", case[2] + 1)
    B, C, O, H, W, k, _, _, _, layout = case
    x, w, b, s_w, _ = _operands(B, C, O, H, W, k, layout)
    got = _step(False, x, w, b, s_w, 1, **_conv_kw(case))
    want = _step(True, x, w, b, s_w, 1, **_conv_kw(case))
    for name, a, bb in zip(("y", "grad_x", "grad_w", "grad_b"), got[1:5], want[1:5]):
        _same_bits(a, bb, name)
    for ran in (got[5], want[5]):
        assert sum(c for (p, _), c in ran.items() if p == "digit_matmul") == 1, dict(ran)
    how = conv_backward_gemms((B, C, H, W), (O, C, k, k), **_conv_kw(case))
    assert how["grad_w"] == "digits" and "CONV_DIGITS_X_MIN_OUT_CHANNELS" in how["grad_x"], how


def _exact_ste(x, w, s_w, g, stride, padding, dilation, masked=True):
    """The STE gradients in float64 from the same codes (docs/numerics.md), masked: (grad_x, grad_w, q_x, q_w)."""
    inv = torch.tensor(1 / S_X, dtype=torch.float32)
    r_x = torch.round(x * inv) + Z_X
    mask_x = (r_x >= -128) & (r_x <= 127)
    q_x = r_x.clamp(-128, 127).double()
    inv_w = (1 / s_w).reshape(-1, 1, 1, 1)
    r_w = torch.round(w * inv_w)
    mask_w = (r_w >= -127) & (r_w <= 127)
    q_w = r_w.clamp(-127, 127).double()
    x_hat, w_hat = (q_x - Z_X) * S_X, q_w * s_w.double().reshape(-1, 1, 1, 1)
    gx, gw, _ = torch.ops.aten.convolution_backward(g.double(), x_hat, w_hat, None, stride, padding, dilation, False,
                                                    [0, 0], 1, [True, True, False])
    if not masked:
        return gx, gw, q_x, q_w
    return gx * mask_x, gw * mask_w, q_x, q_w


def _unfold(t, k, stride, padding, dilation):
    """(B, C, H, W) -> (B, L, C*k*k) (F.unfold's (c, i, j) columns), float64."""
    return F.unfold(t, k, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)


def _bounds(q_x, q_w, s_w, g, k, stride, padding, dilation, H, W):
    """|digit - exact| bounds per element (docs/numerics.md, backward section), float64:
    grad_w[o, c]: 2^-21 max_m |g s_x|[m, o] * sum_m |cols - z| + 2^-23 sum_m |g s_x (cols - z)|
    grad_cols[m, c]: the same with the roles of the two operands swapped (row m, contraction over o), then the fold:
    grad_x[p]: the window's grad_cols bounds + kh*kw * 2^-24 * the window's sum of |grad_cols|."""
    B, O = g.shape[:2]
    g_mat = g.double().permute(0, 2, 3, 1).reshape(-1, O)  # (M, O)
    cols = _unfold(q_x - Z_X, k, stride, padding, dilation).reshape(g_mat.shape[0], -1).abs()  # (M, C*k*k) |cols - z|
    # (F.unfold pads with 0: q_x - z_x is 0 on the padding, as the codes' padding z_x is)
    a_w = (g_mat * S_X).abs()  # (M, O)
    bound_w = (2.0**-21 * a_w.max(0).values[:, None] * cols.sum(0)[None, :] + 2.0**-23 * a_w.t() @ cols)
    a_x = (g_mat * s_w.double()[None, :]).abs()  # (M, O)
    wq = q_w.reshape(O, -1).abs()  # (O, C*k*k), (c, i, j) columns
    bound_cols = 2.0**-21 * a_x.max(1).values[:, None] * wq.sum(0)[None, :] + 2.0**-23 * a_x @ wq
    abs_cols = a_x @ wq  # >= |grad_cols|

    def fold(t):  # (M, C*k*k) -> (B, C, H, W)
        t = t.reshape(B, -1, t.shape[1]).transpose(1, 2)
        return F.fold(t, (H, W), k, dilation=dilation, padding=padding, stride=stride)

    bound_x = fold(bound_cols) + k * k * 2.0**-24 * fold(abs_cols)
    return bound_x, bound_w.reshape(q_w.shape)


def _sqnr(ref, got):
    return 10 * math.log10(ref.pow(2).sum().item() / max((got.double() - ref).pow(2).sum().item(), 1e-300))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_digit_gradients_within_the_bound_of_the_exact_ste_gradient(case, monkeypatch):
    """Against the exact (float64) STE gradient of the same codes, masked as torch masks: the digit split's bound
    per element plus the fold's fp32 additions; fails if the fold misplaces a term or a mask is lost (the bound is
    ~1e-6 relative: a misplaced or unmasked term is O(1)). And an SQNR floor against the fp32 STE backward."""
    _rule(monkeypatch, True)
    B, C, O, H, W, k, s, p, d, layout = case
    x, w, b, s_w, _ = _operands(B, C, O, H, W, k, layout, seed=3)
    name, _, gx, gw, _, ran, g = _step(False, x, w, b, s_w, 4, **_conv_kw(case))
    if not any(pp == "digit_matmul" for pp, _ in ran):
        pytest.skip(f"no digit GEMM kernel runs here: {dict(ran)}")
    ex_x, ex_w, q_x, q_w = _exact_ste(x, w, s_w, g, [s, s], [p, p], [d, d])
    bound_x, bound_w = _bounds(q_x, q_w, s_w, g, k, [s, s], [p, p], [d, d], H, W)
    assert ((gx.double() - ex_x).abs() <= bound_x).all(), (gx.double() - ex_x).abs().max()
    assert ((gw.double() - ex_w).abs() <= bound_w).all(), (gw.double() - ex_w).abs().max()
    assert torch.equal(gx == 0, ex_x == 0) and torch.equal(gw == 0, ex_w == 0)  # the masks, where they zero
    # against the fp32 STE backward (today's path): fp32-grade agreement
    _, _, fx, fw, fb, _, _ = _step(False, x, w, b, s_w, 4, grad_gemm="fp32", **_conv_kw(case))
    assert _sqnr(fx.double(), gx) > 100 and _sqnr(fw.double(), gw) > 100
    assert _sqnr(ex_x, gx) > 110 and _sqnr(ex_w, gw) > 110


def test_a_wrong_fold_or_mask_breaks_the_bound(monkeypatch):
    """The bound check above can fail: a grad_x folded with a window shifted by one pixel, or left unmasked, is
    far outside it."""
    _rule(monkeypatch, True)
    x, w, b, s_w, _ = _operands(2, 8, 16, 10, 10, 3, "nchw", seed=3)
    _, _, gx, _, _, _, g = _step(False, x, w, b, s_w, 4, stride=1, padding=1, dilation=1)
    ex_x, _, q_x, q_w = _exact_ste(x, w, s_w, g, [1, 1], [1, 1], [1, 1])
    bound_x, _ = _bounds(q_x, q_w, s_w, g, 3, [1, 1], [1, 1], [1, 1], 10, 10)
    shifted = torch.roll(gx, 1, dims=3)
    assert not ((shifted.double() - ex_x).abs() <= bound_x).all()
    unmasked, _, _, _ = _exact_ste(x, w, s_w, g, [1, 1], [1, 1], [1, 1], masked=False)
    assert not ((unmasked - ex_x).abs() <= bound_x).all()


@pytest.mark.parametrize("python", [False, True], ids=["cpp", "python"])
def test_grad_gemm_fp32_keeps_todays_backward_bit_for_bit(python, monkeypatch):
    """grad_gemm="fp32": convolution_backward on the dequantized operands, masked (today's backward), even where the
    rule would take digits."""
    _rule(monkeypatch, True)
    x, w, b, s_w, _ = _operands(2, 8, 16, 10, 10, 3, "nchw")
    name, _, gx, gw, gb, ran, g = _step(python, x, w, b, s_w, 1, grad_gemm="fp32", stride=1, padding=1)
    assert not any(p == "digit_matmul" for p, _ in ran)
    r_x = torch.round(x * torch.tensor(1 / S_X)) + Z_X
    x_hat = (r_x.clamp(-128, 127) - Z_X) * torch.tensor(S_X)
    r_w = torch.round(w * (1 / s_w).reshape(-1, 1, 1, 1))
    w_hat = r_w.clamp(-127, 127) * s_w.reshape(-1, 1, 1, 1)
    ref_x, ref_w, ref_b = torch.ops.aten.convolution_backward(g, x_hat, w_hat, [16], [1, 1], [1, 1], [1, 1], False,
                                                              [0, 0], 1, [True, True, True])
    _same_bits(gx, torch.where((r_x >= -128) & (r_x <= 127), ref_x, 0.0), "grad_x")
    _same_bits(gw, torch.where((r_w >= -127) & (r_w <= 127), ref_w, 0.0), "grad_w")
    _same_bits(gb, ref_b, "grad_b")


def test_grad_gemm_travels_from_the_config_to_the_integer_conv():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2))
    intqat.prepare_qat(model, intqat.QuantConfig(grad_gemm="fp32"))
    intqat.calibrate(model, [torch.randn(2, 3, 8, 8)])
    intqat.to_integer(model)
    assert [m.grad_gemm for m in model if hasattr(m, "grad_gemm")] == ["fp32", "fp32"]
    with pytest.raises(ValueError, match="grad_gemm='int4'"):
        int_conv2d(torch.randn(1, 3, 4, 4), torch.randn(8, 3, 3, 3), None, torch.tensor([0.1]), torch.tensor([0.0]),
                   torch.ones(8), grad_gemm="int4")


# the convs of intqat-bench's ResNet blocks (batch 16 at 32x32): x shape, weight shape, stride, padding
RESNET = [((16, 3, 32, 32), (64, 3, 3, 3), 2, 1), ((16, 64, 16, 16), (64, 64, 3, 3), 1, 1),
          ((16, 64, 16, 16), (128, 64, 3, 3), 2, 1), ((16, 128, 8, 8), (128, 128, 3, 3), 1, 1),
          ((16, 64, 16, 16), (128, 64, 1, 1), 2, 0)]


def test_which_layers_take_digits_is_named_per_layer():
    """conv_backward_gemms says per gradient "digits" or "fp32 convolution_backward: <why>", the op's own decision
    (digits_pay on the im2col GEMM); grouped convs and grad_gemm="fp32" are named too. Printed: the run's record of
    which ResNet convs take digits on this CPU class."""
    for xs, ws, s, p in RESNET:
        how = conv_backward_gemms(xs, ws, s, p)
        Ho = (xs[2] + 2 * p - ws[2]) // s + 1
        shape = (xs[0] * Ho * Ho, xs[1] * ws[2] * ws[3], ws[0])
        for grad in ("x", "w"):
            verdict = how[f"grad_{grad}"]
            if grad == "x" and ws[0] < CONV_DIGITS_X_MIN_OUT_CHANNELS:  # short contraction: fp32 on every class
                assert "CONV_DIGITS_X_MIN_OUT_CHANNELS" in verdict, verdict
            elif digits_pay(*shape, grad=grad):
                assert verdict == "digits"
            else:  # named, with the rule's reason and the GEMM's shape
                assert verdict.startswith("fp32 convolution_backward: ") and str(shape) in verdict, verdict
        print(f"conv x {xs} w {ws} stride {s}: {how}")
    dw = conv_backward_gemms((16, 64, 16, 16), (64, 1, 3, 3), 1, 1, groups=64)
    assert all("grouped conv" in v for v in dw.values())
    assert all("grad_gemm='fp32'" in v for v in conv_backward_gemms((16, 64, 16, 16), (64, 64, 3, 3), 1, 1,
                                                                    grad_gemm="fp32").values())


def test_a_model_records_its_digit_gemms(monkeypatch):
    """In a model: the recording (what intqat-bench's "backends" column prints) counts the digit GEMMs the convs ran;
    the depthwise conv keeps convolution_backward."""
    _rule(monkeypatch, True)
    if backends.select("digit_matmul", record=False, at_run_time=True).name not in ("amx", "cpu_fused"):
        pytest.skip("no digit GEMM kernel runs here")
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                          nn.ReLU(), nn.Conv2d(8, 4, 1))
    intqat.prepare_qat(model, "w8a8")
    x = torch.randn(2, 3, 8, 8)
    intqat.calibrate(model, [x])
    intqat.to_integer(model)
    with backends.recording() as ran:
        model(x.requires_grad_()).sum().backward()
    assert sum(c for (p, _), c in ran.items() if p == "digit_matmul") == 2 * 2  # the two regular convs, both GEMMs


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_digits_through_torch_int_mm_give_the_same_bits(case, monkeypatch):
    """With cpu_fused forced, both paths run the digit GEMM through torch._int_mm (split, one _int_mm of the three
    planes, combine), as CPUs without AMX do: the same bits again, and the same as the AMX kernel's where it runs."""
    _rule(monkeypatch, True)
    B, C, O, H, W, k, _, _, _, layout = case
    x, w, b, s_w, _ = _operands(B, C, O, H, W, k, layout)
    with backends.use_backend("cpu_fused"):
        got = _step(False, x, w, b, s_w, 1, **_conv_kw(case))
        want = _step(True, x, w, b, s_w, 1, **_conv_kw(case))
    assert got[5][("digit_matmul", "cpu_fused")] == 2 and want[5][("digit_matmul", "cpu_fused")] == 2
    for name, a, bb in zip(("y", "grad_x", "grad_w", "grad_b"), got[1:5], want[1:5]):
        _same_bits(a, bb, name)
    if backends.unavailable("amx") is None:  # the table's default here: the AMX tiles
        amx = _step(False, x, w, b, s_w, 1, **_conv_kw(case))
        assert amx[5][("digit_matmul", "amx")] == 2
        for name, a, bb in zip(("grad_x", "grad_w"), got[2:4], amx[2:4]):
            _same_bits(a, bb, name)


def test_compiled_backward_gives_the_eager_bits(monkeypatch):
    """Traced (torch.compile): the Python path's digit GEMMs as the opaque intqat::digit_matmul, the fold as strided
    adds in the same order; the same bits as the eager C++ step."""
    _rule(monkeypatch, True)
    x, w, b, s_w, _ = _operands(2, 8, 16, 10, 10, 3, "nchw")

    def conv(x, w, b):
        return int_conv2d(x, w, b, torch.tensor([S_X]), torch.tensor([float(Z_X)]), s_w, stride=1, padding=1)

    g = torch.randn(2, 16, 10, 10, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (conv, torch.compile(conv, backend="aot_eager", fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        with backends.recording() as ran:
            fn(*leaves).backward(g)
        assert sum(c for (p, _), c in ran.items() if p == "digit_matmul") == 2
        grads.append([t.grad for t in leaves])
    for name, a, bb in zip(("grad_x", "grad_w", "grad_b"), *grads):
        _same_bits(a, bb, name)
