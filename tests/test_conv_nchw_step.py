"""The C++ conv step's layout kernels (kernels/cpu/nchw_layout.h, fused.c's intqat_epilogue_nchw / intqat_scale_nchw /
intqat_scale_channels / the transposes, train_conv.cpp) and IntConv2d's cached eager step (intqat/nn/conv_step.py)
against the plain-torch reference, bit for bit.

The transposes work in 16x16 (int8) and 4x4 / 16-row (fp32) tiles with scalar edges: the shapes below put channel
and pixel counts on both sides of every tile edge (3, 5, 17, 19 channels; 9x11, 7x7 maps), with padding, stride 2,
1x1 windows (whose columns are the NHWC codes themselves), NCHW, channels_last and non-dense inputs, on each forward
GEMM the step runs (torch._int_mm after im2col, oneDNN's int8 conv, the grouped fp32 conv of the codes) and with the
backward's digit GEMMs forced on (g as NHWC rows, grad_x back to NCHW).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import intqat
from intqat.ops import backends, conv_onednn, cpp_step
from intqat.ops.int_conv2d import int_conv2d

S_X, Z_X = 0.03, -4.0  # randn * 2 inputs clip at |x| > ~3.7: the input mask is active


@pytest.fixture(autouse=True)
def _op_runs_here():
    reason = cpp_step.unavailable_reason()
    if reason is not None:
        pytest.skip(f"C++ training op cannot run here: {reason}")


def _step(how: str, case: dict, g_seed: int = 1):
    """int_conv2d forward + backward -> (node, y, grad_x, grad_w, grad_b). how: "cpp" (the table's choice, the C++
    step), "reference" (the Python path on the reference backend: the definition), "python" (the Python path on the
    table's kernels: the digit GEMMs' definition), or "cpp:<backend>" forced."""
    B, C, O, H, W = case["shape"]
    k, groups, layout = case.get("k", 3), case.get("groups", 1), case.get("layout", "nchw")
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    x = torch.randn(B, C, H, W, generator=gen) * 2
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # not dense: every other column of a wider tensor
        x = (torch.randn(B, C, H, 2 * W, generator=gen) * 2)[..., ::2]
    w = torch.randn(O, C // groups, k, k, generator=gen) * 0.3
    b = torch.randn(O, generator=gen) if case.get("bias", True) else None
    s_w = w.abs().amax(dim=(1, 2, 3)) / 127 * 0.7  # 0.7: the largest weights clip (the weight mask is active)
    x, w = x.requires_grad_(), w.requires_grad_()
    if b is not None:
        b.requires_grad_()
    forced = "reference" if how == "reference" else how.partition(":")[2] or None
    ctx = backends.use_backend(forced) if forced else contextlib.nullcontext()
    with ctx, (cpp_step.disabled() if how in ("reference", "python") else contextlib.nullcontext()):
        y = int_conv2d(x, w, b, torch.tensor([S_X]), torch.tensor([Z_X]), s_w, stride=case.get("stride", 1),
                       padding=case.get("padding", 1), groups=groups)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(g_seed)))
    return y.grad_fn.name(), y.detach(), x.grad, w.grad, None if b is None else b.grad


def _same(got, want):
    for name, a, b in zip(("y", "grad_x", "grad_w", "grad_b"), got[1:], want[1:]):
        assert (a is None) == (b is None), name
        if a is not None:  # the bits: NaN == NaN, -0.0 != 0.0
            assert a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)), (
                f"{name}: max |diff| {(a - b).abs().nan_to_num().max()}")


CASES = {  # shape (B, C, O, H, W)
    "3x3-odd": dict(shape=(2, 5, 19, 9, 11)),
    "3x3-odd-cl": dict(shape=(2, 5, 19, 9, 11), layout="channels_last"),
    "3x3-strided": dict(shape=(2, 17, 6, 7, 7), layout="strided"),
    "3x3s2-nobias": dict(shape=(3, 17, 33, 11, 9), stride=2, bias=False),
    "stem-3ch-s2": dict(shape=(2, 3, 20, 13, 15), stride=2),
    "1x1": dict(shape=(2, 19, 7, 9, 11), k=1, padding=0),
    "1x1-cl": dict(shape=(2, 19, 7, 9, 11), k=1, padding=0, layout="channels_last"),
    "1x1s2": dict(shape=(2, 19, 7, 9, 11), k=1, padding=0, stride=2),
    "16ch-tiles": dict(shape=(2, 32, 48, 8, 8)),  # whole 16x16 tiles, no edges
    "depthwise": dict(shape=(2, 19, 19, 9, 11), groups=19),
    "depthwise-cl-s2": dict(shape=(2, 6, 12, 9, 11), groups=6, stride=2, layout="channels_last"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_table_s_choice_equals_the_reference(name):
    got, want = _step("cpp", CASES[name]), _step("reference", CASES[name])
    assert "IntConv2dTrain" in got[0] and want[0] == "_IntConv2dEagerBackward"  # each path really ran
    assert got[1].stride() == want[1].stride()  # the output takes the input's memory format
    if CASES[name].get("groups", 1) == CASES[name]["shape"][1] == CASES[name]["shape"][2]:
        # depthwise: the backward's fp32 sums are depthwise_grad's, whose order is each backend's (the C kernel's on
        # both eager paths here; oneDNN's in the reference): the Python path on the table's kernels gives the
        # C++ step's bits, the reference agrees within fp32 rounding (tests/test_depthwise_backward.py bounds it)
        _same(got, _step("python", CASES[name]))
        _same(got[:2], want[:2])  # the forward: exact integer sums, the same bits
        for a, b in zip(got[2:], want[2:]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
        return
    _same(got, want)


@pytest.mark.skipif(conv_onednn.unavailable_reason() is not None,
                    reason=f"oneDNN's int8 conv: {conv_onednn.unavailable_reason()}")
@pytest.mark.parametrize("name", ["3x3-odd", "3x3-odd-cl", "3x3-strided", "1x1", "16ch-tiles"])
def test_onednn_forward_equals_the_reference(name):
    """oneDNN's int8 conv fed u8 NHWC codes, its accumulator scaled straight into NCHW (or in place)."""
    with backends.recording() as ran:
        got = _step("cpp:onednn_conv", CASES[name])
    assert "IntConv2dTrain" in got[0] and ran[("conv_int8", "onednn_conv")] == 1, dict(ran)
    _same(got, _step("reference", CASES[name]))


@pytest.mark.parametrize("name", ["3x3-odd", "3x3s2-nobias", "stem-3ch-s2", "1x1", "1x1s2", "16ch-tiles"])
def test_im2col_forward_equals_the_reference(name):
    """im2col + torch._int_mm, the epilogue written straight into NCHW."""
    with backends.recording() as ran:
        got = _step("cpp:cpu_fused", CASES[name])
    assert "IntConv2dTrain" in got[0] and ran[("int_mm", "cpu_fused")] == 1, dict(ran)
    _same(got, _step("reference", CASES[name]))


@pytest.mark.parametrize("name", ["3x3-odd", "3x3s2-nobias", "1x1s2", "3x3-odd-cl", "16ch-tiles"])
def test_digit_backward_equals_the_reference(name, monkeypatch):
    """Both backward GEMMs as digits (the rule forced on): g's NCHW transposed into NHWC rows, grad_x's padded NHWC
    sums transposed back. The digit GEMM is not the exact STE product (test_conv_digit_backward bounds it): the
    definition of its bits is the Python path on the same kernels."""
    from test_conv_digit_backward import _rule

    _rule(monkeypatch, True)
    b = backends.select("digit_matmul", record=False, at_run_time=True)
    if b is None or b.name not in ("amx", "cpu_fused"):
        pytest.skip(f"no digit GEMM kernel runs here (the table picks {b and b.name})")
    with backends.recording() as ran:
        got = _step("cpp", CASES[name])
    assert sum(c for (p, _), c in ran.items() if p == "digit_matmul") == 2, dict(ran)
    with backends.recording() as ran:
        want = _step("python", CASES[name])
    assert sum(c for (p, _), c in ran.items() if p == "digit_matmul") == 2, dict(ran)
    assert want[0] == "_IntConv2dEagerBackward"
    _same(got, want)


def _resnet_ish(layout):
    m = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Conv2d(16, 19, 3, 1, 1), nn.BatchNorm2d(19), nn.ReLU(), nn.Conv2d(19, 8, 1),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return m.to(memory_format=layout)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_cached_eager_step_trains_like_int_conv2d(layout, monkeypatch):
    """IntConv2d's step decided once per input shape (conv_step) gives int_conv2d's bits over training steps, also
    when the input shape changes (a new decision); and its BN fold's eager 1/sqrt(var + eps) is the opaque op's."""
    import intqat.nn.conv as conv_mod

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 3, hw, hw, generator=gen).contiguous(memory_format=layout)
               for n, hw in ((4, 12), (4, 12), (3, 9), (4, 12))]
    targets = [torch.randint(0, 4, (x.shape[0],), generator=gen) for x in batches]

    def train(cached: bool):
        torch.manual_seed(0)
        m = _resnet_ish(layout)
        intqat.prepare_qat(m, "w8a8")
        intqat.calibrate(m, batches[:1])
        intqat.to_integer(m)
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with monkeypatch.context() as mp:
            mp.setattr(conv_mod, "fused_conv", lambda *a, **k: None)  # (the fused op's own tests: below)
            if not cached:
                mp.setattr(conv_mod, "conv_step", lambda *a, **k: None)  # int_conv2d on every call
            for x, y in zip(batches, targets):
                opt.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
        return m, [p.detach().clone() for p in m.parameters()]

    m, got = train(True)
    assert "_conv_step" in m[0].__dict__  # the cache was used
    _, want = train(False)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    bn = m[0].bn
    eager = conv_mod._fold_scale(bn, bn.weight)
    assert torch.equal(eager, bn.weight * conv_mod._bn_inv_std(bn.running_var, bn.eps))


def _scale_case_weights(O=24, C=7, k=3, seed=0):
    """Weights whose rows' max |w| / qmax take many float32 values: random magnitudes over 60 binades, an all-zero row
    and a row of subnormals (both floored at SCALE_EPS), a row at 1e30, negative maxima."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(O, C, k, k, generator=gen) * torch.exp2(torch.randint(-30, 30, (O, 1, 1, 1), generator=gen).float())
    w[0] = 0.0
    w[1] = torch.randn(C, k, k, generator=gen) * 1e-40
    w[2, 0, 0, 0] = -1e30
    w[3] = -w[3].abs()
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_own_minmax_scale_is_minmax_weight_scale(seed):
    """The op without w_scale computes the min-max scale per channel itself (conv_step's path): y and every gradient
    equal the op given minmax_weight_scale(w), bit for bit (one ulp of a scale would move y)."""
    from intqat.ops.int_linear import minmax_weight_scale
    from intqat.ops.qparams import SCALE_EPS

    op = torch.ops.intqat_train.int_conv2d.default
    gen = torch.Generator().manual_seed(100 + seed)
    w0 = _scale_case_weights(seed=seed)
    x0 = torch.randn(2, 7, 9, 9, generator=gen) * 2
    g = torch.randn(2, 24, 9, 9, generator=gen)
    outs = []
    for own in (True, False):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        s_w = None if own else minmax_weight_scale(w, 127)
        y = op(x, w, None, s_w, S_X, -4, [1, 1], [1, 1], [1, 1], 1, -128, 127, -127, 127, False, 0, False, False, False,
               SCALE_EPS)
        y.backward(g)
        outs.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="w_eps"):  # no scale and no floor: refused, not a silent zero floor
        op(x0, w0, None, None, S_X, -4, [1, 1], [1, 1], [1, 1], 1, -128, 127, -127, 127, False, 0, False, False, False)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k", [3, 1])
@pytest.mark.parametrize("frozen", ["none", "gamma", "weight"])
def test_bn_fold_op_is_the_python_fold(affine, bias, k, frozen):
    """intqat_train::bn_fold (IntConv2d._folded_eager) gives folded()'s w_fold, b_fold and the gradients of W, b,
    gamma, beta bit for bit, with and without affine BN / conv bias, for 1x1 kernels (sum_to over one dim), and with
    gamma or W frozen (those gradients not asked)."""
    from intqat.nn.conv import IntConv2d

    gen = torch.Generator().manual_seed(k + 2 * affine + 4 * bias)
    conv, bn = nn.Conv2d(6, 10, k, bias=bias), nn.BatchNorm2d(10, affine=affine)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(10, generator=gen))
        bn.running_var.copy_(torch.rand(10, generator=gen) * 3 + 1e-3)
        if affine:
            bn.weight.copy_(torch.randn(10, generator=gen))
            bn.bias.copy_(torch.randn(10, generator=gen))
    if frozen == "gamma" and affine:
        bn.weight.requires_grad_(False)
    if frozen == "weight":
        conv.weight.requires_grad_(False)
    m = IntConv2d.from_fake_quant(intqat.nn.FakeQuantConv2d.from_conv(conv, "w8a8", bn=bn))
    g_w = torch.randn(10, 6, k, k, generator=gen)
    g_b = torch.randn(10, generator=gen)
    params = [p for p in (conv.weight, conv.bias, bn.weight, bn.bias) if p is not None and p.requires_grad]
    results = []
    for fold in (m._folded_eager, m.folded):
        for p in params:
            p.grad = None
        w, b = fold()
        outs = [(t, g) for t, g in ((w, g_w), (b, g_b)) if t.requires_grad]
        if outs:
            torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
        results.append((w.detach(), b.detach(), [p.grad for p in params]))
    (w1, b1, grads1), (w2, b2, grads2) = results
    assert torch.equal(w1, w2) and torch.equal(b1, b2)
    for a, c in zip(grads1, grads2):
        assert a is not None and torch.equal(a, c)
    with cpp_step.disabled():  # the Python fold inside the switch (tests compare both)
        w3, _ = m._folded_eager()
    assert w3.grad_fn is None or "BnFold" not in type(w3.grad_fn).__name__


def test_bn_fold_op_trains_like_the_python_fold(monkeypatch):
    """A few SGD steps of the ResNet-ish net: the C++ fold and the Python fold give the same parameters, bit for bit."""
    import intqat.nn.conv as conv_mod
    from intqat.nn.conv import IntConv2d

    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 3, 12, 12, generator=gen) for _ in range(3)]
    targets = [torch.randint(0, 4, (4,), generator=gen) for _ in batches]

    def train(python_fold: bool):
        torch.manual_seed(0)
        m = _resnet_ish(torch.contiguous_format)
        intqat.prepare_qat(m, "w8a8")
        intqat.calibrate(m, batches[:1])
        intqat.to_integer(m)
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with monkeypatch.context() as mp:
            mp.setattr(conv_mod, "fused_conv", lambda *a, **k: None)  # (the fold inside the fused op: below)
            if python_fold:
                mp.setattr(IntConv2d, "_folded_eager", IntConv2d.folded)
            for x, y in zip(batches, targets):
                opt.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
        return [p.detach().clone() for p in m.parameters()] + [b.clone() for b in m.buffers()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


@pytest.mark.skipif(conv_onednn.unavailable_reason() is not None, reason="oneDNN's int8 conv unavailable")
def test_onednn_prepack_unit_scale_as_one_number():
    """The prepack takes the unit weight scale as one number (train_conv.cpp onednn_one, conv_onednn._one_conv): the
    same packed weight as the per-channel ones, so the same accumulator, on worst-case and random codes."""
    gen = torch.Generator().manual_seed(0)
    for q_w in (torch.full((16, 8, 3, 3), -128, dtype=torch.int8), torch.full((16, 8, 3, 3), 127, dtype=torch.int8),
                torch.randint(-128, 128, (16, 8, 3, 3), generator=gen, dtype=torch.int8)):
        u8 = torch.randint(0, 256, (2, 8, 7, 7), generator=gen, dtype=torch.uint8).contiguous(
            memory_format=torch.channels_last)
        ones, zeros = torch.ones(16), torch.zeros(16, dtype=torch.int64)
        outs = []
        for scale in (ones, torch.ones(())):
            packed = torch.ops.onednn.qconv_prepack(q_w, scale, 1.0, 131, [1, 1], [1, 1], [1, 1], 1, list(u8.shape))
            outs.append(torch.ops.onednn.qconv_pointwise(u8, 1.0, 131, packed, ones, zeros, None, [1, 1], [1, 1],
                                                         [1, 1], 1, 1.0, 0, torch.float32, "none", [], ""))
        assert torch.equal(outs[0], outs[1])


# -- the observer, the BN fold and the conv step in one op call (conv_step.fused_conv, observed_int_conv2d) ------------

FUSED_ACTIVATIONS = {  # observer flavours of the static activation quantizer (w8a8's per-channel min-max weights)
    "asym8 moving average": {},
    "asym8 minmax": {"observer": "minmax"},
    "sym8 moving average": {"symmetric": True, "averaging_constant": 0.1},
}


@pytest.fixture
def fused_count(monkeypatch):
    """Counts fused_conv's calls that returned y; state["on"] False makes it hand every call back (the previous path:
    integer_input, _folded_eager, conv_step)."""
    import intqat.nn.conv as conv_mod

    real = conv_mod.fused_conv
    state = {"ran": 0, "on": True}

    def spy(*args):
        if not state["on"]:
            return None
        y = real(*args)
        state["ran"] += y is not None
        return y

    monkeypatch.setattr(conv_mod, "fused_conv", spy)
    return state


class _SE(nn.Module):
    """squeeze-excite's two 1x1 convs on a 1x1 map, with BN (as the bench's MBConv block)"""

    def __init__(self, c=16, r=4):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Sequential(nn.Conv2d(c, r, 1, bias=False), nn.BatchNorm2d(r), nn.ReLU())
        self.expand = nn.Sequential(nn.Conv2d(r, c, 1), nn.BatchNorm2d(c, affine=False))

    def forward(self, x):
        return x * torch.sigmoid(self.expand(self.reduce(self.pool(x))))


def _fused_net(layout=torch.contiguous_format):
    """9 convs: stem 3x3 s2 with BN, 1x1 expand with BN, depthwise 3x3 with BN, SE (1x1 with BN / with bias and a
    non-affine BN), 3x3 with bias and no BN, 1x1 project with BN; then a linear head"""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True),
        nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU(), _SE(16, 4),
        nn.Conv2d(16, 12, 3, 1, 1), nn.ReLU(),
        nn.Conv2d(12, 8, 1, bias=False), nn.BatchNorm2d(8),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(memory_format=layout)


N_CONVS = 7


def _fused_model(activation: dict, calibrate: bool = True, layout=torch.contiguous_format) -> nn.Module:
    torch.manual_seed(0)
    m = _fused_net(layout)
    intqat.prepare_qat(m, {"preset": "w8a8", "activation": activation})
    if calibrate:
        intqat.calibrate(m, [torch.randn(4, 3, 12, 12).contiguous(memory_format=layout)])
        intqat.to_integer(m)
    else:
        with pytest.warns(UserWarning, match="never observed data"):  # (said so; the first batch sets the scales)
            intqat.to_integer(m)
    return m.train()


def _fused_batches(n=3, layout=torch.contiguous_format):
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        x = (torch.randn(4, 3, 12, 12, generator=g) * (1 + i)).contiguous(memory_format=layout)
        yield x, torch.randint(0, 4, (4,), generator=g)


def _fused_train(model, batches):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _assert_same_state(a: nn.Module, b: nn.Module, grads_a, grads_b):
    assert list(a.state_dict()) == list(b.state_dict())  # the same keys: nothing saved or renamed
    for (k, t), u in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(t, u), k  # weights after the steps, BN statistics and every observer buffer
    for step_a, step_b in zip(grads_a, grads_b):
        for g, h in zip(step_a, step_b):
            assert torch.equal(g, h)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", list(FUSED_ACTIVATIONS))
def test_fused_conv_trains_like_the_three_calls_and_the_python_path(name, layout, fused_count):
    """Three Adam steps of a small MBConv-like net (stem, expand, depthwise, SE with and without BN affine / bias, a
    conv without BN, project): the same gradients, weights, BN statistics and observer buffers as integer_input +
    _folded_eager + conv_step, and as the path with every C++ op off."""
    import copy

    fused = _fused_model(FUSED_ACTIVATIONS[name], layout=layout)
    three_calls, python = copy.deepcopy(fused), copy.deepcopy(fused)
    grads = _fused_train(fused, _fused_batches(layout=layout))
    assert fused_count["ran"] == 3 * N_CONVS
    fused_count["on"] = False
    _assert_same_state(fused, three_calls, grads, _fused_train(three_calls, _fused_batches(layout=layout)))
    with cpp_step.disabled():
        _assert_same_state(fused, python, grads, _fused_train(python, _fused_batches(layout=layout)))


def test_fused_conv_first_batch_initialises_the_observer(fused_count):
    """Integer convs that never saw data: the fused op's first update sets the range and `initialized` (and the
    Python flag, so the next batch averages), as integer_input does."""
    import copy

    fused = _fused_model({}, calibrate=False)
    ref = copy.deepcopy(fused)
    assert not fused[0].input_quantizer._initialized
    grads = _fused_train(fused, _fused_batches(2))
    assert fused_count["ran"] == 2 * N_CONVS and fused[0].input_quantizer._initialized
    fused_count["on"] = False
    _assert_same_state(fused, ref, grads, _fused_train(ref, _fused_batches(2)))


def test_fused_conv_observer_off_and_eval_mode_use_the_kept_scale(fused_count):
    """Training with the observer off (the op checks the batch only) and eval-mode training (nothing observed; BN
    folded with running statistics either way): the same bits as the previous path, the buffers do not move."""
    import copy

    for mode in ("observer off", "eval"):
        fused = _fused_model({})
        if mode == "eval":
            fused.eval()
        else:
            fused.apply(lambda m: m.enable_observer(False) if hasattr(m, "enable_observer") else None)
        before = copy.deepcopy(fused.state_dict())
        ref = copy.deepcopy(fused)
        fused_count["on"], fused_count["ran"] = True, 0
        grads = _fused_train(fused, _fused_batches(2))
        assert fused_count["ran"] == 2 * N_CONVS, mode
        for k, t in fused.state_dict().items():
            if "input_quantizer" in k:
                assert torch.equal(t, before[k]), (mode, k)
        fused_count["on"] = False
        _assert_same_state(fused, ref, grads, _fused_train(ref, _fused_batches(2)))


def _one_conv(bn: bool = True):
    """a 5 -> 7 3x3 IntConv2d (with BN) after one observed batch, training mode"""
    from intqat.nn.conv import FakeQuantConv2d, IntConv2d

    torch.manual_seed(0)
    fq = FakeQuantConv2d.from_conv(nn.Conv2d(5, 7, 3, padding=1), "w8a8", bn=nn.BatchNorm2d(7) if bn else None)
    fq.freeze_bn_stats()
    fq.train()(torch.randn(2, 5, 6, 6))
    return IntConv2d.from_fake_quant(fq).train()


@pytest.mark.parametrize("observer_on", [True, False])
def test_fused_conv_refuses_nan_or_inf_and_changes_nothing(observer_on, fused_count):
    """The op hands the batch back untouched (observer buffers, BN statistics); the general path refuses it
    (NonFiniteInputError)."""
    import copy

    from intqat.nn.quantizers import NonFiniteInputError

    layer = _one_conv()
    layer.input_quantizer.enable_observer(observer_on)
    layer(torch.randn(2, 5, 6, 6))
    assert fused_count["ran"] == 1
    before = copy.deepcopy(layer.state_dict())
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = torch.randn(2, 5, 6, 6)
        bad[1, 2, 3, 4] = value
        with pytest.raises(NonFiniteInputError):
            layer(bad)
        for k, t in layer.state_dict().items():
            assert torch.equal(t, before[k]), k
    assert fused_count["ran"] == 1


def test_fused_conv_kept_range_not_finite_takes_the_general_path(fused_count):
    """A loaded state holding inf: the op changes nothing and hands the call back; the result is the previous path's
    (the tensor observer), NaN where it is NaN."""
    import copy

    layer = _one_conv()
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 5, 6, 6)
    for m in (layer, ref):
        m.input_quantizer.max_val.fill_(float("inf"))
    y = layer(x)
    assert fused_count["ran"] == 0
    fused_count["on"] = False
    y_ref = ref(x)
    assert torch.equal(y, y_ref) or (y.isnan() == y_ref.isnan()).all()
    for (k, t), u in zip(layer.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(t, u) or (t.isnan() == u.isnan()).all(), k


@pytest.mark.parametrize("case", ["double BN", "no grad", "inference mode", "weight frozen, input needs grad", "no BN",
                                  "eval, no grad"])
def test_fused_conv_cases_it_hands_back_or_takes(case, fused_count):
    """A float64 BN (the Python fold's case) is handed back, nothing changed; no-grad and inference-mode calls (a
    validation loop, in train or eval mode), a frozen weight with an input that needs its gradient, and a conv without
    BN are taken: the same bits as the previous path (y, grad_x, the buffers: a train-mode no-grad call observes)."""
    import copy

    layer = _one_conv(bn=case != "no BN")
    if case == "double BN":
        layer.bn.double()
    if case == "weight frozen, input needs grad":
        layer.weight.requires_grad_(False)
    if case == "eval, no grad":
        layer.eval()
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 5, 6, 6) * 3  # (wider than the observed batch: a train-mode update moves the range)
    outs = []
    for m, on in ((layer, True), (ref, False)):
        fused_count["on"] = on
        xa = x.clone().requires_grad_()
        if case in ("no grad", "eval, no grad", "inference mode"):
            with torch.inference_mode() if case == "inference mode" else torch.no_grad():
                y = m(xa)
        else:
            y = m(xa)
            y.backward(torch.ones_like(y))
        outs.append((y.detach().clone(), xa.grad, copy.deepcopy(m.state_dict())))
    assert fused_count["ran"] == (0 if case == "double BN" else 1)
    (y1, g1, s1), (y2, g2, s2) = outs
    assert torch.equal(y1, y2) and (g1 is None) == (g2 is None) and (g1 is None or torch.equal(g1, g2))
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k
    if case in ("no grad", "inference mode"):  # the train-mode call observed the wider batch
        assert not torch.equal(s1["input_quantizer.max_val"], layer.input_quantizer.max_val.new_tensor(0.0))


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_fused_conv_validation_forward_is_the_deployed_arithmetic(layout, fused_count):
    """A validation pass (eval mode, inference mode) of the MBConv-like net runs every conv through the fused op, and
    gives the bits of the general path (the plain-aten deploy arithmetic) and of the exported program."""
    import copy

    model = _fused_model({}, layout=layout).eval()
    ref = copy.deepcopy(model)
    x = next(iter(_fused_batches(1, layout=layout)))[0]
    with torch.inference_mode():
        y = model(x)
    assert fused_count["ran"] == N_CONVS
    fused_count["on"] = False
    with torch.inference_mode():
        y_ref = ref(x)
    assert torch.equal(y, y_ref)
    with torch.no_grad():  # (export traces the plain-aten path, never the op)
        program = torch.export.export(copy.deepcopy(model), (x,))
    assert torch.equal(program.module()(x), y)


def test_fused_conv_checkpointing_checks_without_observing_again(fused_count):
    """The backward's recompute runs the op in its check mode (no second observer update): the same gradients and
    buffers as the step without checkpointing."""
    import copy

    from torch.utils.checkpoint import checkpoint

    plain = _fused_model({})
    ckpt = copy.deepcopy(plain)
    x = torch.randn(4, 3, 12, 12) * 3
    plain(x).square().sum().backward()
    checkpoint(ckpt, x, use_reentrant=False).square().sum().backward()
    assert fused_count["ran"] == 3 * N_CONVS  # the plain step, the checkpointed forward, its recompute (check mode)
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    for (k, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), k


def test_fused_conv_records_what_the_three_calls_record(fused_count):
    """backends.recording() counts the same (primitive, backend) pairs: the bench's `backends` column is unchanged."""
    import copy

    fused = _fused_model({})
    ref = copy.deepcopy(fused)
    x, y = next(_fused_batches(1))
    with backends.recording() as got:
        nn.functional.cross_entropy(fused(x), y).backward()
    fused_count["on"] = False
    with backends.recording() as want:
        nn.functional.cross_entropy(ref(x), y).backward()
    assert got == want and got[("conv_step", "cpp_step")] == N_CONVS


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 0.1, 0.0])
def test_fold_loop_is_the_aten_expression(eps):
    """BnFold's one-loop forward (fold_values) against the aten expression it replaces, bit for bit, over running
    variances from 1e-30 to 1e30 (and 0), large and tiny gammas, means and biases: w_fold, b_fold."""
    from intqat.nn.conv import IntConv2d

    gen = torch.Generator().manual_seed(int(eps * 1e6))
    O = 4096
    conv, bn = nn.Conv2d(3, O, 1), nn.BatchNorm2d(O, eps=eps)
    mag = lambda lo, hi: torch.exp2(torch.randint(lo, hi, (O,), generator=gen).float())  # noqa: E731
    with torch.no_grad():
        bn.running_var.copy_(torch.rand(O, generator=gen) * mag(-100, 100))
        bn.running_var[:8] = 0.0
        bn.running_mean.copy_(torch.randn(O, generator=gen) * mag(-60, 60))
        bn.weight.copy_(torch.randn(O, generator=gen) * mag(-40, 40))
        bn.bias.copy_(torch.randn(O, generator=gen) * mag(-40, 40))
        conv.bias.copy_(torch.randn(O, generator=gen) * mag(-40, 40))
        conv.weight.copy_(torch.randn(O, 3, 1, 1, generator=gen) * mag(-20, 20).reshape(-1, 1, 1, 1))
    m = IntConv2d.from_fake_quant(intqat.nn.FakeQuantConv2d.from_conv(conv, "w8a8", bn=bn))
    w1, b1 = m._folded_eager()
    w2, b2 = m.folded()
    for a, b in ((w1, w2), (b1, b2)):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))


@pytest.mark.parametrize("asked", [("x",), ("weight",), ("gamma",), ("beta",), ("bias",), ("x", "gamma"),
                                   ("x", "weight", "bias", "gamma", "beta")])
def test_fused_conv_one_node_gives_the_asked_gradients_of_the_two(asked, fused_count):
    """With BN, the fused op's fold and conv are one autograd node (FoldedConvTrain): torch.autograd.grad of any subset
    of (x, W, b, gamma, beta) gives the two nodes' (bn_fold, then int_conv2d) values bit for bit, and, like them,
    nothing for the inputs not asked."""
    import copy

    layer = _one_conv()
    ref = copy.deepcopy(layer)
    x = torch.randn(2, 5, 6, 6)
    g = torch.randn(2, 7, 6, 6)
    got = []
    for m, on in ((layer, True), (ref, False)):
        fused_count["on"] = on
        xa = x.clone().requires_grad_()
        named = {"x": xa, "weight": m.weight, "bias": m.bias, "gamma": m.bn.weight, "beta": m.bn.bias}
        y = m(xa)
        got.append((y.detach(), torch.autograd.grad(y, [named[k] for k in asked], g)))
        assert ("FoldedConvTrain" in y.grad_fn.name()) == on
    assert fused_count["ran"] == 1
    (y1, g1), (y2, g2) = got
    assert torch.equal(y1, y2)
    for k, a, b in zip(asked, g1, g2):
        assert torch.equal(a, b), k
