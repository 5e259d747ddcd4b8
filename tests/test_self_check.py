"""The definition does not lean on the kernels it checks, and a library GEMM is checked before it is trusted.

- the reference backend's integer GEMMs are exact int64 sums (no torch._int_mm, no fp32 library GEMM);
- the self-check's worst cases catch the kernel that is really wrong (a faithful model of oneDNN's pre-VNNI
  u8 x s8 path with saturating int16 pair sums), and pass exact ones;
- in a process whose torch._int_mm is wrong (ONEDNN_MAX_CPU_ISA=AVX2 on this VNNI CPU: oneDNN held below
  VNNI), intqat warns once, names the setting, refuses torch._int_mm in every backend and the C++ training
  ops, and its integer layers, int_mm, compiled graphs and the backend checks of tests/test_backends.py stay
  exact; exported programs still hold aten._int_mm, and the export report says they are not exact here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from intqat.ops import backends, check_int_mm, int_mm
from intqat.ops.backends import self_check
from intqat.ops.backends.exact import EXACT_K, MAX_K_INT32, exact_int_mm

TESTS = Path(__file__).resolve().parent


def _codes(*shape, seed=0):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def _saturating_u8s8(a, b):
    """oneDNN's GEMM below VNNI (AVX2 vpmaddubsw): a + 128 as u8 times b as s8, adjacent products of K summed in
    int16 with saturation, the pair sums added in int32, then 128 * colsum(b) taken off. Wrong where a pair sum
    leaves int16: codes of 127 in a (u8 255), not -128 (u8 0)."""
    M, K = a.shape
    u = a.to(torch.int64) + 128
    s = b.to(torch.int64)
    if K % 2:
        u = torch.cat([u, torch.zeros(M, 1, dtype=torch.int64)], 1)
        s = torch.cat([s, torch.zeros(1, s.shape[1], dtype=torch.int64)], 0)
    pairs = u[:, 0::2].unsqueeze(2) * s[0::2].unsqueeze(0) + u[:, 1::2].unsqueeze(2) * s[1::2].unsqueeze(0)
    acc = pairs.clamp(-(2**15), 2**15 - 1).sum(1)
    return (acc - 128 * s.sum(0)).to(torch.int32)


def test_the_reference_int_mm_is_int64_not_a_library_gemm():
    """Eager, the reference backend's int_mm runs aten.mm on int64 operands (aten's own loop): no aten._int_mm and
    no fp32 GEMM that the fast backends use. Seen by the profiler (which is no tracer: the table still sees eager)."""
    a, b = _codes(33, 300, seed=1), _codes(300, 17, seed=2)
    with backends.use_backend("reference"), torch.profiler.profile(record_shapes=True) as prof:
        got = int_mm(a, b)
    names = [e.name for e in prof.events()]
    assert "aten::_int_mm" not in names and "aten::mm" in names
    assert torch.equal(got, (a.to(torch.int64) @ b.to(torch.int64)).to(torch.int32))
    # past int32's bound the exact sum is still exact, and a result outside int32 an error
    K = MAX_K_INT32 + 5
    big = torch.full((1, K), -128, dtype=torch.int8)
    with pytest.raises(OverflowError, match="outside int32"):
        exact_int_mm(big, big.t())


def test_the_worst_cases_catch_a_saturating_kernel_and_pass_exact_ones():
    """The self-check's operands make the faithful model of the wrong kernel fail (the all-127 case above all), while
    random small codes would not always, and all -128 alone would not at all (u8 0); exact GEMMs pass."""
    reason = check_int_mm(_saturating_u8s8)
    assert reason is not None and "_saturating_u8s8" in reason and "entries of its self-check are wrong" in reason
    lone = torch.full((3, EXACT_K + 1), -128, dtype=torch.int8)
    assert torch.equal(_saturating_u8s8(lone, lone.t().contiguous()), exact_int_mm(lone, lone.t()))  # -128 alone: blind
    assert check_int_mm(exact_int_mm) is None
    assert check_int_mm(lambda a, b: (a.to(torch.float32) @ b.to(torch.float32)).to(torch.int32)) is None
    assert "wrong" in check_int_mm(lambda a, b: (a @ b).to(torch.int32))  # int8 @ int8 wraps
    assert "it raised on" in check_int_mm(lambda a, b: torch._int_mm(a.float(), b))  # reported, not raised


def test_check_int_mm_agrees_with_the_exact_sums_here():
    """check_int_mm() (what a consumer runs) is None exactly when this torch._int_mm gives the exact sums of
    random full-range codes; the self-check's verdict for the backends is the same."""
    a, b = _codes(64, 256, seed=3), _codes(256, 64, seed=4)
    exact_here = torch.equal(torch._int_mm(a, b), exact_int_mm(a, b))
    assert (check_int_mm() is None) == exact_here
    assert (self_check.untrusted("torch._int_mm") is None) == exact_here


def test_the_reason_names_the_settings_that_steer_the_kernels(monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    assert not any(s.startswith("ONEDNN_MAX_CPU_ISA") for s in self_check.settings_in_effect())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # read by oneDNN at start-up: naming it here changes no kernel
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in self_check.settings_in_effect()
    assert "set here: ONEDNN_MAX_CPU_ISA=AVX2" in check_int_mm(_saturating_u8s8)


def test_the_consumer_snippet_needs_only_torch():
    """docs/backends.md's check for the machine that runs an exported program: plain torch, no intqat import; it
    agrees with check_int_mm()."""
    doc = (TESTS.parent / "docs" / "backends.md").read_text()
    snippet = doc.split("<!-- consumer-check -->")[1].split("```python")[1].split("```")[0]
    assert "intqat" not in snippet
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("aten._int_mm is exact here" if check_int_mm() is None else "aten._int_mm is WRONG here")


_UNDER_A_WRONG_INT_MM = textwrap.dedent(r"""
    import json, os, warnings
    import torch
    from torch import nn

    FULL = os.environ["INTQAT_TEST_FULL"] == "1"  # also torch.compile and export (the second ISA: the layers only)


    def step(int_linear, **kw):
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(256, 1024, generator=g) * 2).requires_grad_()
        W = (torch.randn(1024, 1024, generator=g) * 0.05).requires_grad_()
        bias = torch.randn(1024, generator=g).requires_grad_()
        y = int_linear(x, W, bias, torch.tensor([0.02]), torch.tensor([3.0]), None, **kw)
        return (y.detach(), *torch.autograd.grad((y * torch.randn(256, 1024, generator=g)).sum(), [x, W, bias]))


    def layers(out):
        from intqat.ops import backends, cpp_step, int_linear, int_mm
        from intqat.ops.backends.exact import exact_int_mm
        from intqat.ops.int_conv2d import int_conv2d
        from intqat.ops.int_linear_grouped import int_linear_grouped

        g = torch.Generator().manual_seed(0)
        a = torch.randint(-128, 128, (64, 256), dtype=torch.int8, generator=g)
        b = torch.randint(-128, 128, (256, 64), dtype=torch.int8, generator=g)
        out["library_wrong"] = not torch.equal(torch._int_mm(a, b), exact_int_mm(a, b))
        with backends.recording() as ran:
            out["int_mm_exact"] = torch.equal(int_mm(a, b), exact_int_mm(a, b))
        out["int_mm_ran"] = sorted(name for (_, name) in ran)
        out["refusal"] = backends.get("cpu_fused").refuse("int_mm", (a, b), None, False)
        out["linear"] = {}
        # fp32 backward GEMMs in both runs: the reference backend never takes the digit backward (its slow rule),
        # so where digits pay here (AMX) the two runs would use two algorithms; the digit GEMM is checked below
        for case, kw in (("static", {}), ("dynamic", {"x_dynamic": True})):
            with backends.recording() as ran:
                got = step(int_linear, grad_gemm="fp32", **kw)
            with backends.use_backend("reference"):
                want = step(int_linear, grad_gemm="fp32", **kw)
            out["linear"][case] = {"exact": all(torch.equal(u, v) for u, v in zip(got, want)),
                                   "gemms": sorted({n for (p, n) in ran if p in ("linear", "digit_matmul")}),
                                   "step": sorted(n for (p, n) in ran if p == "linear_step")}
        from intqat.ops.digit_gemm import digit_matmul
        gd, qd = torch.randn(96, 512, generator=g), torch.randint(-128, 128, (512, 256), dtype=torch.int8, generator=g)
        sd = torch.rand(512, generator=g) + 0.5
        with backends.recording() as ran:
            got = digit_matmul(gd, sd, qd, 0)
        out["digit_ran"] = sorted(n for (p, n) in ran if p == "digit_matmul")
        out["digit_exact"] = torch.equal(got, backends.get("reference").digit_matmul(gd, sd, qd, 0, None))
        x = torch.randn(2, 16, 12, 12, generator=g)
        W = torch.randn(32, 16, 3, 3, generator=g) * 0.1
        sw = torch.rand(32, generator=g) * 0.01 + 1e-3
        conv = lambda: int_conv2d(x, W, None, torch.tensor([0.03]), torch.tensor([1.0]), sw, padding=1)
        with backends.recording() as ran:
            y = conv()
        out["conv_int_mm"] = sorted(n for (p, n) in ran if p == "int_mm")
        with backends.use_backend("reference"):
            out["conv_exact"] = torch.equal(y, conv())
        xg, Wg = torch.randn(8, 256, generator=g), torch.randn(48, 256, generator=g) * 0.05
        grouped = lambda: int_linear_grouped(xg, Wg, None, None, None, None, group_size=32, x_dynamic=True)
        yg = grouped()
        with backends.use_backend("reference"):
            out["grouped_exact"] = torch.equal(yg, grouped())
        out["cpp_step"] = cpp_step.unavailable_reason()


    def compiled_and_exported(out):
        import intqat
        from intqat.export import _integer_copy, export_mixed_precision
        from intqat.ops import backends

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        intqat.prepare_qat(model)
        xm = torch.randn(32, 64)
        model(xm)
        deployed, _ = _integer_copy(model)
        with torch.no_grad():
            with backends.use_backend("reference"):
                want = deployed(xm)
            out["compiled_exact"] = torch.equal(torch.compile(deployed)(xm), want)
            out["deployed_exact"] = torch.equal(deployed(xm), want)
        result = export_mixed_precision(model, (xm[:2],), calibration_data=[(xm,)])
        out["exported_int_mm"] = any("_int_mm" in str(n.target) for n in result.reference.graph.nodes)
        v = result.validation
        out["export"] = {k: v[k] for k in ("reference_equals_integer_model", "integer_program_exact", "int_mm_self_check")}


    out = {}
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        layers(out)
        if FULL:
            compiled_and_exported(out)
        from intqat.bench.timing import machine_lines
        from intqat.ops import check_int_mm

        out["check_int_mm"] = check_int_mm()
        out["bench_header"] = machine_lines()
    out["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("intqat: torch._int_mm")]
    out["export_warnings"] = [str(w.message) for w in caught if str(w.message).startswith("intqat export:")]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE"])
def test_integer_layers_stay_exact_when_torch_int_mm_is_not(isa):
    """oneDNN held below VNNI: torch._int_mm is wrong on a VNNI CPU (torch 2.13). Every intqat result stays exact
    (int_mm, a linear training step's output and gradients, conv, per-group linear; with AVX2 also a compiled
    deployed model), the refusal names the setting, one warning, the C++ training op runs the AVX2 int16 GEMM
    instead; exported programs keep aten._int_mm and the export report and a warning say they are not exact on
    this torch. On a CPU where the setting leaves torch._int_mm exact, the run must show no refusal, no warning."""
    full = isa == "AVX2"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "INTQAT_TEST_FULL": str(int(full))}
    r = subprocess.run([sys.executable, "-c", _UNDER_A_WRONG_INT_MM], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["int_mm_exact"] and out["conv_exact"] and out["grouped_exact"] and out["digit_exact"]
    assert all(case["exact"] for case in out["linear"].values()), out["linear"]
    assert out["cpp_step"] is None  # the C++ op still runs: on the int16 GEMM where _int_mm is refused
    if full:
        assert out["deployed_exact"] and out["compiled_exact"] and out["exported_int_mm"]
    if not out["library_wrong"]:
        assert out["refusal"] is None and not out["warnings"] and out["check_int_mm"] is None
        assert not full or out["export"]["integer_program_exact"] is True
        return
    assert len(out["warnings"]) == 1, out["warnings"]
    for text in (out["refusal"], out["warnings"][0], out["check_int_mm"]):
        assert f"ONEDNN_MAX_CPU_ISA={isa}" in text and "torch._int_mm" in text, text
    no_int_mm = "avx2_int16" if backends.unavailable("avx2_int16") is None else "fp32_exact"
    assert out["int_mm_ran"] == [no_int_mm] and out["conv_int_mm"] == [no_int_mm]
    # the linear layer's forward GEMM: intqat's AMX kernel where the CPU has AMX (no library GEMM in it), else the
    # int16 one; either inside the C++ step; the digit GEMM: AMX's, else the next backend that implements it
    amx = backends.unavailable("amx") is None
    linear_gemm = "amx" if amx else no_int_mm
    for case in out["linear"].values():
        assert case["gemms"] == [linear_gemm], case
        assert case["step"] == (["cpp_step"] if linear_gemm in ("avx2_int16", "amx") else ["reference"]), case
    assert len(out["digit_ran"]) == 1 and out["digit_ran"] != ["cpu_fused"], out["digit_ran"]  # (the refused one)
    assert not amx or out["digit_ran"] == ["amx"], out["digit_ran"]
    assert any(line.startswith("SELF-CHECK REFUSED torch._int_mm") for line in out["bench_header"]), out["bench_header"]
    if full:
        assert out["export"]["integer_program_exact"] is False and out["export"]["reference_equals_integer_model"] is False
        assert f"ONEDNN_MAX_CPU_ISA={isa}" in out["export"]["int_mm_self_check"] and len(out["export_warnings"]) == 1


def test_the_backend_checks_pass_when_torch_int_mm_is_wrong():
    """tests/test_backends.py's checks (every backend against the definition) in a process with
    ONEDNN_MAX_CPU_ISA=AVX2: the backends that call torch._int_mm are refused there, and the tests assert that the
    next backend ran and equals the reference bit for bit. (Triton's interpreter and the tests that start their
    own subprocesses are left out: they call no library GEMM of their own.)"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "test_backends.py"),
                        "-k", "not avx2_only_build and not triton and not emulating"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
    # the run's summary (conftest.py) says what the self-check refused, naming the setting
    line = next(line for line in r.stdout.splitlines() if line.strip().startswith("torch._int_mm "))
    assert "exact on its worst cases" in line or ("REFUSED" in line and "ONEDNN_MAX_CPU_ISA=AVX2" in line), line


def test_the_export_report_compares_the_program_with_the_definition():
    """export_mixed_precision's validation runs the integer program on the validation batches against the definition
    (the deployed model on the reference backend: int64 sums) and records this torch's aten._int_mm verdict."""
    import intqat
    from torch import nn

    from intqat.export import export_mixed_precision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10))
    intqat.prepare_qat(model)
    x = torch.randn(48, 64)
    model(x)
    result = export_mixed_precision(model, (x[:2],), calibration_data=[(x[:16],)], validation_data=[(x[16:],)])
    v = result.validation
    exact_here = check_int_mm() is None
    assert v["integer_program_exact"] is exact_here and v["reference_equals_integer_model"] is exact_here
    assert v["int_mm_self_check"] == ("exact" if exact_here else check_int_mm())
    md = result.to_markdown()
    assert f"| integer_program_exact | {exact_here} |" in md and "| int_mm_self_check |" in md
