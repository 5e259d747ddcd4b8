"""int8 (M, K) x int8 (K, N) -> int32 (M, N): the semantics of out_dtype(aten.mm, torch.int32, a, b).

A plain function, not a custom op: on the CPU it is `torch._int_mm`, a core aten op, so models
that call it export to programs that run without intqat installed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from intqat.ops.backend import backend_for, cpu_is_torch

__all__ = ["int_mm", "MAX_K_INT32"]

# |a * b| <= 128 * 128 = 2^14 per product, so an int32 sum cannot overflow while K * 2^14 < 2^31.
MAX_K_INT32 = 2**31 // 2**14  # 131072


def _check(a: Tensor, b: Tensor) -> None:
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise ValueError(f"int_mm expects two tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise ValueError(f"int_mm expects int8 x int8, got a: {a.dtype} {tuple(a.shape)}, b: {b.dtype} {tuple(b.shape)}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"int_mm expects 2-D (M, K) x (K, N), got a: {tuple(a.shape)}, b: {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"int_mm: K mismatch, a is {tuple(a.shape)} (M, K) and b is {tuple(b.shape)} (K, N)")
    if a.device != b.device:
        raise ValueError(f"int_mm: a is on {a.device} and b on {b.device}; put both on one device")


def _is_dense(t: Tensor) -> bool:
    """Row-major, or column-major with no size-1 dim: layouts torch._int_mm handles (see _dense_layout)."""
    rows, cols = t.shape
    st = t.stride()
    return (st[1] == 1 and st[0] == cols) or (st[0] == 1 and st[1] == rows and rows > 1 and cols > 1)


def _dense_layout(t: Tensor) -> Tensor:
    """t itself if row-major, or column-major with no size-1 dim; else a row-major copy.

    torch._int_mm (CPU, torch 2.13) returns wrong numbers for some layouts that involve size-1
    dims, e.g. a (44, 1) view with strides (1, 44) times a (1, 56) view with strides (1, 1);
    tests/test_int_mm.py keeps the cases. Those layouts only arise for degenerate shapes, so
    the copy costs nothing that matters.
    """
    rows, cols = t.shape
    if t.stride() == (cols, 1):
        return t
    if rows > 1 and cols > 1 and t.stride() == (1, rows):
        return t
    return torch.empty((rows, cols), dtype=t.dtype, device=t.device).copy_(t)


def _int_mm_unchecked(a: Tensor, b: Tensor) -> Tensor:
    if backend_for(a) == "triton":
        from intqat import kernels

        return kernels.int_mm(a, b)
    if a.shape[0] == 0 or b.shape[1] == 0 or a.shape[1] == 0:
        # torch._int_mm returns uninitialised memory for K = 0 on some builds; the sum of nothing is 0.
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)
    return torch._int_mm(_dense_layout(a), _dense_layout(b))


def _int_mm_split_k(a: Tensor, b: Tensor) -> Tensor:
    """K too large for one int32 sum: add int32 partial products of K chunks in int64, then check range."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int64, device=a.device)
    for k0 in range(0, a.shape[1], MAX_K_INT32):
        acc += _int_mm_unchecked(a[:, k0 : k0 + MAX_K_INT32], b[k0 : k0 + MAX_K_INT32])
    info = torch.iinfo(torch.int32)
    lo, hi = (int(v) for v in acc.aminmax()) if acc.numel() else (0, 0)
    if lo < info.min or hi > info.max:
        raise OverflowError(
            f"int_mm: the exact result of {tuple(a.shape)} x {tuple(b.shape)} spans [{lo}, {hi}], "
            "outside int32; it cannot be returned as out_dtype=int32"
        )
    return acc.to(torch.int32)


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """Exact int32 product of int8 matrices, any strides (transposed views included)."""
    # The common case first, in as few Python steps as possible: int_mm is meant to cost what
    # torch._int_mm costs (the check below is a few attribute reads, ~1 us on a ~250 us GEMM).
    if (type(a) is Tensor and type(b) is Tensor and a.dtype is torch.int8 and b.dtype is torch.int8
            and a.dim() == 2 and b.dim() == 2 and a.is_cpu and b.is_cpu):
        M, K = a.shape
        K2, N = b.shape
        if K == K2 and 0 < K <= MAX_K_INT32 and M and N and _is_dense(a) and _is_dense(b) and cpu_is_torch():
            return torch._int_mm(a, b)
    _check(a, b)
    if a.shape[1] > MAX_K_INT32:
        return _int_mm_split_k(a, b)
    return _int_mm_unchecked(a, b)
