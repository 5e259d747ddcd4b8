"""int8 (M, K) x int8 (K, N) -> int32 (M, N): the semantics of out_dtype(aten.mm, torch.int32, a, b).

A plain function, not a custom op: traced, it is `aten._int_mm`, a core aten op, so models that call it
export to programs that run without intqat installed. Its definition (the reference backend, eager) is
the exact sum in int64 (`backends.exact`), which shares no kernel with the fast paths. Which
implementation runs is the backend table's choice (`intqat.ops.backends`): torch._int_mm on CPUs with
int8 dot-product units where it passed its self-check, AVX2 int16 multiply-adds or exact fp32 GEMMs of
the codes elsewhere (`avx2_int16`, `fp32_exact`), Triton on GPUs. `check_int_mm()` says whether this
process's torch._int_mm is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from intqat.ops import backends
from intqat.ops.backends import MAX_K_INT32
from intqat.ops.backends.self_check import check_int_mm

__all__ = ["int_mm", "MAX_K_INT32", "check_int_mm"]


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


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """Exact int32 product of int8 matrices, any strides (transposed views included).

    Contractions past MAX_K_INT32 = 131071 (where an int32 sum could overflow: K * 2^14 <= 2^31 - 1)
    are summed in int64; a result outside int32 raises OverflowError instead of wrapping."""
    _check(a, b)
    return backends.select("int_mm", a, b).int_mm(a, b)
