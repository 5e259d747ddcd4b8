"""Every backend against the reference, bit for bit, on whatever CPU runs the tests.

For each backend that can run here (forced with `use_backend`, slow or not on this CPU), each
primitive it implements is compared with the plain-torch reference: int32 accumulators and codes
with torch.equal, float outputs with torch.equal (the same float32 operations in the same order),
Triton's epilogue within 1 ulp (FMA). A backend this machine cannot run is skipped with its reason,
and the session summary (conftest.py) lists it, so a green run says what it did not check.
"""

from __future__ import annotations

import pytest
import torch

from intqat.ops import MAX_K_INT32, backends, int_linear, int_mm
from intqat.ops.backends import EXACT_K

CPU_BACKENDS = ["amx", "cpu_fused", "avx2_int16", "fp32_exact", "triton"]


def _runs_here(name):
    reason = backends.unavailable(name)
    if reason is not None:
        pytest.skip(f"backend {name} cannot run here: {reason}")


def _codes(*shape, lo=-128, hi=128, seed=0):
    return torch.randint(lo, hi, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def _reference(fn, *args):
    """fn under the reference backend: the definition, whose integer GEMMs are exact int64 sums (no library kernel)."""
    with backends.use_backend("reference"):
        return fn(*args)


def _runs_as(name, primitive, *tensors, shape=None, why="self-check"):
    """The backend that runs `primitive` while `name` is forced: `name`, unless it refuses the call (`why`: what
    the reason must say; by default only the self-check of a library GEMM it calls may refuse, as in a process
    with ONEDNN_MAX_CPU_ISA=AVX2, where tests/test_self_check.py runs this file): then the table's next choice."""
    reason = backends.get(name).refuse(primitive, tensors, shape, False)
    if reason is None:
        return name
    assert why is None or why in reason, reason
    return backends.select(primitive, *tensors, shape=shape, record=False).name


MM_SHAPES = [(1, 1, 1), (7, 33, 5), (64, EXACT_K, 48), (17, EXACT_K + 1, 9), (5, 3 * EXACT_K + 7, 6)]
SMALL = 2**16  # the Triton interpreter is slow: it gets the small shapes only


def _cases(names, shapes):
    return [(n, *shape) for n in names for shape in shapes if n != "triton" or shape[0] * shape[1] * shape[2] <= SMALL]


@pytest.mark.parametrize("name,M,K,N", _cases(["cpu_fused", "avx2_int16", "fp32_exact", "triton"], MM_SHAPES))
def test_int_mm_equals_the_reference(name, M, K, N):
    _runs_here(name)
    a, b = _codes(M, K, seed=1), _codes(N, K, seed=2).t()  # b a transposed view: any strides
    with backends.use_backend(name), backends.recording() as ran:
        got = int_mm(a, b)
        ran_as = _runs_as(name, "int_mm", a, b)
    assert ran[("int_mm", ran_as)] == 1  # the backend really ran (or the one the self-check left)
    assert torch.equal(got, _reference(int_mm, a, b))


def test_fp32_exact_is_exact_at_the_worst_case_of_each_slice():
    """All codes -128: every partial sum is -2^14 k; a slice of EXACT_K sums to exactly -2^24, the
    largest magnitude fp32 still holds exactly; one more element per slice and fp32 would round."""
    for K in (EXACT_K, EXACT_K + 1, 2 * EXACT_K, 5 * EXACT_K + 3):
        a = torch.full((3, K), -128, dtype=torch.int8)
        b = torch.full((K, 2), -128, dtype=torch.int8)
        with backends.use_backend("fp32_exact"):
            got = int_mm(a, b)
        assert torch.equal(got, torch.full((3, 2), 2**14 * K, dtype=torch.int32)), K


@pytest.mark.parametrize("name", ["reference", "cpu_fused", "avx2_int16", "fp32_exact", "triton"])
def test_the_int32_edge_is_exact_or_a_clear_error(name):
    """K * 2^14 <= 2^31 - 1 is int32's bound: K = 131071 all -128 fits exactly; at 131072 the exact sum
    2^31 is one past int32's maximum, and 131073 beyond it: int_mm raises, never wraps."""
    _runs_here(name)
    assert MAX_K_INT32 == 131071
    # Triton's interpreter takes ~4 s per K here: 131073 takes 131072's path (split, then the int32 check)
    for K in (131071, 131072) if name == "triton" else (131071, 131072, 131073):
        a = torch.full((1, K), -128, dtype=torch.int8)
        b = torch.full((K, 1), -128, dtype=torch.int8)
        with backends.use_backend(name):
            if K * 2**14 <= 2**31 - 1:
                assert int(int_mm(a, b)) == K * 2**14
            else:
                with pytest.raises(OverflowError, match=r"outside int32"):
                    int_mm(a, b)


def test_int_linear_at_the_int32_edge():
    """The same edge through int_linear: codes -128 x -128 (x at its scale's qmin, W at w_qmin = -128)."""
    for K, fits in ((131071, True), (131072, False)):
        x = torch.full((1, K), -1.0)
        W = torch.full((1, K), -1.0)
        args = (x, W, None, torch.tensor([1 / 128]), torch.tensor([0.0]), torch.tensor([1 / 128]))
        if fits:
            y = int_linear(*args, w_qmin=-128)
            assert y.item() == float(K * 2**14) / 128 / 128
        else:
            with pytest.raises(OverflowError, match="outside int32"):
                int_linear(*args, w_qmin=-128)


def _linear_problem(M, K, N, z=3, per_row=False, bias=True, seed=0):
    q_x, q_w = _codes(M, K, seed=seed), _codes(N, K, lo=-127, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    s_x = torch.rand(M if per_row else 1, 1, generator=g) * 0.1 + 0.01
    s_w = torch.rand(N, generator=g) * 0.01 + 0.001
    colsum = q_w.to(torch.int32).sum(1, dtype=torch.int32)
    return (q_x, q_w, None if per_row else torch.tensor([z], dtype=torch.int32), colsum, s_x, s_w,
            torch.randn(N, generator=g) if bias else None)


def _linear(q_x, q_w, z_x, colsum, s_x, s_w, bias):
    shape = (q_x.shape[0], q_x.shape[1], q_w.shape[0])  # the tensors as integer_linear passes them
    return backends.select("linear", q_x, q_w, s_x, s_w, bias, colsum, shape=shape).linear(q_x, q_w, z_x, colsum, s_x,
                                                                                          s_w, bias)


LINEAR_CASES = [(1, 16, 8, False, True), (33, 200, 70, True, False), (256, 1024, 1024, False, True),
                (64, 3000, 96, False, True)]


@pytest.mark.parametrize("name,M,K,N,per_row,bias",
                         [(n, *c) for n in CPU_BACKENDS for c in LINEAR_CASES if n != "triton" or c[0] * c[1] * c[2] <= 4 * SMALL])
def test_linear_forward_equals_the_reference(name, M, K, N, per_row, bias):
    _runs_here(name)
    args = _linear_problem(M, K, N, per_row=per_row, bias=bias)
    q_x, q_w, _, colsum, s_x, s_w, b = args
    with backends.use_backend(name), backends.recording() as ran:
        got = _linear(*args)
        ran_as = _runs_as(name, "linear", q_x, q_w, s_x, s_w, b, colsum, shape=(M, K, N))
    ref = _reference(_linear, *args)
    assert ran[("linear", ran_as)] == 1 or (name == "amx" and backends.get("amx").slow("linear", (M, K, N)))
    if name == "triton":  # FMA contraction in the epilogue: within 1 ulp
        ulp = torch.nextafter(ref.abs(), torch.tensor(float("inf"))) - ref.abs()
        assert torch.all((got - ref).abs() <= ulp)
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("name", ["cpu_fused"])
def test_elementwise_passes_equal_the_reference(name):
    _runs_here(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 129, generator=g) * 4
    s_row, s_one = torch.rand(37, generator=g) * 0.05 + 0.01, torch.tensor([0.03])
    q = _codes(37, 129, seed=4)
    b, ref = backends.get(name), backends.get("reference")
    for per_row, s in ((True, s_row), (False, s_one)):
        for z in (0.0, 5.0):
            got = b.quantize_rows(x, s, z, -128, 127, per_row, need_mask=True, need_rowsum=True)
            want = ref.quantize_rows(x, s, z, -128, 127, per_row, need_mask=True, need_rowsum=True)
            assert all(torch.equal(u, v) for u, v in zip(got, want))
            got = b.fake_quantize_rows(x, s, z, -128, 127, per_row, need_mask=True)
            want = ref.fake_quantize_rows(x, s, z, -128, 127, per_row, need_mask=True)
            assert all(torch.equal(u, v) for u, v in zip(got, want))
            assert torch.equal(b.dequantize_rows(q, s, z, per_row), ref.dequantize_rows(q, s, z, per_row))
    got = b.quantize_rows_dynamic(x, -127, 127, 1e-8, need_rowsum=True)
    want = ref.quantize_rows_dynamic(x, -127, 127, 1e-8, need_rowsum=True)
    assert all(torch.equal(u, v) for u, v in zip(got, want))
    mask = torch.rand(37, 129, generator=g) > 0.3
    packed = ref.pack_mask(mask)
    assert torch.equal(b.mask_zero_packed_(x.clone(), packed), ref.mask_zero_packed_(x.clone(), packed))
    acc = torch.randint(-2**20, 2**20, (37, 50), dtype=torch.int32, generator=g)
    colsum = torch.randint(-3000, 3000, (50,), dtype=torch.int32, generator=g)
    s_w, bias = torch.rand(50, generator=g) * 0.01, torch.randn(50, generator=g)
    for z_x, s_x in ((torch.tensor([7], dtype=torch.int32), s_one.reshape(1, 1)), (None, s_row.reshape(-1, 1))):
        assert torch.equal(b.epilogue(acc, z_x, colsum, s_x, s_w, bias), ref.epilogue(acc, z_x, colsum, s_x, s_w, bias))


def _train_step(preset_args, M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 2).requires_grad_()
    W = (torch.randn(N, K, generator=g) * 0.05).requires_grad_()
    b = torch.randn(N, generator=g).requires_grad_()
    s_x, z_x = torch.tensor([0.02]).requires_grad_(), torch.tensor([3.0]).requires_grad_()
    y = int_linear(x, W, b, s_x, z_x, None, **preset_args)
    leaves = [x, W, b] if preset_args.get("x_dynamic") else [x, W, b, s_x, z_x]  # dynamic: no learned s_x, z_x
    return (y.detach(), *torch.autograd.grad((y * torch.randn(M, N, generator=g)).sum(), leaves))


@pytest.mark.parametrize("name", ["amx", "cpu_fused", "avx2_int16", "fp32_exact"])
@pytest.mark.parametrize("preset_args", [{"grad_gemm": "fp32"}, {"x_dynamic": True, "grad_gemm": "fp32"}],
                         ids=["static", "dynamic"])
def test_int_linear_training_step_equals_the_reference(name, preset_args):
    """Forward output, every gradient (STE masks, LSQ scale and zero point) of a whole training step:
    the forced backend's step equals the reference's bit for bit. grad_gemm='fp32': whether the
    digit backward pays depends on the backend that runs it, so 'int8x3' may pick another algorithm
    under the reference; tests/test_digit_gemm.py compares the digit GEMMs with their reference."""
    _runs_here(name)
    M, K, N = 128, 1100, 512  # K past one exact fp32 slice; large enough for the digit backward
    with backends.use_backend(name), backends.recording() as ran:
        got = _train_step(preset_args, M, K, N)
    want = _reference(_train_step, preset_args, M, K, N)
    assert any(b == name for (_, b) in ran), ran
    for u, v in zip(got, want):
        assert torch.equal(u, v)


def test_the_table_picks_by_capability_and_says_why():
    """On any CPU: GEMMs never go to torch._int_mm where it is a scalar loop; traced calls go to the
    reference; forcing a backend that cannot run here raises with the reason."""
    from intqat.ops.cpu_features import cpu_has_int8_dot

    a, b = _codes(4, 8), _codes(8, 4)
    chosen = backends.select("int_mm", a, b, record=False).name
    no_dot = "avx2_int16" if backends.unavailable("avx2_int16") is None else "fp32_exact"
    trusted = backends.self_check.untrusted("torch._int_mm") is None  # (False under ONEDNN_MAX_CPU_ISA=AVX2 here)
    assert chosen == ("cpu_fused" if cpu_has_int8_dot() and trusted else no_dot)
    slow = backends.get("cpu_fused").slow("int_mm", None)
    assert (slow is None) == cpu_has_int8_dot() and (slow is None or "scalar loop" in slow)
    assert backends.select("quantize_rows", torch.randn(3, 3), record=False).name == "cpu_fused"
    with pytest.raises(ValueError, match="unknown intqat backend 'cuda'.*fp32_exact"):
        backends.use_backend("cuda").__enter__()
    for name, _, reason in backends.summary():
        if reason is not None:
            with pytest.raises(RuntimeError, match=f"backend '{name}' cannot run here"):
                backends.use_backend(name).__enter__()

    def traced(a, b):
        return int_mm(a, b)

    gm = torch.fx.experimental.proxy_tensor.make_fx(traced)(a, b)
    assert "aten._int_mm" in str(gm.graph)  # tracers see the portable op, whatever this CPU runs


@pytest.mark.parametrize("name", ["amx", "cpu_fused", "fp32_exact"])
def test_digit_matmul_equals_the_reference(name):
    """The backward GEMM through three int8 digit planes: same bits from every backend (z and mask too)."""
    from intqat.ops.digit_gemm import digit_matmul

    _runs_here(name)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(70, 1500, generator=g) * torch.logspace(-4, 2, 70).unsqueeze(1)
    col_scale = torch.rand(1500, generator=g) + 0.1
    q = _codes(1500, 90, seed=6)
    mask = torch.rand(70, 90, generator=g) > 0.2
    for z, m in ((0, None), (5, mask)):
        with backends.use_backend(name), backends.recording() as ran:
            got = digit_matmul(a, col_scale, q, z, m)
            ran_as = _runs_as(name, "digit_matmul", a, col_scale, q, m)
        assert ran[("digit_matmul", ran_as)] == 1
        assert torch.equal(got, _reference(digit_matmul, a, col_scale, q, z, m))


@pytest.mark.parametrize("M,K,N", [(6, 2, 16), (5, 7, 15), (13, 31, 33), (1, 1024, 1)])
def test_avx2_int16_edges_and_extreme_codes(M, K, N):
    """The micro-kernel's 6x16 tiles, odd K (a zero pad element per pair) and the extreme codes
    (-128 x -128 everywhere: every pair sum is 2^15, the value vpmaddwd must not saturate)."""
    _runs_here("avx2_int16")
    for a, b in ((_codes(M, K, seed=7), _codes(K, N, seed=8)),
                 (torch.full((M, K), -128, dtype=torch.int8), torch.full((K, N), -128, dtype=torch.int8))):
        with backends.use_backend("avx2_int16"):
            got = int_mm(a, b)
        assert torch.equal(got, _reference(int_mm, a, b))


@pytest.mark.parametrize("M,K,N", [(12, 33, 48), (8, 2, 32), (13, 31, 33), (24, 96, 384), (5, 7, 15)])
@pytest.mark.parametrize("z", [None, 0, 7, -128])
def test_avx2_int16_linear_whole_tiles_and_edges(M, K, N, z):
    """The fused linear's epilogue: whole tiles (12 rows: 3 tiles of 4 in the AVX2 build, 2 of 6 with
    AVX-512VL) from registers 8 lanes at a time, ragged rows / columns element by element; both the
    reference's bits, with and without the zero-point correction (z None: no colsum), per-tensor and
    per-row s_x, with and without bias, and the extreme codes (-128 everywhere)."""
    _runs_here("avx2_int16")
    g = torch.Generator().manual_seed(M * 31 + K + N)
    s_w, b = torch.rand(N, generator=g) * 0.01 + 0.001, torch.randn(N, generator=g)
    z_x = None if z is None else torch.tensor([z], dtype=torch.int32)
    for q_x, q_w in ((_codes(M, K, seed=M), _codes(N, K, seed=N)),
                     (torch.full((M, K), -128, dtype=torch.int8), torch.full((N, K), -128, dtype=torch.int8))):
        colsum = q_w.to(torch.int32).sum(1, dtype=torch.int32)
        for s_x in (torch.tensor([[0.03]]), torch.rand(M, 1, generator=g) * 0.1 + 0.01):
            for bias in (None, b):
                args = (q_x, q_w, z_x, colsum, s_x, s_w, bias)
                got = backends.get("avx2_int16").linear(*args)
                assert torch.equal(got, backends.get("reference").linear(*args))


@pytest.fixture(scope="module")
def avx2_cache(tmp_path_factory):
    """One kernel cache for the two tests below: INTQAT_KERNEL_MARCH=x86-64-v3 and INTQAT_EMULATE_NO_INT8_DOT=1
    compile the same C library (same flags, same key): one fresh build (~6 s here) serves both.

    Both run with INTQAT_CPP_STEP=0: the C++ training ops link the C library by its path, so a fresh cache
    costs a second build of them (~25-40 s here) that checks nothing these tests are about. What they
    check is the table's choice and the C kernels' bits for that build; the C++ ops call the same kernels
    and follow the same table (tests/test_cpp_step.py forces each backend whose kernels they call)."""
    return tmp_path_factory.mktemp("avx2-kernels")


def test_emulating_a_cpu_without_int8_dot_units(avx2_cache):
    """INTQAT_EMULATE_NO_INT8_DOT=1 (what `intqat-bench` uses to show that class on any machine): the
    GEMMs leave torch._int_mm and AMX, the backward keeps fp32 GEMMs, and the results stay the same bits."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from intqat.ops import backends, int_linear\n"
        "from intqat.ops.cpu_features import cpu_class\n"
        "from intqat.ops.digit_gemm import digits_pay\n"
        "x = torch.randn(256, 1024, requires_grad=True); w = torch.randn(1024, 1024, requires_grad=True)\n"
        "with backends.recording() as ran:\n"
        "    y = int_linear(x, w, None, torch.tensor([0.05]), torch.tensor([1.0]), None); y.sum().backward()\n"
        "gemms = sorted({b for (p, b) in ran if p in ('int_mm', 'linear', 'digit_matmul')})\n"
        "print(cpu_class().split(' (')[0], gemms, digits_pay(256, 1024, 1024))\n"
    )
    env = {**os.environ, "INTQAT_EMULATE_NO_INT8_DOT": "1", "INTQAT_CACHE_DIR": str(avx2_cache), "INTQAT_CPP_STEP": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    no_dot = "avx2_int16" if backends.unavailable("avx2_int16") is None else "fp32_exact"
    assert r.stdout.strip() == f"no int8 dot-product units ['{no_dot}'] False"


def test_minmax_equals_torch_aminmax():
    """The observer's one-pass (min, max): exact selections, NaN wherever torch.aminmax gives NaN."""
    _runs_here("cpu_fused")
    g = torch.Generator().manual_seed(9)
    cases = [torch.randn(256, 1024, generator=g) * 3, torch.randn(7, generator=g), torch.tensor([5.0]),
             torch.randn(3, 4, 5, generator=g).transpose(0, 2)]
    bad = torch.randn(100, generator=g)
    for v in (float("nan"), float("inf"), float("-inf")):
        b = bad.clone()
        b[37] = v
        cases.append(b)
    for x in cases:
        want = [float(t) for t in torch.aminmax(x)]
        got = list(backends.get("cpu_fused").minmax(x))
        assert (got == want) or (all(v != v for v in got) and all(v != v for v in want)), (got, want)


GROUPED_CASES = [(5, 64, 7, 32, True, True), (256, 1024, 1024, 32, True, True), (33, 256, 100, 128, False, True),
                 (7, 48, 70, 16, False, False), (9, 512, 31, 256, True, False), (4, 45, 9, 15, False, True)]


@pytest.mark.parametrize("name", ["cpu_fused", "avx2_int16", "fp32_exact"])
@pytest.mark.parametrize("M,K,N,gs,dynamic,bias", GROUPED_CASES)
def test_grouped_linear_forward_equals_the_reference(name, M, K, N, gs, dynamic, bias):
    """The per-group (8da4w) forward: every CPU backend's kernel (VNNI, vpmaddwd with the group scales in
    the K loop, exact fp32 multiply-adds; odd group sizes take the fp32 kernel) gives the reference's bits,
    dynamic per-token or static scales with a zero point, ragged M and N, with and without bias."""
    _runs_here(name)
    g = torch.Generator().manual_seed(M * 7 + K)
    q_x = _codes(M, K, seed=M)
    q_w = _codes(N, K, lo=-7, hi=8, seed=N)  # int4 weights
    s_w = torch.rand(N, K // gs, generator=g) * 0.01 + 1e-3
    s_x = torch.rand(M, 1, generator=g) * 0.05 + 0.01 if dynamic else torch.tensor([[0.03]])
    z_x = None if dynamic else torch.tensor([5], dtype=torch.int32)
    b = torch.randn(N, generator=g) if bias else None
    with backends.use_backend(name), backends.recording() as ran:
        got = backends.select("linear_grouped", q_x, q_w, s_w, s_x).linear_grouped(q_x, q_w, s_w, z_x, s_x, b)
        ran_as = _runs_as(name, "linear_grouped", q_x, q_w, s_w, s_x, why=None)  # (group size, VNNI build: refused)
    assert ran[("linear_grouped", ran_as)] == 1
    want = backends.get("reference").linear_grouped(q_x, q_w, s_w, z_x, s_x, b)
    assert torch.equal(got, want)


def test_an_avx2_only_build_of_the_kernels_gives_the_same_bits(avx2_cache):
    """This file's backend checks again with the kernels compiled as for an AVX2-only CPU
    (INTQAT_KERNEL_MARCH=x86-64-v3: no AVX-512, no VNNI), in a fresh process and kernel cache: the code
    paths a Zen 2/3 or Haswell build takes (AVX2 mask pass, vpmaddwd kernels, passes vectorized 8-wide)
    run on this machine too, and must equal the reference. (The cache is fresh for this module: the emulation
    test above may have filled it with the same x86-64-v3 build.)"""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64-v3 is an x86 build")
    env = {**os.environ, "INTQAT_KERNEL_MARCH": "x86-64-v3", "INTQAT_CACHE_DIR": str(avx2_cache),
           "INTQAT_CPP_STEP": "0"}
    code = ("from intqat.ops import cpu_kernels as k; assert k.available() and k.int16_gemm_available(); "
            "assert not k.grouped_vnni_available(); print(k.kernel_march())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "x86-64-v3", r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "not avx2_only_build and not triton and not emulating"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
