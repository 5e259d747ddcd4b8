"""The C++ training op (kernels/cpu/train_linear.cpp, intqat.ops.cpp_step) against int_linear's Python
path, bit for bit: outputs, the gradients of x, W and b, with every setting the op takes.

The op runs the cpu_fused backend's kernels, so each check forces that backend: it runs (and is checked)
on every CPU where the kernels build, with int8 dot products or not. A machine where the C++ build fails
skips these with the reason, and the session summary (conftest.py) says so.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import intqat
from intqat.ops import backends, cpp_step
from intqat.ops.int_linear import int_linear

X_SCALE, X_ZERO_POINT = 0.02, 3.0


@pytest.fixture(autouse=True)
def _op_runs_here():
    reason = cpp_step.unavailable_reason()
    if reason is not None:
        pytest.skip(f"C++ training op cannot run here: {reason}")
    if backends.unavailable("cpu_fused") is not None:
        pytest.skip(f"C++ training op cannot run here: backend cpu_fused: {backends.unavailable('cpu_fused')}")


def _node(y: torch.Tensor) -> str:
    fn = y.grad_fn
    while fn is not None and fn.name() in ("ViewBackward0", "ReshapeAliasBackward0"):
        fn = fn.next_functions[0][0]
    return fn.name()


def _step(M, K, N, *, dynamic, w_scale, bias, grad_gemm, python, g_transform=None, seed=0, forced="cpu_fused"):
    """int_linear forward + backward on fresh leaves -> (node name, y, grad_x, grad_w, grad_b)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=gen) * 2).requires_grad_()
    w = torch.randn(N, K, generator=gen).requires_grad_()
    b = torch.randn(N, generator=gen).requires_grad_() if bias else None
    # a fixed weight scale 0.7x the min-max one: some weights clip, so the weight mask matters
    ws = w.detach().abs().amax(1) / 127 * 0.7 if w_scale else None
    g = torch.randn(M, N, generator=gen)
    if g_transform is not None:
        g = g_transform(g)
    with backends.use_backend(forced), (cpp_step.disabled() if python else torch.enable_grad()):
        y = int_linear(x, w, b, torch.tensor([X_SCALE]), torch.tensor([X_ZERO_POINT]), ws, x_dynamic=dynamic,
                       grad_gemm=grad_gemm)
        node = _node(y)
        y.backward(g)
    return node, y.detach(), x.grad, w.grad, None if b is None else b.grad


def _assert_same(got, want):
    for name, a, b in zip(("y", "grad_x", "grad_w", "grad_b"), got[1:], want[1:]):
        assert (a is None) == (b is None), name
        if a is not None:  # the bits: NaN == NaN, and -0.0 != 0.0
            assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32)), (
                f"{name}: max |diff| {(a - b).abs().nan_to_num().max()}")


# (M, K, N): BERT-tiny's projections (both backward GEMMs as digits where they pay), odd sizes, one row,
# a long contraction, and shapes on either side of digits_pay's thresholds
SHAPES = [(256, 128, 384), (7, 33, 5), (1, 16, 3), (300, 512, 128), (64, 256, 512), (1024, 128, 128)]
SETTINGS = list(itertools.product([False, True], [False, True], [False, True], ["int8x3", "fp32"]))


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dynamic,w_scale,bias,grad_gemm", SETTINGS)
def test_cpp_op_equals_the_python_path(M, K, N, dynamic, w_scale, bias, grad_gemm):
    kw = dict(dynamic=dynamic, w_scale=w_scale, bias=bias, grad_gemm=grad_gemm)
    with backends.recording() as ran:
        got = _step(M, K, N, python=False, **kw)
    want = _step(M, K, N, python=True, **kw)
    assert "IntLinearTrain" in got[0] and want[0] == "_IntLinearEagerBackward"  # each path really ran
    assert ran[("linear_step", "cpp_step")] == 1 and ran[("linear", "cpu_fused")] == 1
    _assert_same(got, want)


@pytest.mark.parametrize("M,K,N", [(256, 128, 384), (7, 33, 5), (300, 512, 128)])
@pytest.mark.parametrize("dynamic,w_scale", [(False, False), (False, True), (True, False)])
def test_cpp_op_with_the_avx2_int16_forward_equals_the_python_path(M, K, N, dynamic, w_scale):
    """The forward GEMM of CPUs without int8 dot products (vpmaddwd, fused with the epilogue) inside the op."""
    reason = backends.unavailable("avx2_int16")
    if reason is not None:
        pytest.skip(f"backend avx2_int16 cannot run here: {reason}")
    kw = dict(dynamic=dynamic, w_scale=w_scale, bias=True, grad_gemm="int8x3", forced="avx2_int16")
    with backends.recording() as ran:
        got = _step(M, K, N, python=False, **kw)
    assert "IntLinearTrain" in got[0] and ran[("linear", "avx2_int16")] == 1
    _assert_same(got, _step(M, K, N, python=True, **kw))


@pytest.mark.parametrize("M,K,N", [(256, 128, 512), (100, 1000, 1200), (100, 1024, 1200), (64, 64, 4096)])
@pytest.mark.parametrize("dynamic,w_scale", [(False, True), (True, False)])
def test_cpp_op_with_the_amx_forward_equals_the_python_path(M, K, N, dynamic, w_scale):
    """The AMX forward kernel (epilogue in the tile loop) inside the op: padded K, a partial last row block, and
    layers the table puts on amx unforced (BERT-tiny's first FFN layer, 256x128x512). grad_gemm="fp32": the op
    calls torch._int_mm's digit GEMM, not AMX's, so a layer whose digits the table puts on amx keeps the Python path."""
    reason = backends.unavailable("amx")
    if reason is not None:
        pytest.skip(f"backend amx cannot run here: {reason}")
    kw = dict(dynamic=dynamic, w_scale=w_scale, bias=True, grad_gemm="fp32", forced="amx")
    with backends.recording() as ran:
        got = _step(M, K, N, python=False, **kw)
    assert "IntLinearTrain" in got[0] and ran[("linear", "amx")] == 1 and ran[("linear_step", "cpp_step")] == 1
    _assert_same(got, _step(M, K, N, python=True, **kw))


@pytest.mark.parametrize("transform", ["strided", "expanded", "non_finite"])
def test_cpp_op_takes_any_incoming_gradient(transform):
    """A strided or broadcast gradient (what a slice or a sum hands back), and NaN / inf in it (a row the
    digit split flags): the same bits as the Python path, digits or fp32."""
    def strided(g):
        return torch.cat([g, g], dim=1)[:, ::2]

    def expanded(g):
        return g[:1].expand_as(g)

    def non_finite(g):
        g = g.clone()
        g[3, 5], g[10, 0] = float("nan"), float("inf")
        return g

    fn = {"strided": strided, "expanded": expanded, "non_finite": non_finite}[transform]
    for grad_gemm in ("int8x3", "fp32"):
        kw = dict(dynamic=False, w_scale=True, bias=True, grad_gemm=grad_gemm, g_transform=fn)
        _assert_same(_step(256, 128, 384, python=False, **kw), _step(256, 128, 384, python=True, **kw))


@pytest.mark.parametrize("needs", ["x", "w", "b", "w,b"])
def test_cpp_op_computes_only_the_gradients_asked_for(needs):
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(64, 96, generator=gen), torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    leaves = {"x": x, "w": w, "b": b}
    for name in needs.split(","):
        leaves[name].requires_grad_()
    with backends.use_backend("cpu_fused"):
        y = int_linear(x, w, b, torch.tensor([X_SCALE]), torch.tensor([X_ZERO_POINT]), None)
        assert "IntLinearTrain" in _node(y)
        y.sum().backward()
    for name, t in leaves.items():
        assert (t.grad is not None) == (name in needs.split(","))


def test_saved_tensor_hooks_see_what_the_op_keeps():
    """Activation offloading / memory accounting hooks (torch.autograd.graph.saved_tensors_hooks) see the
    int8 codes and the mask bits, not fp32 copies: 1 byte per activation and weight, 1 bit per mask."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(16, 64, requires_grad=True)
    with backends.use_backend("cpu_fused"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = int_linear(x, w, None, torch.tensor([X_SCALE]), torch.tensor([X_ZERO_POINT]), None)
    assert "IntLinearTrain" in _node(y)
    dtypes = sorted(str(t.dtype) for t in saved)
    assert dtypes.count("torch.int8") == 2 and "torch.uint8" in dtypes
    assert max(t.numel() * t.element_size() for t in saved) == 32 * 64  # q_x, nothing fp32 of x's size
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_learned_scales_keep_the_python_path():
    """LSQ scale gradients are the Python path's: a scale that requires grad is never given to the op."""
    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(16, 64, requires_grad=True)
    s = torch.tensor([X_SCALE], requires_grad=True)
    with backends.use_backend("cpu_fused"):
        y = int_linear(x, w, None, s, torch.tensor([X_ZERO_POINT]), None)
    assert _node(y) == "_IntLinearEagerBackward"
    y.sum().backward()
    assert s.grad is not None


def test_other_forced_backends_keep_the_python_path():
    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(16, 64, requires_grad=True)
    for name in ("reference", "fp32_exact"):
        with backends.use_backend(name):
            y = int_linear(x, w, None, torch.tensor([X_SCALE]), torch.tensor([X_ZERO_POINT]), None)
        assert _node(y) == "_IntLinearEagerBackward", name


def _train(model_fn, x, python: bool):
    """3 Adam steps of the integer model (prepare_qat, calibrate, to_integer), through the C++ ops or the
    Python path -> (losses, parameters after, the backend recording)."""
    torch.manual_seed(0)
    m = model_fn()
    intqat.prepare_qat(m, "w8a8")
    intqat.calibrate(m, [x])
    intqat.to_integer(m)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    losses = []
    with backends.use_backend("cpu_fused"), (cpp_step.disabled() if python else torch.enable_grad()), \
            backends.recording() as ran:
        for _ in range(3):
            opt.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in m.parameters()], ran


def _trains_the_same(model_fn, x) -> int:
    """Both ways, the same losses and weights bit for bit -> how many layer steps ran through the C++ ops."""
    (losses, params, ran), (losses_py, params_py, ran_py) = _train(model_fn, x, False), _train(model_fn, x, True)
    assert losses == losses_py
    assert all(torch.equal(p, q) for p, q in zip(params, params_py))
    assert ran_py[("linear_step", "cpp_step")] == ran_py[("conv_step", "cpp_step")] == 0
    return ran[("linear_step", "cpp_step")] + ran[("conv_step", "cpp_step")]


def test_a_model_trains_the_same_through_the_op():
    """An integer MLP, an integer encoder layer (MHA projections, FFN) and a GPT-2-style MLP of transformers'
    Conv1D layers through a few Adam steps: the same losses and weights, bit for bit, with the op and with
    the Python path; every layer's step through the op."""
    def mlp():
        return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 8))

    def encoder():
        return nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)

    def gpt2_mlp():  # transformers' Conv1D: weight stored (in, out), read as the view weight.t()
        from transformers.pytorch_utils import Conv1D

        return nn.Sequential(Conv1D(64, 48), nn.GELU(), Conv1D(8, 64))

    layers = {mlp: 2, encoder: 4, gpt2_mlp: 2}  # integer linear layers (the encoder: in_proj, out_proj, FFN)
    for model_fn, x in ((mlp, torch.randn(40, 48)), (encoder, torch.randn(4, 10, 32)), (gpt2_mlp, torch.randn(40, 48))):
        assert _trains_the_same(model_fn, x) == layers[model_fn] * 3


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_switched_off_or_unbuildable_keeps_the_python_path_and_says_so(tmp_path):
    code = (
        "import warnings, torch\n"
        "from intqat.ops import cpp_step\n"
        "from intqat.ops.int_linear import int_linear\n"
        "x = torch.randn(8, 16, requires_grad=True); w = torch.randn(4, 16, requires_grad=True)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    y = int_linear(x, w, None, torch.tensor([0.05]), torch.tensor([0.0]), None)\n"
        "fn = y.grad_fn.next_functions[0][0] if y.grad_fn.name() == 'ViewBackward0' else y.grad_fn\n"
        "print(fn.name()); print(cpp_step.unavailable_reason())\n"
        "print(any('C++ training op' in str(c.message) for c in caught))\n"
    )
    off = _python(code, INTQAT_CPP_STEP="0")
    assert off.returncode == 0, off.stderr
    node, reason, warned = off.stdout.split("\n")[:3]
    assert node == "_IntLinearEagerBackward" and "INTQAT_CPP_STEP=0" in reason and warned == "False"

    # no C++ compiler (and a cache that holds no built op): the Python path, and one warning naming why
    broken = _python(code, CXX=str(tmp_path / "no-such-c++"), INTQAT_CACHE_DIR=str(tmp_path / "cache"))
    assert broken.returncode == 0, broken.stderr
    node, reason, warned = broken.stdout.split("\n")[:3]
    assert node == "_IntLinearEagerBackward" and "build failed" in reason and warned == "True"


# --- the conv op (kernels/cpu/train_conv.cpp) ------------------------------------------------------------

def _conv_step(python, *, groups=1, C=6, O=8, k=3, stride=1, padding=1, dilation=1, layout="nchw", bias=True,
               w_clip=True, g_transform=None, seed=0, forced="cpu_fused"):
    """int_conv2d forward + backward on fresh leaves -> (node, y, grad_x, grad_w, grad_b)."""
    from intqat.ops.int_conv2d import int_conv2d

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, C, 11, 9, generator=gen) * 2
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "strided":  # not dense: every other column of a wider tensor
        x = torch.randn(3, C, 11, 18, generator=gen)[..., ::2] * 2
    x.requires_grad_()
    w = (torch.randn(O, C // groups, k, k, generator=gen) * 0.3).requires_grad_()
    b = torch.randn(O, generator=gen).requires_grad_() if bias else None
    s_w = w.detach().abs().amax(dim=(1, 2, 3)) / 127 * (0.7 if w_clip else 1.0)  # 0.7: some weights clip
    with backends.use_backend(forced), (cpp_step.disabled() if python else torch.enable_grad()):
        y = int_conv2d(x, w, b, torch.tensor([0.03]), torch.tensor([-4.0]), s_w, stride=stride, padding=padding,
                       dilation=dilation, groups=groups, w_clip_mask=w_clip)
        node = y.grad_fn.name()
        g = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        if g_transform is not None:
            g = g_transform(g)
        y.backward(g)
    return node, y.detach(), x.grad, w.grad, None if b is None else b.grad


CONV_CASES = [
    dict(),  # 3x3, pad 1: a ResNet / VGG conv
    dict(layout="channels_last"),
    dict(layout="strided"),
    dict(k=1, padding=0),  # pointwise
    dict(stride=2, padding=0, bias=False),
    dict(dilation=2, padding=2, w_clip=False),
    dict(groups=2, O=8),
    dict(groups=6, O=6),  # depthwise
    dict(groups=6, O=12, layout="channels_last", stride=2),  # depthwise x2
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "3x3")
def test_cpp_conv_equals_the_python_path(case):
    got, want = _conv_step(False, **case), _conv_step(True, **case)
    assert "IntConv2dTrain" in got[0] and want[0] == "_IntConv2dEagerBackward"  # each path really ran
    assert got[1].stride() == want[1].stride()  # the output takes the input's layout, as before
    _assert_same(got, want)


@pytest.mark.parametrize("case", [dict(), dict(layout="channels_last", stride=2), dict(k=1, padding=0)],
                         ids=["3x3", "channels_last-stride2", "pointwise"])
def test_cpp_conv_with_the_avx2_int16_gemm_equals_the_python_path(case):
    """Plain convs on CPUs without int8 dot products: the op's GEMM is AVX2's vpmaddwd, as avx2_int16's int_mm."""
    reason = backends.unavailable("avx2_int16")
    if reason is not None:
        pytest.skip(f"backend avx2_int16 cannot run here: {reason}")
    with backends.recording() as ran:
        got = _conv_step(False, forced="avx2_int16", **case)
    assert "IntConv2dTrain" in got[0] and ran[("int_mm", "avx2_int16")] == 1
    _assert_same(got, _conv_step(True, forced="avx2_int16", **case))


def test_cpp_conv_takes_any_incoming_gradient():
    def non_finite(g):
        g = g.clone()
        g[0, 1, 2, 3], g[1, 0, 0, 0] = float("nan"), float("inf")
        return g

    for fn in (non_finite, lambda g: g[:1].expand_as(g), lambda g: g.contiguous(memory_format=torch.channels_last)):
        _assert_same(_conv_step(False, g_transform=fn), _conv_step(True, g_transform=fn))


def test_cpp_conv_keeps_the_python_path_where_it_does_not_apply():
    """Dynamic activations, learned scales, a depthwise conv longer than one exact fp32 conv, other backends."""
    from intqat.ops.int_conv2d import int_conv2d

    x, w = torch.randn(2, 4, 6, 6, requires_grad=True), torch.randn(4, 4, 3, 3, requires_grad=True)
    s_w = w.detach().abs().amax(dim=(1, 2, 3)) / 127
    cases = [dict(x_dynamic=True), dict(s_x=torch.tensor([0.05], requires_grad=True))]
    for kw in cases:
        s_x = kw.pop("s_x", torch.tensor([0.05]))
        with backends.use_backend("cpu_fused"):
            y = int_conv2d(x, w, None, s_x, torch.tensor([0.0]), s_w, padding=1, **kw)
        assert y.grad_fn.name() == "_IntConv2dEagerBackward"
    with backends.use_backend("reference"):
        y = int_conv2d(x, w, None, torch.tensor([0.05]), torch.tensor([0.0]), s_w, padding=1)
    assert y.grad_fn.name() == "_IntConv2dEagerBackward"
    xg, wg = torch.randn(1, 64, 8, 8), torch.randn(64, 1, 25, 25)  # 625 terms per group > 512
    with backends.use_backend("cpu_fused"):
        y = int_conv2d(xg.requires_grad_(), wg, None, torch.tensor([0.05]), torch.tensor([0.0]),
                       wg.abs().amax(dim=(1, 2, 3)) / 127, padding=12, groups=64)
    assert y.grad_fn.name() == "_IntConv2dEagerBackward"


def test_a_cnn_trains_the_same_through_the_conv_op():
    """A MobileNet-style inverted residual (ReLU6(inplace=True) after integer convs, a depthwise conv, BN
    folded) and a linear head through a few Adam steps: the same losses and weights, bit for bit."""
    def block():
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True),
            nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True),
            nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(8, 4))

    assert _trains_the_same(block, torch.randn(4, 3, 16, 16)) == 4 * 3  # 3 convs and the head, 3 steps
