"""The per-group (8da4w) training step as one C++ op (backend cpp_step, primitive grouped_step,
kernels/cpu/train_grouped.cpp) gives the Python path's bits and the reference's: output and the three gradients
compared with torch.equal, forward and backward; where it does not run, `explain` says why."""

import contextlib
import copy
import importlib
import os

import pytest
import torch

import intqat
from intqat.ops import backends, cpp_step, cpu_kernels
from intqat.ops.int_linear_grouped import int_linear_grouped

grouped_mod = importlib.import_module("intqat.ops.int_linear_grouped")  # (intqat.ops re-exports the function's name)

RUNS = cpp_step.unavailable_reason() is None and cpu_kernels.available() and cpu_kernels.grouped_vnni_available()
needs_cpp = pytest.mark.skipif(not RUNS, reason="these cases run the C++ grouped step on the per-group VNNI kernel "
                                                "(AVX512-VNNI build): not in this build (its avx2_int16 variant: the "
                                                "needs_avx2 tests)")


def _inputs(M, K, N, gs, given, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.1).requires_grad_()
    b = torch.randn(N, generator=g).requires_grad_()
    ws = w.detach().reshape(N, K // gs, gs).abs().amax(-1) / 7 * 0.8 if given else None  # some weights clip
    return x, w, b, ws


def _step(x, w, b, ws, **kw):
    y = int_linear_grouped(x, w, b, torch.tensor([0.05]), torch.tensor([-3.0]), ws, **kw)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return (y, *torch.autograd.grad(y, (x, w, b), g))


CASES = [  # (M, K, N, group size, dynamic activations, w_scale given)
    (32, 256, 768, 32, True, False),  # a Llama MLP layer at small batch: 8da4w
    (7, 64, 24, 32, True, True),
    (5, 128, 40, 16, False, True),  # static activations: the clip masks
    (1, 64, 33, 64, True, False),
    (64, 96, 48, 32, False, False),
]


@needs_cpp
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:4])) + ("-dyn" if c[4] else "-static")
                         + ("-scale" if c[5] else "-minmax"))
def test_grouped_step_equals_python_path_and_reference(case):
    M, K, N, gs, dyn, given = case
    x, w, b, ws = _inputs(M, K, N, gs, given, seed=M + K)
    kw = dict(group_size=gs, x_dynamic=dyn)
    if not dyn:
        kw.update(x_qmin=-128, x_qmax=127)
    with backends.recording() as ran:
        got = _step(x, w, b, ws, **kw)
    assert ran[("grouped_step", "cpp_step")] == 1, dict(ran)
    with cpp_step.disabled():
        python = _step(x, w, b, ws, **kw)
    with backends.use_backend("reference"):
        ref = _step(x, w, b, ws, **kw)
    for name, a, p, r in zip(("y", "grad_x", "grad_w", "grad_b"), got, python, ref):
        assert torch.equal(a, p), ("python path", name)
        assert torch.equal(a, r), ("reference", name)


AVX2_REASON = cpp_step.unavailable_reason() or backends.unavailable("avx2_int16")
needs_avx2 = pytest.mark.skipif(AVX2_REASON is not None, reason=f"the C++ step on avx2_int16: {AVX2_REASON}")
AVX2_CASES = CASES + [  # group sizes the VNNI kernel never takes (even, not a multiple of 4) and one past 16 pairs
    (6, 48, 20, 6, True, True),
    (3, 32, 17, 2, False, False),
    (13, 96, 50, 24, False, True),
]


@needs_avx2
@pytest.mark.parametrize("case", AVX2_CASES, ids=lambda c: "x".join(map(str, c[:4])) + ("-dyn" if c[4] else "-static")
                         + ("-scale" if c[5] else "-minmax"))
def test_grouped_step_on_avx2_int16_equals_python_path_and_reference(case):
    """CPUs without int8 dot products (AVX2 only: Zen 2 / 3): the table runs linear_grouped on avx2_int16, so the op's
    forward is int16_gemm.c's vpmaddwd kernel, its backward both fp32 GEMMs. Forced here (any AVX2 CPU runs that
    kernel); the op's weight pass is the two-pass one AVX2-only builds run. Integer outputs and gradients the bits."""
    M, K, N, gs, dyn, given = case
    x, w, b, ws = _inputs(M, K, N, gs, given, seed=M + K)
    kw = dict(group_size=gs, x_dynamic=dyn)
    if not dyn:
        kw.update(x_qmin=-128, x_qmax=127)
    with backends.use_backend("avx2_int16"), backends.recording() as ran:
        got = _step(x, w, b, ws, **kw)
    assert ran[("grouped_step", "cpp_step")] == 1 and ran[("linear_grouped", "avx2_int16")] == 1, dict(ran)
    with backends.use_backend("avx2_int16"), cpp_step.disabled(), backends.recording() as ran_py:
        python = _step(x, w, b, ws, **kw)
    assert ran_py[("grouped_step", "reference")] == 1 and ran_py[("linear_grouped", "avx2_int16")] == 1, dict(ran_py)
    # the backward's GEMMs as the Python path runs them: fp32 (an AVX2-only CPU never takes the digit GEMM; forcing
    # avx2_int16 on an int8-dot CPU leaves digit_matmul to its table, whose rule both paths follow)
    assert ran[("digit_matmul", "cpu_fused")] == ran_py[("digit_matmul", "cpu_fused")], (dict(ran), dict(ran_py))
    with backends.use_backend("reference"):
        ref = _step(x, w, b, ws, **kw)
    for name, a, p, r in zip(("y", "grad_x", "grad_w", "grad_b"), got, python, ref):
        assert torch.equal(a.view(torch.int32), p.view(torch.int32)), ("python path", name)
        assert torch.equal(a, r), ("reference", name)


@needs_avx2
def test_grouped_step_on_avx2_int16_refuses_an_odd_group_size():
    spec = grouped_mod.GroupedStep(grouped_mod.GroupedSpec(3, -127, 127, -7, 7, True, True), False, False, True, True)
    with backends.use_backend("avx2_int16"):
        text = backends.explain("grouped_step", shape=(8, 48, 16), spec=spec, file=open(os.devnull, "w"))
    assert "even group size" in text and "reference   RUNS IT" in text


@needs_cpp
def test_grouped_step_digit_backward_equals_python_path(monkeypatch):
    """grad_w as a digit GEMM on torch._int_mm (the C++ op's digit_matmul.h, shared with train_linear.cpp) against
    the Python path's digit GEMM on cpu_fused: the table's rule never takes it on this CPU class at these sizes, so
    both are made to: the Python side by its digits_pay, the C++ side through its run function."""
    M, K, N, gs = 96, 128, 64, 32
    x, w, b, _ = _inputs(M, K, N, gs, False)
    monkeypatch.setattr(grouped_mod, "digits_pay", lambda *a, grad="x": grad == "w")
    with cpp_step.disabled(), backends.use_backend("cpu_fused"), backends.recording() as ran:
        want = _step(x, w, b, None, group_size=gs)
    assert ran[("digit_matmul", "cpu_fused")] == 1
    y = cpp_step.run_grouped(True, x, w, b, None, 0.0, 0, gs, -127, 127, -7, 7, True, False)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    got = (y, *torch.autograd.grad(y, (x, w, b), g))
    for name, a, c in zip(("y", "grad_x", "grad_w", "grad_b"), got, want):
        assert torch.equal(a, c), name


@needs_cpp
def test_grouped_step_refusals_are_explained():
    x, w, b, ws = _inputs(8, 64, 16, 32, True)
    learned = ws.clone().requires_grad_()
    with backends.recording() as ran:
        int_linear_grouped(x, w, b, None, None, learned, group_size=32)
    assert ran[("grouped_step", "reference")] == 1
    spec = grouped_mod.GroupedStep(grouped_mod.GroupedSpec(32, -127, 127, -8, 7, True, True), False, False, True, True)
    text = backends.explain("grouped_step", shape=(8, 64, 16), spec=spec, file=open(os.devnull, "w"))
    assert "asymmetric range" in text and "reference   RUNS IT" in text
    spec = grouped_mod.GroupedStep(grouped_mod.GroupedSpec(2, -127, 127, -7, 7, True, True), False, False, True, True)
    text = backends.explain("grouped_step", shape=(8, 64, 16), spec=spec, file=open(os.devnull, "w"))
    assert "multiple of 4" in text
    spec = grouped_mod.GroupedStep(grouped_mod.GroupedSpec(32, -127, 127, -7, 7, True, True), False, True, True, True)
    text = backends.explain("grouped_step", shape=(8, 64, 16), spec=spec, file=open(os.devnull, "w"))
    assert "learned (LSQ)" in text


def _llama_block_trains_the_same_with_the_cpp_step(forced, kernel):
    """A small Llama block under 8da4w, three Adam steps: every parameter equal with and without the C++ ops."""
    from intqat.bench.blocks import make_llama_block

    torch.manual_seed(0)
    base = make_llama_block(64, 4, 2, 160, 10)
    x = torch.randn(2, 8, 64)
    y = torch.randint(0, 10, (2,))
    models = []
    for cpp in (True, False):
        m = copy.deepcopy(base)
        intqat.prepare_qat(m, "8da4w")
        intqat.to_integer(m)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        with (backends.use_backend(forced) if forced else contextlib.nullcontext()), \
                (backends.recording() if cpp else cpp_step.disabled()) as ran:
            for _ in range(3):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(x), y).backward()
                opt.step()
        if cpp:
            assert ran[("grouped_step", "cpp_step")] == 24, dict(ran)  # the block's seven layers and the head, 3 steps
            if kernel is not None:
                assert ran[("linear_grouped", kernel)] == 24, dict(ran)
        models.append(m)
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(p, q), name


@needs_cpp
def test_llama_block_trains_the_same_with_the_cpp_step():
    _llama_block_trains_the_same_with_the_cpp_step(None, None)


@needs_avx2
def test_llama_block_trains_the_same_with_the_cpp_step_on_avx2_int16():
    """The same on the no-int8-dot class's forward kernel (forced), fp32 backward GEMMs both ways."""
    _llama_block_trains_the_same_with_the_cpp_step("avx2_int16", "avx2_int16")


@needs_cpp
def test_grouped_step_under_gradient_checkpointing():
    """torch.utils.checkpoint recomputes the forward while the op's backward unpacks its saved tensors: that forward
    must record its graph as the first one did (the backward's aten calls skip the autograd kernels only after the
    unpack, train_common.h's BackwardDispatch). The same gradients as without checkpointing, bit for bit."""
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    intqat.prepare_qat(lin, "8da4w")
    lin.train()(torch.randn(8, 64))
    intqat.to_integer(lin)
    lin.train()
    ckpt = copy.deepcopy(lin)
    x = torch.randn(8, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with backends.recording() as ran:
        lin(xa).square().sum().backward()
        torch.utils.checkpoint.checkpoint(ckpt, xb, use_reentrant=False).square().sum().backward()
    assert ran[("grouped_step", "cpp_step")] == 6, dict(ran)  # two layers: forward, forward, recompute
    assert torch.equal(xa.grad, xb.grad)
    for p, q in zip(lin.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
