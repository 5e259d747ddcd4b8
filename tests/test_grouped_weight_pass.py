"""The 8da4w training step's whole-row weight pass (kernels/cpu/grouped_linear.c: intqat_grouped_quantize_pack,
sixteen rows at a time) against its definition: fused.c's dynamic per-row pass over the (N * G, group size) view
for the codes and scales, then intqat_grouped_pack for the kernels' packed codes and group column sums, and the
scales transposed and zero-padded. Bit for bit, on weights with NaN, infinities, subnormals, signed zeros, huge
values and all-zero groups; rows that do not fill a 16-row block; and with the column sums left out (cs NULL:
what the C++ step passes for the AMX kernel without a zero point)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from intqat.ops import cpu_kernels
from intqat.ops.qparams import SCALE_EPS

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels._library_says("intqat_grouped_quantize_available")),
    reason="the whole-row weight pass needs the fused C kernels built with AVX-512 (F, BW)")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _lib():
    lib = cpu_kernels._lib
    lib.intqat_grouped_quantize_pack.argtypes = [_P, _I, _I, _I, _F, _F, _F, _P, _P, _P, _P, _P, _I]
    lib.intqat_grouped_quantize_pack.restype = None
    return lib


def _weights(N, K, gs, kind, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.1
    if kind == "specials":
        u = torch.rand(N, K, generator=g)
        w[u < 0.03] = float("nan")
        w[(u >= 0.03) & (u < 0.05)] = float("inf")
        w[(u >= 0.05) & (u < 0.07)] = -float("inf")
        w[(u >= 0.07) & (u < 0.12)] = 1e-42
        w[(u >= 0.12) & (u < 0.17)] = -0.0
        w[:, :gs] = 0.0  # an all-zero group in every row: scale eps
    elif kind == "huge":
        w = w * 3e38 / 0.4
    elif kind == "ties":  # codes at k + 0.5 (max 7: scale exactly 1 with qmax 7)
        w[:, :8] = torch.tensor([7.0, 2.5, -3.5, 0.5, -0.5, 1.5, -6.5, 5.5])
    return w


def _definition(w, gs, qmin, qmax, Np):
    N, K = w.shape
    G = K // gs
    q = torch.empty(N, K, dtype=torch.int8)
    s = torch.empty(N, G)
    cpu_kernels._lib.intqat_quantize_rows_dynamic(w.data_ptr(), N * G, gs, qmin, qmax, SCALE_EPS, q.data_ptr(),
                                                  s.data_ptr(), None)
    bp = torch.empty(Np * K, dtype=torch.int8)
    cs = torch.empty(G, Np, dtype=torch.int32)
    cpu_kernels._lib.intqat_grouped_pack(q.data_ptr(), N, K, K, gs, Np, bp.data_ptr(), cs.data_ptr())
    swt = torch.zeros(G, Np)
    swt[:, :N] = s.t()
    return q, s, bp, cs, swt


@pytest.mark.parametrize("N,K,gs", [(5, 64, 16), (33, 128, 32), (40, 256, 64), (17, 96, 32), (1, 256, 128),
                                    (64, 512, 32), (48, 48, 16)])
@pytest.mark.parametrize("kind", ["plain", "specials", "huge", "ties"])
@pytest.mark.parametrize("qmin,qmax", [(-7.0, 7.0), (-8.0, 7.5), (-127.0, 127.0)])
def test_whole_row_pass_equals_the_row_pass_and_pack(N, K, gs, kind, qmin, qmax):
    lib = _lib()
    w = _weights(N, K, gs, kind, N * K + gs)
    G, Np = K // gs, -(-N // 32) * 32
    want = _definition(w, gs, qmin, qmax, Np)
    for with_cs in (True, False):
        q = torch.full((N, K), 99, dtype=torch.int8)
        s = torch.full((N, G), 5.0)
        bp = torch.full((Np * K,), 77, dtype=torch.int8)
        cs = torch.full((G, Np), 55, dtype=torch.int32)
        swt = torch.full((G, Np), 3.0)
        lib.intqat_grouped_quantize_pack(w.data_ptr(), N, K, gs, qmin, qmax, SCALE_EPS, q.data_ptr(), s.data_ptr(),
                                         bp.data_ptr(), cs.data_ptr() if with_cs else None, swt.data_ptr(), Np)
        assert torch.equal(q, want[0]), "codes"
        assert torch.equal(s.view(torch.int32), want[1].view(torch.int32)), "scales"
        assert torch.equal(bp, want[2]), "packed codes"
        assert torch.equal(swt.view(torch.int32), want[4].view(torch.int32)), "transposed scales"
        if with_cs:
            assert torch.equal(cs, want[3]), "group column sums"
        else:
            assert bool((cs == 55).all()), "cs NULL: no column sums written"
