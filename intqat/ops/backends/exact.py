"""Exact int8 GEMMs by arithmetic that shares no kernel with the fast backends: what the definition rests on.

The reference backend is what every other backend is tested against, so its integer GEMMs must not be a
kernel those tests are meant to check. `torch._int_mm` is such a kernel: with oneDNN held below VNNI on a
VNNI CPU (ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE, torch 2.13) it got 4,050 of 4,096 entries of a
64x256 @ 256x64 product wrong, off by up to 67,550, while a reference built on it agreed with itself.

- `exact_int_mm`: the definition's int8 GEMM. On the CPU an int64 matmul: aten's own integer GEMM loop
  (neither oneDNN nor MKL), every product and sum exact (|sum| <= K 2^14 is far inside int64). Elsewhere
  (CUDA has no integer matmul) `fp32_slices_mm`. ~3x an fp32 GEMM's time on the CPU (int64 widening
  included; measured 18.6 ms against 5.7 ms at 256x1024x1024, 1 thread, AMD EPYC Zen 4): it is the
  definition, so it may be slow; the fast backends are checked against it.
- `fp32_slices_mm` (= `int_mm_via_fp32`): fp32 GEMMs of K slices <= EXACT_K, each exact (docs/numerics.md,
  "Exact int8 products on fp32 units"), their int32 results added. The fp32_exact backend's arithmetic,
  and the traceable decomposition AOTInductor packages get on CPUs without int8 dot products.

Both return int32 and raise OverflowError (naming the shapes) when the exact result does not fit int32,
as out_dtype=int32 demands; neither can wrap.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MAX_K_INT32", "EXACT_K", "exact_int_mm", "fp32_slice", "fp32_slices_mm", "int_mm_via_fp32", "to_int32"]

# |a * b| <= 128 * 128 = 2^14 per product of int8 codes, so an int32 sum of K products cannot
# overflow while K * 2^14 <= 2^31 - 1, i.e. K <= 131071. (At K = 131072 the all -128 sum is exactly
# 2^31, one past int32's maximum.) Longer contractions are summed in int64.
MAX_K_INT32 = (2**31 - 1) // 2**14  # 131071

EXACT_K = 2**24 // 2**14  # 1024: the longest K slice an fp32 GEMM of int8 codes sums exactly


def to_int32(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """acc (int64, exact) as int32, or OverflowError naming the shapes and the range it spans."""
    if a.shape[1] > MAX_K_INT32 and acc.numel():  # (shorter contractions cannot leave int32)
        info = torch.iinfo(torch.int32)
        lo, hi = (int(v) for v in acc.aminmax())
        if lo < info.min or hi > info.max:
            raise OverflowError(
                f"int_mm: the exact result of {tuple(a.shape)} x {tuple(b.shape)} spans [{lo}, {hi}], outside "
                f"int32 [{info.min}, {info.max}]; it cannot be returned as out_dtype=int32")
    return acc.to(torch.int32)


def fp32_slice(a: Tensor, b: Tensor) -> Tensor:
    """a (M, k) int8 @ b (k, N) int8 with k <= EXACT_K -> the exact int32 product, via one fp32 GEMM."""
    return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(torch.int32)


def fp32_slices_mm(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) int8 @ b (K, N) int8 -> exact int32 (M, N), as fp32 GEMMs of K slices <= EXACT_K added in
    int32 (int64 past MAX_K_INT32). Traceable: plain aten ops, as many mm nodes as slices."""
    K = a.shape[1]
    if K == 0:
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)
    wide = K > MAX_K_INT32
    acc = None
    for k0 in range(0, K, EXACT_K):
        part = fp32_slice(a[:, k0 : k0 + EXACT_K], b[k0 : k0 + EXACT_K])
        part = part.to(torch.int64) if wide else part
        acc = part if acc is None else acc + part
    return to_int32(acc, a, b) if wide else acc


int_mm_via_fp32 = fp32_slices_mm  # the name intqat.export's AOTInductor decomposition uses


def exact_int_mm(a: Tensor, b: Tensor) -> Tensor:
    """The definition of int_mm: a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exact, any strides.

    CPU: one int64 matmul (aten's integer GEMM: no oneDNN, no MKL). Other devices: `fp32_slices_mm`."""
    if a.device.type != "cpu":
        return fp32_slices_mm(a, b)
    return to_int32(torch.mm(a.to(torch.int64), b.to(torch.int64)), a, b)
