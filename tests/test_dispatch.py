"""The backend table is the only dispatcher: the C++ training steps are a backend, the digit backward's rule is
the digit backends' `slow`, no backend falls back inside its methods (so `recording()` names what really ran),
and `explain` says every backend's verdict and why."""

from __future__ import annotations

import io

import pytest
import torch

from intqat.ops import backends, cpp_step, cpu_kernels, explain, int_linear
from intqat.ops.cpu_features import cpu_has_int8_dot
from intqat.ops.digit_gemm import digit_matmul, digits_pay
from intqat.ops.int_linear import LinearSpec, LinearStep


def _spec(learned=False, finite=True):
    """int_linear's step facts for a static w8a8 layer with a min-max weight scale (what int_linear builds)."""
    return LinearStep(LinearSpec(-128, 127, -127, 127, False, True, True, "int8x3"), False, learned, True, finite)


def _codes(*shape, lo=-128, hi=128, seed=0):
    return torch.randint(lo, hi, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def _needs(*names):
    for name in names:
        reason = backends.unavailable(name)
        if reason is not None:
            pytest.skip(f"backend {name} cannot run here: {reason}")


def _step_args(M=32, K=64, N=16, learned=False, nan=False):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(M, K, generator=g, requires_grad=True), torch.randn(N, K, generator=g, requires_grad=True)
    s_x = torch.tensor([float("nan") if nan else 0.02], requires_grad=learned)
    return x, w, s_x, torch.tensor([3.0])


def _linear_step_verdict(x, w, s_x, z_x) -> str:
    """explain's line for cpp_step on int_linear's step with these operands (what int_linear asks the table)."""
    float_s = float(s_x)
    spec = _spec(s_x.requires_grad, float_s == float_s)
    text = explain("linear_step", x, w, None, s_x, z_x, None, shape=(x.shape[0], x.shape[1], w.shape[0]), spec=spec,
                   file=io.StringIO())
    return next(line for line in text.splitlines() if line.strip().startswith("cpp_step"))


def test_the_cpp_step_is_a_backend_and_says_why_it_refuses():
    """Learned scales, a NaN scale, a forced backend whose kernels the op does not call, the off switch: each a
    refusal with its reason, and the step then runs on the reference (the Python path), as recording() says."""
    _needs("cpp_step", "cpu_fused")
    x, w, s_x, z_x = _step_args()
    assert "RUNS IT" in _linear_step_verdict(x, w, s_x, z_x)
    assert "learned (LSQ)" in _linear_step_verdict(*_step_args(learned=True))
    assert "NaN" in _linear_step_verdict(*_step_args(nan=True))
    with backends.use_backend("fp32_exact"):
        assert "the table runs linear on fp32_exact (forced)" in _linear_step_verdict(x, w, s_x, z_x)
    with cpp_step.disabled():
        assert "disabled" in _linear_step_verdict(x, w, s_x, z_x)
    for learned, nan, step in ((False, False, "cpp_step"), (True, False, "reference"), (False, True, "reference")):
        x, w, s_x, z_x = _step_args(learned=learned, nan=nan)
        with backends.recording() as ran:
            int_linear(x, w, None, s_x, z_x, None)
        assert ran[("linear_step", step)] == 1, (learned, nan, ran)


def test_tracing_takes_the_reference_step_and_the_custom_op():
    x, w, s_x, z_x = _step_args()
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x, w: int_linear(x, w, None, s_x, z_x, None))(x, w)
    assert "intqat.int_linear" in str(gm.graph)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:  # what export's tracer hands int_linear
        fx, fw, fs, fz = (mode.from_tensor(t) for t in (x, w, s_x, z_x))
    text = explain("linear_step", fx, fw, None, fs, fz, None, shape=(32, 64, 16), file=io.StringIO(),
                   spec=_spec())
    assert "cpp_step    refuses: not while tracing" in text and "reference   RUNS IT" in text


def test_explain_lists_every_backend_with_its_verdict():
    _needs("cpu_fused")
    q_x, q_w = _codes(256, 1024), _codes(1024, 1024, lo=-127)
    s_x, s_w = torch.tensor([[0.02]]), torch.rand(1024) * 0.01
    out = io.StringIO()
    text = explain("linear", q_x, q_w, s_x, s_w, None, None, shape=(256, 1024, 1024), file=out)
    assert out.getvalue().strip() == text
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(backends.names())
    chosen = backends.select("linear", q_x, q_w, s_x, s_w, None, None, shape=(256, 1024, 1024), record=False).name
    assert sum("RUNS IT" in line for line in lines) == 1 and any(line.split()[0] == chosen and "RUNS IT" in line
                                                                 for line in lines)
    assert any(line.split()[0] == "cpp_step" and "does not implement it" in line for line in lines)
    with backends.use_backend("reference"):
        assert "reference   RUNS IT (forced)" in explain("linear", q_x, q_w, shape=(256, 1024, 1024), file=io.StringIO())


def test_explain_of_a_step_without_its_spec_says_what_to_pass():
    """The steps' verdicts read their options: without spec= explain names the type to pass and how to see which
    backend ran a layer, instead of an AttributeError from inside a backend."""
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    for primitive, spec_type in (("linear_step", "LinearStep"), ("grouped_step", "GroupedStep"),
                                 ("conv_step", "ConvStep")):
        with pytest.raises(ValueError, match=f"explain\\('{primitive}'.*needs spec=.*{spec_type}.*recording"):
            explain(primitive, x, w, file=io.StringIO())


def test_the_digit_backward_rule_is_the_digit_backends_slow():
    """digits_pay asks the table: the backend that would run digit_matmul, and its slow() for the layer; explain at
    that shape shows the reason of each backend that does not pay."""
    _needs("cpu_fused")
    b = backends.select("digit_matmul", record=False, at_run_time=True)
    for shape in ((256, 1024, 1024), (64, 128, 128), (32, 1024, 1024)):
        for grad in ("x", "w"):
            assert digits_pay(*shape, grad=grad) == (b.slow("digit_matmul", shape, grad) is None)
    text = explain("digit_matmul", shape=(64, 128, 128), spec="x", at_run_time=True, file=io.StringIO())
    assert ("M*N*K < 2^21" if cpu_has_int8_dot() else "no int8 dot-product units") in text
    with backends.use_backend("reference"):  # the torch twin never pays: the backward keeps its fp32 GEMMs
        assert not digits_pay(256, 1024, 1024)
    with backends.use_backend("fp32_exact"):
        assert not digits_pay(256, 1024, 1024)


def test_no_backend_falls_back_inside_its_methods():
    """Calls a backend's kernels cannot take are refused, so what recording() names is what ran: a per-group layer
    whose group size the VNNI kernel cannot take, a digit GEMM on column-major codes, an empty product."""
    _needs("cpu_fused")
    q_x, q_w = _codes(4, 45), _codes(9, 45, lo=-7, hi=8)
    s_w, s_x = torch.rand(9, 3) * 0.01 + 1e-3, torch.rand(4, 1) * 0.05
    with backends.use_backend("cpu_fused"), backends.recording() as ran:
        b = backends.select("linear_grouped", q_x, q_w, s_w, s_x)
        b.linear_grouped(q_x, q_w, s_w, None, s_x, None)
    assert b.name != "cpu_fused" and ran[("linear_grouped", b.name)] == 1
    # (an AVX2-only build has no per-group VNNI kernel at all: that is the reason it gives first)
    assert ("group size" if cpu_kernels.grouped_vnni_available() else "without AVX512-VNNI") in \
        backends.get("cpu_fused").refuse("linear_grouped", (q_x, q_w, s_w, s_x), None, False)

    a, col, q = torch.randn(8, 40), torch.rand(40) + 0.5, _codes(24, 40).t()  # q (40, 24) column-major
    with backends.use_backend("cpu_fused"), backends.recording() as ran:
        got = digit_matmul(a, col, q, 0)
    assert ran[("digit_matmul", "cpu_fused")] == 0 and sum(ran.values()) == 1
    with backends.use_backend("reference"):
        assert torch.equal(got, digit_matmul(a, col, q, 0))

    with backends.use_backend("avx2_int16") if backends.unavailable("avx2_int16") is None else backends.recording():
        with backends.recording() as ran:
            out = backends.select("int_mm", _codes(0, 5), _codes(5, 3)).int_mm(_codes(0, 5), _codes(5, 3))
    assert out.shape == (0, 3) and ran[("int_mm", "avx2_int16")] == 0


def test_recording_counts_the_cpp_step_and_what_it_ran():
    _needs("cpp_step", "cpu_fused")
    shape = (256, 1024, 1024)
    if backends.select("linear", shape=shape, record=False, at_run_time=True).name == "amx":
        shape = (48, 512, 512)  # (AMX CPUs: a large layer's forward is the AMX kernel's, which the C++ op does not call)
    x, w, s_x, z_x = _step_args(*shape)
    with backends.recording() as ran:
        int_linear(x, w, None, s_x, z_x, None).sum().backward()
    assert ran[("linear_step", "cpp_step")] == 1
    linear = backends.select("linear", shape=shape, record=False, at_run_time=True).name
    assert ran[("linear", linear)] == 1
    assert (ran[("digit_matmul", "cpu_fused")] == 1) == digits_pay(*shape, grad="x")
