"""int_mm is exact: compared with an int64 reference, never with a tolerance."""

import pytest
import torch

from intqat.ops import MAX_K_INT32, backends, int_mm


def _ref(a, b):
    return (a.to(torch.int64) @ b.to(torch.int64)).to(torch.int32)


def _rand(*shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8)


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (1, 17, 3), (7, 5, 3), (33, 65, 17), (128, 256, 64), (3, 1000, 1), (64, 8, 256)])
def test_exact_against_int64_reference(M, K, N):
    a, b = _rand(M, K), _rand(K, N)
    out = int_mm(a, b)
    assert out.dtype == torch.int32 and out.shape == (M, N)
    assert torch.equal(out, _ref(a, b))


def test_extreme_values_exact():
    a = torch.full((4, 512), -128, dtype=torch.int8)
    b = torch.full((512, 3), -128, dtype=torch.int8)
    assert torch.equal(int_mm(a, b), torch.full((4, 3), 128 * 128 * 512, dtype=torch.int32))


def test_random_shapes_and_strides():
    g = torch.Generator().manual_seed(1)
    for _ in range(25):
        M, K, N = (int(v) for v in torch.randint(1, 90, (3,), generator=g))
        a_t = _rand(K, M).t()  # transposed views: non-contiguous
        b_t = _rand(N, K).t()
        for a, b in [(a_t, b_t), (a_t.contiguous(), b_t), (a_t, b_t.contiguous())]:
            assert torch.equal(int_mm(a, b), _ref(a, b))
    a = _rand(20, 40)[:, ::2]  # strided columns
    b = _rand(20, 9)
    assert torch.equal(int_mm(a, b), _ref(a, b))


@pytest.mark.parametrize("M,K,N", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_zero_size_dims(M, K, N):
    out = int_mm(_rand(M, K), _rand(K, N))
    assert out.shape == (M, N) and out.dtype == torch.int32
    assert torch.equal(out, torch.zeros(M, N, dtype=torch.int32))


def test_large_k_split_is_exact():
    K = MAX_K_INT32 + 77
    a, b = _rand(2, K), _rand(K, 3)
    assert torch.equal(int_mm(a, b), _ref(a, b))


def test_large_k_overflow_is_an_error_not_a_wrong_number():
    K = MAX_K_INT32 + 10_000
    a = torch.full((1, K), 127, dtype=torch.int8)
    b = torch.full((K, 1), 127, dtype=torch.int8)
    with pytest.raises(OverflowError, match="outside int32"):
        int_mm(a, b)


@pytest.mark.parametrize(
    "a,b,match",
    [
        (torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.int8), r"int8 x int8, got a: torch.float32 \(2, 3\)"),
        (torch.zeros(2, 3, dtype=torch.int8), torch.zeros(3, 2, dtype=torch.int32), "torch.int32"),
        (torch.zeros(2, 3, 1, dtype=torch.int8), torch.zeros(3, 2, dtype=torch.int8), r"2-D.*\(2, 3, 1\)"),
        (torch.zeros(2, 3, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.int8), r"K mismatch.*\(2, 3\).*\(4, 2\)"),
    ],
)
def test_bad_inputs(a, b, match):
    with pytest.raises(ValueError, match=match):
        int_mm(a, b)


def test_device_mismatch():
    a = torch.zeros(2, 3, dtype=torch.int8)
    b = torch.zeros(3, 2, dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match="device"):
        int_mm(a, b)


def test_backend_env_is_validated():
    """INTQAT_BACKEND is read once, at import: a bad name fails the import, naming the choices."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "INTQAT_BACKEND": "cuda-please"}
    r = subprocess.run([sys.executable, "-c", "import intqat"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "INTQAT_BACKEND='cuda-please'" in r.stderr and "fp32_exact" in r.stderr


def test_triton_backend_bit_identical():
    """The Triton kernel (interpreter on this CPU) gives the exact int32 result."""
    with backends.use_backend("triton"), backends.recording() as ran:
        for M, K, N in [(1, 7, 3), (19, 33, 21), (40, 64, 16)]:
            a, b = _rand(M, K), _rand(N, K).t()
            assert torch.equal(int_mm(a, b), _ref(a, b))
    assert set(ran) == {("int_mm", "triton")}


def test_layouts_with_size_one_dims_and_broadcast_views():
    """torch._int_mm alone returns garbage for some of these layouts on this CPU build."""
    for M, K, N in [(44, 1, 56), (1, 5, 3), (2, 5, 56), (1, 1, 9), (9, 5, 1)]:
        A, B = _rand(M, K), _rand(K, N)
        for sa in [(K, 1), (1, M), (1, 1)]:
            for sb in [(N, 1), (1, K), (1, 1)]:
                if (M > 1 and K > 1 and sa == (1, 1)) or (K > 1 and N > 1 and sb == (1, 1)):
                    continue  # would overlap: not a layout copy_ can fill
                a = torch.empty_strided((M, K), sa, dtype=torch.int8).copy_(A)
                b = torch.empty_strided((K, N), sb, dtype=torch.int8).copy_(B)
                assert torch.equal(int_mm(a, b), _ref(A, B)), (M, K, N, sa, sb)
    row = _rand(1, 16)
    a = row.expand(8, 16)  # stride 0
    b = _rand(16, 4)
    assert torch.equal(int_mm(a, b), _ref(a.contiguous(), b))
