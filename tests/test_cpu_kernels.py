"""The fused CPU kernels (kernels/cpu/fused.c) against the torch reference path, bit for bit.

Every public function that can take the fused path is run twice, with `cpu_kernels.disabled()`
and without, and the results must be equal (torch.equal), gradients included.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from intqat.nn.quantizers import WeightQuantizer
from intqat.config import PRESETS
from intqat.ops import backends, cpu_kernels, dequantize, int_linear, quantize, quantize_with_mask
from intqat.ops.int_linear import (
    _int_linear_op,
    integer_epilogue,
    minmax_weight_scale,
    quantize_activation,
    quantize_weight,
    rounded_zero_point,
)
from intqat.ops.qparams import SCALE_EPS


def both(fn):
    """(fused result, reference result)."""
    fused = fn()
    with backends.use_backend("reference"):
        ref = fn()
    return fused, ref


def assert_same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    elif a is None or b is None:
        assert a is None and b is None
    else:
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        assert torch.equal(a, b)


def test_kernels_are_built_here():
    # the comparisons below are vacuous without the library: on this machine it must build
    assert cpu_kernels.available()
    assert backends.select("quantize_rows", torch.ones(2), record=False).name == "cpu_fused"
    with cpu_kernels.disabled():  # the kernels off (as without a compiler): the table falls through
        assert backends.select("quantize_rows", torch.ones(2), record=False).name == "reference"


SHAPES = [(1, 1), (1, 7), (5, 1), (33, 65), (128, 257), (0, 4), (3, 0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qmin,qmax", [(-128, 127), (-127, 127), (-8, 7), (0, 127)])
def test_quantize_per_tensor_with_mask(shape, qmin, qmax):
    g = torch.Generator().manual_seed(hash((shape, qmin)) % 1000)
    x = torch.randn(shape, generator=g) * 4
    s, z = torch.tensor(0.031), torch.tensor(3)
    assert_same(*both(lambda: quantize(x, s, z, qmin, qmax)))
    assert_same(*both(lambda: quantize_with_mask(x, s, z, qmin, qmax)))


@pytest.mark.parametrize("shape", [(7, 33), (16, 3, 3, 3), (1, 5), (4, 1, 1, 1)])
def test_quantize_and_dequantize_per_channel(shape):
    x = torch.randn(shape) * 2
    s = torch.rand(shape[0]) * 0.05 + 1e-3
    assert_same(*both(lambda: quantize(x, s, 0, -127, 127, axis=0)))
    assert_same(*both(lambda: quantize_with_mask(x, s, 0, -127, 127, axis=0)))
    q = quantize(x, s, 0, -127, 127, axis=0)
    assert_same(*both(lambda: dequantize(q, s, 0, axis=0)))
    assert_same(*both(lambda: dequantize(q, s[0], torch.tensor(-2))))


def test_ties_round_half_to_even_and_clip_mask_like_torch():
    s = torch.tensor(0.5)
    # x / s = k + 0.5 exactly: nearbyint picks the even neighbour; 63.75 / 0.5 = 127.5 rounds to
    # 128 and clips, like the values beyond it
    x = torch.tensor([0.25, 0.75, 1.25, -0.25, -0.75, -1.25, 63.25, 63.75, 64.0, 70.0, -70.0])
    q, mask = quantize_with_mask(x, s, 0, -127, 127)
    assert q.tolist() == [0, 2, 2, 0, -2, -2, 126, 127, 127, 127, -127]
    assert mask.tolist() == [True] * 7 + [False] * 4
    ref = torch.fake_quantize_per_tensor_affine(x, 0.5, 0, -127, 127)
    assert torch.equal(dequantize(q, s, 0), ref)


def test_non_contiguous_input():
    x = torch.randn(40, 24).t()  # (24, 40), column-major
    s = torch.rand(24) * 0.05 + 1e-3
    assert_same(*both(lambda: quantize_with_mask(x, s, 0, -127, 127, axis=0)))


@pytest.mark.parametrize("M,K", [(1, 1), (9, 70), (64, 1024), (0, 8)])
def test_dynamic_activation_quantize(M, K):
    x = torch.randn(M, K) * 3
    if M > 1:
        x[1] = 0.0  # an all-zero row: scale eps
    z0 = torch.zeros(1, dtype=torch.int32)
    assert_same(*both(lambda: quantize_activation(x, None, z0, -127, 127, True, False)))


@pytest.mark.parametrize("x_dynamic", [False, True])
def test_static_activation_quantize(x_dynamic):
    x = torch.randn(31, 45)
    z = rounded_zero_point(torch.tensor([4.4]), -128, 127)
    assert_same(*both(lambda: quantize_activation(x, torch.tensor([0.02]), z, -128, 127, x_dynamic, True)))


@pytest.mark.parametrize("N,K", [(1, 1), (24, 80), (256, 513)])
def test_weight_quantize_with_and_without_a_given_scale(N, K):
    W = torch.randn(N, K) * 0.1
    W[0] = 0.0  # all-zero output channel
    spec = PRESETS["w8a8"].weight
    s = WeightQuantizer(spec, W).minmax_scale(W)
    # the op's own min-max scale is WeightQuantizer's, bit for bit, on both paths
    for scale in (None, s * 0.7):
        fused, ref = both(lambda: quantize_weight(W, scale, -127, 127, need_mask=True, need_colsum=True))
        assert_same(fused[0], ref[0])
        assert_same(fused[2], ref[2])
        assert_same(fused[3].reshape(-1), ref[3].reshape(-1))
        if scale is None:
            assert torch.equal(fused[3].reshape(-1), s) and torch.equal(minmax_weight_scale(W, 127), s)
            assert bool(fused[1].all()) and bool(ref[1].all())  # a min-max scale clips nothing
        else:
            assert_same(fused[1], ref[1])
    assert torch.equal(ref[2], ref[0].long().sum(1).int())


@pytest.mark.parametrize("z,per_row,bias", [(3, False, True), (0, True, False), (-7, False, False)])
def test_integer_epilogue(z, per_row, bias):
    M, N = 17, 29
    acc = torch.randint(-(2**20), 2**20, (M, N), dtype=torch.int32)
    colsum = torch.randint(-5000, 5000, (N,), dtype=torch.int32)
    s_x = torch.rand(M, 1) * 0.1 if per_row else torch.tensor([[0.037]])
    s_w = torch.rand(N) * 0.01
    b = torch.randn(N) if bias else None
    z_x = None if z == 0 else torch.tensor([z], dtype=torch.int32)
    assert_same(*both(lambda: integer_epilogue(acc, z_x, colsum, s_x, s_w, b)))


def _linear_problem(learn, dynamic):
    torch.manual_seed(7)
    x = (torch.randn(37, 70) * 1.5 + 0.2).requires_grad_()
    W = (torch.randn(23, 70) * 0.1).requires_grad_()
    b = torch.randn(23).requires_grad_()
    s_x = torch.tensor([0.02], requires_grad=learn)
    z_x = torch.tensor([3.0], requires_grad=learn)
    s_w = (W.detach().abs().amax(1) / 127 * 0.8).requires_grad_(learn)
    return x, W, b, s_x, z_x, s_w


@pytest.mark.parametrize("learn", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("minmax_w", [False, True])
def test_int_linear_forward_and_gradients_match_the_torch_path(learn, dynamic, minmax_w):
    x, W, b, s_x, z_x, s_w = _linear_problem(learn, dynamic)
    w_scale = None if minmax_w else s_w
    inputs = [t for t in (x, W, b, s_x, z_x, s_w) if t.requires_grad]

    def run():
        y = int_linear(x, W, b, s_x, z_x, w_scale, x_dynamic=dynamic)
        g = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        return (y.detach(), *torch.autograd.grad(y, inputs, g, allow_unused=True))

    fused, ref = both(run)
    for a, r in zip(fused, ref):
        assert (a is None) == (r is None)
        if a is not None:
            assert torch.equal(a, r)


@pytest.mark.parametrize("minmax_w", [False, True])
def test_eager_function_equals_the_custom_op(minmax_w):
    # eager calls go through an autograd.Function; tracers see the custom op: same numbers
    x, W, b, s_x, z_x, s_w = _linear_problem(learn=True, dynamic=False)
    w_scale = None if minmax_w else s_w
    inputs = [x, W, b, s_x, z_x] + ([] if minmax_w else [s_w])
    g = torch.randn(37, 23)
    y = int_linear(x, W, b, s_x, z_x, w_scale)
    grads = torch.autograd.grad(y, inputs, g)
    y_op = _int_linear_op(x, W, b, s_x, z_x, w_scale, -128, 127, -127, 127, False, True, True)[0]
    grads_op = torch.autograd.grad(y_op, inputs, g)
    assert torch.equal(y, y_op)
    for a, r in zip(grads, grads_op):
        assert torch.equal(a, r)


def test_scratch_buffers_never_leak_into_results():
    # the accumulator and the backward's dequantized operands live in reused buffers
    W = torch.randn(16, 32, requires_grad=True)
    x1, x2 = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32) * 5
    y1 = int_linear(x1, W, None, torch.tensor([0.05]), torch.tensor([0.0]), None)
    kept = y1.detach().clone()
    y2 = int_linear(x2, W, None, torch.tensor([0.2]), torch.tensor([1.0]), None)
    assert torch.equal(y1.detach(), kept) and not torch.equal(y2, y1)
    (g1,) = torch.autograd.grad(y1.sum(), [W])
    (g1_again,) = torch.autograd.grad(int_linear(x1, W, None, torch.tensor([0.05]), torch.tensor([0.0]), None).sum(), [W])
    assert torch.equal(g1, g1_again)


def _run_isolated(code: str, env: dict) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=120)


CHECK = """
    import warnings, torch
    warnings.simplefilter("always")
    from intqat.ops import cpu_kernels, int_linear
    x, W = torch.randn(4, 8), torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        y = int_linear(x, W, None, torch.tensor([0.05]), torch.tensor([0.0]), None)
    print("available", cpu_kernels.available())
    print("warnings", [str(w.message)[:60] for w in caught])
    print("shape", tuple(y.shape))
"""


def test_without_a_compiler_the_torch_path_runs_with_a_warning(tmp_path):
    r = _run_isolated(CHECK, {"CC": "/nonexistent/cc", "INTQAT_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout and "fused CPU kernels unavailable" in r.stdout
    assert "shape (4, 3)" in r.stdout
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob(".fused-*"))  # no half-written file


def test_switched_off_by_environment_silently(tmp_path):
    r = _run_isolated(CHECK, {"INTQAT_CPU_KERNELS": "0", "INTQAT_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout and "warnings []" in r.stdout


def test_built_once_into_the_cache(tmp_path):
    # a compiler wrapper that logs each call: the second process must load the cached library.
    # INTQAT_CPP_STEP=0: the C++ training ops (a ~25 s build of their own, keyed on this cache's path) are not
    # what is checked here; tests/test_cpp_step.py builds and checks them.
    log = tmp_path / "cc.log"
    spy = tmp_path / "cc-spy"
    spy.write_text(f'#!/bin/sh\necho called >> "{log}"\nexec cc "$@"\n')
    spy.chmod(0o755)
    env = {"INTQAT_CACHE_DIR": str(tmp_path / "cache"), "CC": str(spy), "INTQAT_CPP_STEP": "0"}
    r = _run_isolated(CHECK, env)
    assert r.returncode == 0 and "available True" in r.stdout, r.stdout + r.stderr
    (lib,) = (tmp_path / "cache").glob("fused-*.so")
    stamp = lib.stat().st_mtime_ns
    r = _run_isolated(CHECK, env)
    assert "available True" in r.stdout and "warnings []" in r.stdout, r.stdout + r.stderr
    assert log.read_text().count("called") == 1
    assert lib.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("axis,shape", [(None, (33, 47)), (0, (12, 3, 3, 3)), (0, (5, 64))])
def test_fake_quantize_matches_torch_and_the_torch_path(axis, shape):
    from intqat.ops.quant import fake_quantize_with_mask

    x = torch.randn(shape) * 2
    if axis is None:
        s, z = torch.tensor(0.013), torch.tensor(-5)
        ref = torch.fake_quantize_per_tensor_affine(x, 0.013, -5, -128, 127)
    else:
        s, z = torch.rand(shape[0]) * 0.05 + 1e-3, torch.tensor(0)
        ref = torch.fake_quantize_per_channel_affine(x, s, torch.zeros(shape[0], dtype=torch.int32), 0, -127, 127)
    qmin = -128 if axis is None else -127
    fused, mine_ref = both(lambda: fake_quantize_with_mask(x, s, z, qmin, 127, axis))
    assert_same(fused, mine_ref)
    assert torch.equal(fused[0], ref)


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_dynamic", "w8a8_lsq", "w4a8"])
def test_fake_quant_linear_step_matches_the_torch_path(preset):
    from intqat import prepare_qat

    def run():
        torch.manual_seed(3)
        model = prepare_qat(torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), preset)
        x = torch.randn(32, 20)
        out = model(x)
        out.square().sum().backward()
        return (out.detach(), *[p.grad for p in model.parameters() if p.grad is not None])

    assert_same(*both(run))


@pytest.mark.parametrize("dynamic,learn", [(False, False), (True, False), (False, True)])
def test_int_conv2d_forward_and_gradients_match_the_torch_path(dynamic, learn):
    from intqat.ops.int_conv2d import int_conv2d

    torch.manual_seed(5)
    x = (torch.randn(2, 4, 9, 9) + 0.3).requires_grad_()
    W = (torch.randn(6, 4, 3, 3) * 0.2).requires_grad_()
    b = torch.randn(6).requires_grad_()
    s_x = torch.tensor([0.015], requires_grad=learn)
    z_x = torch.tensor([2.0], requires_grad=learn)
    s_w = (W.detach().abs().amax(dim=(1, 2, 3)) / 127 * 0.9).requires_grad_(learn)
    inputs = [t for t in (x, W, b, s_x, z_x, s_w) if t.requires_grad]

    def run():
        y = int_conv2d(x, W, b, s_x, z_x, s_w, padding=1, stride=2, x_dynamic=dynamic)
        g = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        return (y.detach(), *torch.autograd.grad(y, inputs, g))

    assert_same(*both(run))


def test_tracers_see_the_torch_path():
    # make_fx records aten calls; a C call would be invisible to it and the graph would be wrong
    from torch.fx.experimental.proxy_tensor import make_fx

    x, s = torch.randn(6, 10) * 3, torch.tensor(0.05)
    gm = make_fx(lambda t: quantize(t, s, 0, -127, 127))(x)
    assert any(n.op == "call_function" for n in gm.graph.nodes)
    assert torch.equal(gm(x), quantize(x, s, 0, -127, 127))
    # vmap: batched tensors pass for plain ones by type, so the transform check must catch them
    y = torch.vmap(lambda t: quantize(t, s, 0, -127, 127))(x)
    assert torch.equal(y, quantize(x, s, 0, -127, 127))
