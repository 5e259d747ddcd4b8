"""The per-group (8da4w) forward on AMX tiles (kernels/cpu/amx_grouped.c, backend amx's `linear_grouped`).

The tile kernel must give the bits of `grouped_reference` (and of the VNNI kernel) for every shape it can be
handed: rows that do not fill a 16-row tile, columns that do not fill a 16-column tile, one tile step per group
(K = 32, 64, 96 at group 32) or several per group (group 96 or 128), extreme codes, groups whose codes are all
zero, K = 0, a per-tensor activation scale with a zero point (static activations) or one per token. It must be
what the table and the C++ training step run from 16 rows on, and nothing below. Runs only where the CPU and the
kernel build have AMX-INT8; elsewhere every test is skipped with that reason (the VNNI kernel, cpu_fused, runs).
"""

from __future__ import annotations

import os

import pytest
import torch

from intqat.ops import backends, cpp_step, cpu_kernels
from intqat.ops.backends.amx import AMX_GROUPED_MIN_M
from intqat.ops.int_linear_grouped import grouped_reference, int_linear_grouped

needs_amx = pytest.mark.skipif(not cpu_kernels.amx_grouped_available(),
                               reason="this CPU (or the fused-kernel build) has no AMX-INT8: the per-group forward "
                                      "runs on the VNNI kernel (cpu_fused) or the reference")


def _operands(M, K, N, gs, per_token, seed=0, x_codes=(-128, 127), w_codes=(-8, 7)):
    g = torch.Generator().manual_seed(seed)
    q_x = torch.randint(x_codes[0], x_codes[1] + 1, (M, K), dtype=torch.int8, generator=g)
    q_w = torch.randint(w_codes[0], w_codes[1] + 1, (N, K), dtype=torch.int8, generator=g)
    s_w = torch.rand(N, K // gs, generator=g) * 0.1 + 1e-3
    s_x = torch.rand(M if per_token else 1, 1, generator=g) * 0.1 + 1e-3
    bias = torch.randn(N, generator=g)
    return q_x, q_w, s_w, s_x, bias


def _same_bits(q_x, q_w, s_w, z, s_x, bias):
    """AMX kernel == VNNI kernel == grouped_reference, bit for bit (torch.equal on the int32 views: -0.0 too)."""
    got = cpu_kernels.grouped_linear(q_x, q_w, s_w, z, s_x, bias, fp32_codes=False, amx=True)
    vnni = cpu_kernels.grouped_linear(q_x, q_w, s_w, z, s_x, bias, fp32_codes=False)
    ref = grouped_reference(q_x, q_w, s_w, None if z == 0 else torch.tensor([z], dtype=torch.int32), s_x, bias)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), vnni.view(torch.int32)), "AMX vs VNNI kernel"
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), "AMX kernel vs grouped_reference"


@needs_amx
@pytest.mark.parametrize("M,K,N,gs", [
    (1, 32, 1, 32), (15, 32, 17, 32), (16, 64, 16, 32), (17, 96, 47, 32), (33, 96, 10, 96), (40, 256, 20, 128),
    (31, 64, 33, 64), (128, 256, 768, 32), (130, 768, 36, 32), (5, 12, 3, 4), (18, 1024, 16, 8)])
@pytest.mark.parametrize("z,per_token,bias",
                         [(0, True, False), (0, True, True), (-5, False, True), (127, False, False)])
def test_amx_kernel_gives_the_reference_bits(M, K, N, gs, z, per_token, bias):
    q_x, q_w, s_w, s_x, b = _operands(M, K, N, gs, per_token, seed=M + K + N)
    _same_bits(q_x, q_w, s_w, z, s_x, b if bias else None)


@needs_amx
@pytest.mark.parametrize("x_code,w_code", [(-128, -8), (-128, 7), (127, -8), (127, 7), (-128, -128), (127, -128)])
def test_extreme_codes_are_exact(x_code, w_code):
    """Every code at its extreme: the group sums at their largest magnitude (int8 x int4, and int8 x int8)."""
    M, K, N, gs = 19, 96, 21, 32
    q_x, q_w, s_w, s_x, b = _operands(M, K, N, gs, True, seed=3)
    q_x.fill_(x_code)
    q_w.fill_(w_code)
    _same_bits(q_x, q_w, s_w, 0, s_x, b)
    _same_bits(q_x, q_w, s_w, -128 if x_code > 0 else 127, s_x[:1], b)  # a zero point at the other end


@needs_amx
def test_zero_groups_and_zero_rows():
    """Groups whose weight codes are all zero (p_g = 0 at any scale), rows of zero activation codes, mixed in
    with ordinary ones; and K = 0 (no groups: y = 0 * s_x + b)."""
    M, K, N, gs = 35, 128, 29, 32
    q_x, q_w, s_w, s_x, b = _operands(M, K, N, gs, True, seed=4)
    q_w[:, 32:64] = 0
    q_w[5, :] = 0
    q_x[7, :] = 0
    s_w[3, 1] = 0.0
    _same_bits(q_x, q_w, s_w, 0, s_x, b)
    _same_bits(q_x, q_w, s_w, 9, s_x[:1], None)
    # K = 0, through the C entry point (the Python wrappers take K = G * group size > 0): no tile is loaded
    M, N, Np = 20, 17, 32
    y = torch.full((M, N), float("nan"))
    empty = torch.zeros(1, dtype=torch.int8)
    cpu_kernels._lib.intqat_amx_grouped_linear(empty.data_ptr(), M, 0, 0, empty.data_ptr(), None, None, N, Np, 32, 0,
                                               s_x.data_ptr(), 1, b.data_ptr(), y.data_ptr(), N)
    assert torch.equal(y, torch.zeros(M, N) * s_x[:M] + b[:N])


@needs_amx
def test_the_table_runs_it_from_16_rows_and_the_vnni_kernel_below():
    K, N, gs = 64, 40, 32
    null = open(os.devnull, "w")
    for M, want in ((AMX_GROUPED_MIN_M - 1, "cpu_fused"), (AMX_GROUPED_MIN_M, "amx"), (128, "amx")):
        assert backends.select("linear_grouped", shape=(M, K, N), record=False, at_run_time=True).name == want
        text = backends.explain("linear_grouped", shape=(M, K, N), at_run_time=True, file=null)
        assert (f"{want:<11} RUNS IT") in text
        if want == "cpu_fused":
            assert "M < 16" in text
        q_x, q_w, s_w, s_x, b = _operands(M, K, N, gs, True, seed=M)
        with backends.recording() as ran:
            y = backends.select("linear_grouped", q_x, q_w, s_w, s_x, b, None, shape=(M, K, N)).linear_grouped(
                q_x, q_w, s_w, None, s_x, b)
        assert ran[("linear_grouped", want)] == 1
        assert torch.equal(y, grouped_reference(q_x, q_w, s_w, None, s_x, b))


@needs_amx
@pytest.mark.skipif(cpp_step.unavailable_reason() is not None, reason="the C++ training ops are not built here")
@pytest.mark.parametrize("M", [AMX_GROUPED_MIN_M, 37])
def test_the_cpp_step_runs_it_and_gives_the_vnni_steps_bits(M):
    """The C++ grouped step on AMX (as the table chooses) against the same step forced onto the VNNI kernel:
    output and gradients equal."""
    K, N, gs = 96, 50, 32
    g = torch.Generator().manual_seed(M)
    x = (torch.randn(M, K, generator=g) * 2).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.1).requires_grad_()
    b = torch.randn(N, generator=g).requires_grad_()
    gy = torch.randn(M, N, generator=g)

    def step():
        y = int_linear_grouped(x, w, b, None, None, None, group_size=gs)
        return (y, *torch.autograd.grad(y, (x, w, b), gy))

    with backends.recording() as ran:
        got = step()
    assert ran[("grouped_step", "cpp_step")] == 1 and ran[("linear_grouped", "amx")] == 1, dict(ran)
    with backends.use_backend("cpu_fused"), backends.recording() as ran:
        want = step()
    assert ran[("grouped_step", "cpp_step")] == 1 and ran[("linear_grouped", "cpu_fused")] == 1, dict(ran)
    for name, a, c in zip(("y", "grad_x", "grad_w", "grad_b"), got, want):
        assert torch.equal(a, c), name
