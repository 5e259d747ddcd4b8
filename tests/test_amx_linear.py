"""int_linear's forward on AMX tiles (kernels/cpu/amx_linear.c, `integer_linear`).

The fused kernel must give the bits of torch._int_mm + the integer epilogue for every shape it can
be handed: rows and columns that do not fill a 32x32 block, contractions that do not fill a
64-byte tile row, one activation scale or one per row, with and without zero point and bias. It
must also be what the layer runs in training and in eval, and agree with the exported program.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import intqat
from intqat.ops import cpu_kernels
from intqat.ops import backends
from intqat.ops.backends import amx_forward_pays

needs_amx = pytest.mark.skipif(not cpu_kernels.amx_available(), reason="this CPU (or the fused-kernel build) has no AMX")


def _operands(M, K, N, per_row, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_x = torch.randint(-128, 128, (M, K), dtype=torch.int8, generator=g)
    q_w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s_x = torch.rand(M if per_row else 1, generator=g) * 0.1 + 1e-3
    s_w = torch.rand(N, generator=g) * 0.1 + 1e-3
    bias = torch.randn(N, generator=g)
    return q_x, q_w, s_x, s_w, bias


def _reference(q_x, q_w, z, colsum, s_x, s_w, bias):
    """The int_mm path, its int32 accumulator computed in int64 (exact) and narrowed."""
    acc = (q_x.to(torch.int64) @ q_w.to(torch.int64).t()).to(torch.int32)
    return cpu_kernels.epilogue(acc, z, colsum, s_x, s_w, bias)


@needs_amx
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (7, 13, 5), (31, 64, 33), (33, 300, 17), (64, 512, 256),
                                   (100, 128, 64), (600, 70, 300), (256, 1024, 1024)])
@pytest.mark.parametrize("z,per_row,bias", [(0, True, False), (5, False, True), (-128, False, False)])
def test_amx_kernel_gives_the_bits_of_int_mm_and_the_epilogue(M, K, N, z, per_row, bias):
    q_x, q_w, s_x, s_w, b = _operands(M, K, N, per_row)
    colsum = q_w.to(torch.int32).sum(1, dtype=torch.int32) if z else None
    b = b if bias else None
    got = cpu_kernels.amx_linear(q_x, q_w, z, colsum, s_x, s_w, b)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert torch.equal(got, _reference(q_x, q_w, z, colsum, s_x, s_w, b))


@needs_amx
def test_stale_scratch_and_rows_past_the_last_block_never_reach_the_result():
    """A large call leaves codes in the padded scratch buffers; a smaller, oddly shaped call (its
    contraction padded from 70 to 128, its last row block partial) must not pick them up."""
    big = _operands(200, 1000, 96, per_row=False, seed=1)
    cpu_kernels.amx_linear(big[0], big[1], 3, None, big[2], big[3], big[4])
    for M, K in [(45, 70), (45, 128)]:  # padded copy; q_x read in place with a 32-row tail copy
        q_x, q_w, s_x, s_w, b = _operands(M, K, 40, per_row=True, seed=2)
        assert torch.equal(cpu_kernels.amx_linear(q_x, q_w, 0, None, s_x, s_w, b),
                           _reference(q_x, q_w, 0, None, s_x, s_w, b))


@needs_amx
def test_sums_are_exact_over_a_long_contraction():
    """Extreme codes (-128 x -127) over K = 4096: each sum, 127 * 2^19, must come out exact (it is
    a float32 integer), as the int32 accumulator of int_mm holds it."""
    K = 4096
    q_x = torch.full((32, K), -128, dtype=torch.int8)
    q_w = torch.full((32, K), -127, dtype=torch.int8)
    ones = torch.ones(32)
    got = cpu_kernels.amx_linear(q_x, q_w, 0, None, ones[:1], ones, None)
    assert torch.equal(got, torch.full((32, 32), float(128 * 127 * K)))


@pytest.mark.parametrize("M,K,N,expected", [(256, 1024, 1024, True), (32, 1024, 1024, True),
                                            (2048, 1024, 1024, False), (256, 1024, 10, False),
                                            (64, 256, 256, False)])
def test_the_fused_forward_is_taken_where_it_was_measured_to_pay(M, K, N, expected):
    assert amx_forward_pays(M, K, N) is expected
    assert (backends.get("amx").slow("linear", (M, K, N)) is None) is expected
    q_x, q_w = torch.zeros(M, K, dtype=torch.int8), torch.zeros(N, K, dtype=torch.int8)
    chosen = backends.select("linear", q_x, q_w, shape=(M, K, N), record=False).name
    assert (chosen == "amx") is (expected and backends.unavailable("amx") is None)


@needs_amx
@pytest.mark.parametrize("preset", ["w8a8", "w8a8_dynamic"])
def test_training_eval_and_exported_forward_agree_when_the_layer_runs_on_amx(preset, tmp_path):
    """A layer large enough for the AMX forward: its training forward (the op), its eval forward
    and the reloaded torch.export program (which runs torch._int_mm) give the same bits, and the
    kernel path gives the bits of the int_mm path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 512))
    x = torch.randn(128, 512)
    intqat.prepare_qat(model, preset)
    intqat.calibrate(model, [x])
    intqat.to_integer(model)
    assert amx_forward_pays(128, 512, 256) and amx_forward_pays(128, 256, 512)
    model.train()
    y_train = model(x)
    model.eval()
    with torch.no_grad():
        y_eval = model(x)
        with backends.use_backend("cpu_fused"):
            y_int_mm = model(x)
    assert torch.equal(y_train.detach(), y_eval) and torch.equal(y_eval, y_int_mm)
    deployed = intqat.to_deployed(model)
    program = torch.export.export(deployed, (x,))
    torch.export.save(program, tmp_path / "m.pt2")
    assert torch.equal(torch.export.load(tmp_path / "m.pt2").module()(x), y_eval)
