"""Fused CPU kernels (kernels/cpu/fused.c): the elementwise passes around `torch._int_mm`, one pass each.

Why: on the CPU, an eager int_linear step was ~25 separate aten kernels around two fp32 matmuls
and one int8 matmul (quantize = mul, round, add, clamp, cast, compare; colsum = cast + sum;
epilogue = sub, cast, mul, mul, add), and those passes cost more than the int8 matmul saved.
Each C function here does one of them in one memory pass, with the same float32 operations in
the same order as the torch reference in `intqat.ops`, so results are bit-identical (the tests
check every function both ways).

The library is compiled on first use with the system C compiler (`$CC`, default `cc`; ~0.5 s)
into a cache directory (`$INTQAT_CACHE_DIR`, default `~/.cache/intqat`), keyed by a hash of the
source, the flags and the CPU, and written atomically (several processes may build at once): the build
and the cache are intqat.ops.cbuild's; this module loads the library (ctypes), says what it can do, and
wraps its functions for tensors.
Without a compiler, or with `INTQAT_CPU_KERNELS=0`, every caller keeps its torch path: slower,
same numbers.

Which calls take them is the backend table's choice (`intqat.ops.backends`, backend `cpu_fused`):
plain, real CPU tensors outside of tracing; under torch.compile / torch.export (fake tensors) the
reference (torch) path runs, which the compiler can see.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from intqat.ops.cbuild import OffSwitch, build_library, c_flag_sets, cache_dir, kernel_march, kernel_sources

__all__ = [
    "available",
    "disabled",
    "quantize_rows",
    "quantize_rows_dynamic",
    "fake_quantize_rows",
    "mask_zero_bits_",
    "epilogue",
    "dequantize_rows",
    "split_digits",
    "combine_digits",
    "amx_available",
    "amx_digit_matmul",
    "amx_linear",
    "scratch",
    "int16_gemm_available",
    "int16_gemm",
    "int16_linear",
    "int16_linear_grouped",
    "kernel_march",
    "grouped_vnni_available",
    "amx_grouped_available",
    "grouped_linear",
    "depthwise_backward",
]

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    # x, rows, cols, scale, scale_stride, z, qmin, qmax, out, mask, rowsum
    "intqat_quantize_rows": [_P, _I, _I, _P, _I, _F, _F, _F, _P, _P, _P],
    # x, rows, cols, scale, scale_stride, z, qmin, qmax, out, mask
    "intqat_fake_quantize_rows": [_P, _I, _I, _P, _I, _F, _F, _F, _P, _P],
    # x, rows, cols, qmin, qmax, eps, out, scale, rowsum
    "intqat_quantize_rows_dynamic": [_P, _I, _I, _F, _F, _F, _P, _P, _P],
    # g, packed mask bits, n
    "intqat_mask_zero_bits": [_P, _P, _I],
    # x, n, out (2 floats)
    "intqat_minmax": [_P, _I, _P],
    # mask, n, packed / packed, n, mask
    "intqat_pack_bits": [_P, _I, _P],
    "intqat_unpack_bits": [_P, _I, _P],
    # acc, M, N, z_x, colsum, s_x, sx_stride, s_w, bias, y
    "intqat_epilogue": [_P, _I, _I, ctypes.c_int32, _P, _P, _I, _P, _P, _P],
    # q, rows, cols, scale, scale_stride, z, out
    "intqat_dequantize_rows": [_P, _I, _I, _P, _I, _F, _P],
    # a, R, C, rs, cs, col_scale, scale_stride, digits, ld, plane, shift, rowsum
    "intqat_split_digits": [_P, _I, _I, _I, _I, _P, _I, _P, _I, _I, _P, _P],
    # acc, R, K, shift, rowsum, z, mask, out
    "intqat_combine_digits": [_P, _I, _I, _P, _P, ctypes.c_int32, _P, _P],
    # (amx_digits.c) q, C, K, q row stride, ld, Kp, bpack
    "intqat_amx_pack_b": [_P, _I, _I, _I, _I, _I, _P],
    # digits, R, ld, bpack, K, shift, rowsum, z, mask, out
    "intqat_amx_digit_gemm": [_P, _I, _I, _P, _I, _P, _P, ctypes.c_int32, _P, _P],
    # (amx_linear.c) q, N, K, q row stride, Kp, Np, bpack
    "intqat_amx_pack_bt": [_P, _I, _I, _I, _I, _I, _P],
    # q_x, q_x tail, M, lda, bpack, Kp, N, z_x, colsum, s_x, sx_stride, s_w, bias, y
    "intqat_amx_linear": [_P, _P, _I, _I, _P, _I, _I, ctypes.c_int32, _P, _P, _I, _P, _P, _P],
    # (int16_gemm.c) a, M, K, a_rs, a_cs, b, N, b_rs, b_cs, a pack, b pack, c
    "intqat_int16_gemm": [_P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _P, _P],
    # (grouped_linear.c) q_w, N, K, ldw, gs, Np, bp, cs
    "intqat_grouped_pack": [_P, _I, _I, _I, _I, _I, _P, _P],
    # q_x, M, K, ldx, bp, cs, swt, N, Np, gs, z, s_x, sx_stride, bias, y, ldy
    "intqat_grouped_linear_vnni": [_P, _I, _I, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int32, _P, _I, _P, _P, _I],
    # (amx_grouped.c) the same operands as intqat_grouped_linear_vnni
    "intqat_amx_grouped_linear": [_P, _I, _I, _I, _P, _P, _P, _I, _I, _I, ctypes.c_int32, _P, _I, _P, _P, _I],
    # q_x, M, K, ldx, wt, swt, N, Np, gs, z, s_x, sx_stride, bias, y, ldy
    "intqat_grouped_linear_f32": [_P, _I, _I, _I, _P, _P, _I, _I, _I, ctypes.c_int32, _P, _I, _P, _P, _I],
    # q_x, M, K, q_w, N, z_x, colsum, s_x, sx_stride, s_w, bias, a pack, b pack, y
    "intqat_int16_linear": [_P, _I, _I, _P, _I, ctypes.c_int32, _P, _P, _I, _P, _P, _P, _P, _P],
    # q_x, M, K, q_w, N, gs, z, swt, Np, s_x, sx_stride, bias, ap, bp, y
    "intqat_int16_linear_grouped": [_P, _I, _I, _P, _I, _I, ctypes.c_int32, _P, _I, _P, _I, _P, _P, _P, _P],
    # (depthwise_backward.c) g, g strides[4], q_x, x strides[4], z, s_x, q_w, s_w, geom[14], gx, gx strides, gw, gb
    "intqat_dw_backward": [_P, _P, _P, _P, ctypes.c_int32, _F, _P, _P, _P, _P, _P, _P, _P],
}

_RETURNS = {"intqat_dw_backward": ctypes.c_int}  # (every other function returns nothing)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_tried = False


_switch = OffSwitch()


# compiled together into one library
_SOURCES = ("fused.c", "amx_digits.c", "amx_linear.c", "int16_gemm.c", "grouped_linear.c", "amx_grouped.c",
            "depthwise_backward.c")


def _sources() -> list[Path]:
    return kernel_sources(_SOURCES)


def _build(srcs: list[Path]) -> Path:
    """Compile the fused C sources into the cache (once per source / flags / CPU) and return the .so path."""
    return build_library(srcs, compiler=os.environ.get("CC", "cc"), flag_sets=c_flag_sets(), prefix="fused",
                         link=["-lm"], announce=f"intqat: compiling the fused CPU kernels for this CPU into {cache_dir()} "
                                             "(once per machine, a few seconds)")


def _load() -> ctypes.CDLL | None:
    global _lib, _load_tried
    with _lock:
        if _load_tried:
            return _lib
        _load_tried = True
        if os.environ.get("INTQAT_CPU_KERNELS", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(_build(_sources())))
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, _RETURNS.get(name)
            _lib = lib
        except (OSError, RuntimeError, FileNotFoundError) as e:
            warnings.warn(
                f"intqat: fused CPU kernels unavailable, using the (slower, numerically identical) torch "
                f"path. Reason: {e}. Set INTQAT_CPU_KERNELS=0 to silence this.", RuntimeWarning, stacklevel=3)
        return _lib


_flags: dict[str, bool] = {}


def _library_says(symbol: str) -> bool:
    """The answer of one of the library's `int f(void)` capability probes (what it was built with, what the
    OS granted), asked once; False while the kernels are off."""
    if not available():
        return False
    if symbol not in _flags:
        fn = getattr(_lib, symbol)
        fn.restype = ctypes.c_int
        _flags[symbol] = bool(fn())
    return _flags[symbol]


def library_path() -> str:
    """The path of the loaded fused library (what the C++ training op links against)."""
    if not available():
        raise RuntimeError("the fused C kernels are not loaded")
    return _lib._name


def available() -> bool:
    """True when the fused kernels are built, loaded and not switched off by `disabled()`."""
    # once loaded, no lock and no call: this runs per dispatch (and must not break dynamo's graphs)
    return _switch.depth == 0 and (_lib is not None or (not _load_tried and _load() is not None))


def disabled_depth() -> int:
    """How many `disabled()` blocks are open (0: the kernels may run); part of dispatch's cache key."""
    return _switch.depth


def disabled():
    """Run the torch reference path inside the block (tests compare both paths)."""
    return _switch.off()


_scratch = threading.local()


def scratch(role: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A reused temporary of `shape`: a view of this thread's buffer for `role`, grown as needed.

    For values that die inside one op call (the int32 accumulator, the dequantized weight of the
    backward). On this VM a fresh multi-MB tensor costs page faults on first touch, more than the
    pass that fills it; reusing one buffer per role removes them. Never return a scratch view to a
    caller, and never hold two views of one role at once.
    """
    views = _scratch.__dict__.setdefault("views", {})
    view = views.get((role, dtype, shape))  # the same view again: no slice / view call per use
    if view is not None:
        return view
    bufs = _scratch.__dict__.setdefault("bufs", {})
    n = math.prod(shape)
    buf = bufs.get((role, dtype))
    # normal tensors even inside torch.inference_mode (a validation pass): they outlive the call, and a later call
    # outside it writes them in place, which torch refuses for an inference tensor or a view made in inference mode
    with torch.inference_mode(False):
        if buf is None or buf.numel() < n:
            buf = bufs[(role, dtype)] = torch.empty(n, dtype=dtype)
            for key in [k for k in views if k[:2] == (role, dtype)]:  # views of the old buffer: gone with it
                del views[key]
        if len(views) > 256:  # many shapes (a sweep): start over rather than grow without bound
            views.clear()
        view = views[(role, dtype, shape)] = buf[:n].view(shape)
    return view


def _round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`: the padded sizes the AMX kernels' tiles cover."""
    return -(-n // multiple) * multiple


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fp32_contiguous(t: Tensor) -> Tensor:
    """t as a contiguous fp32 tensor, without a call into torch when it already is one."""
    return t if (t.dtype is torch.float32 and t.is_contiguous()) else t.detach().to(torch.float32).contiguous()


def _dense(t: Tensor) -> bool:
    """Contiguous, or channels_last (4-D): one block of memory an elementwise pass can walk in order."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _float_rows(x: Tensor, rows_along: int | None) -> tuple[Tensor, int, int]:
    if rows_along is None:  # one scale for all: any dense layout, walked in memory order
        if x.dtype is not torch.float32:
            x = x.detach().to(torch.float32)  # .to keeps a dense layout
        if _dense(x):
            return x, 1, x.numel()
    x = _fp32_contiguous(x)
    rows = x.shape[0] if rows_along == 0 else max(1, x.numel() // max(1, x.shape[-1] if x.dim() else 1))
    cols = x.numel() // rows if rows else 0
    return x, rows, cols


def quantize_rows(
    x: Tensor, scale: Tensor, zero_point: float, qmin: int, qmax: int, per_row: bool,
    need_mask: bool = False, need_rowsum: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """x float (rows, ...) -> (codes int8 like x, mask bool like x or None, rowsum int32 (rows,) or None).

    per_row: scale has one value per x.shape[0] row (per output channel); else one value for all.
    """
    x, rows, cols = _float_rows(x, 0 if (per_row or need_rowsum) else None)
    s = _fp32_contiguous(scale)
    out = torch.empty_like(x, dtype=torch.int8)  # x's layout (channels_last stays channels_last)
    mask = torch.empty_like(x, dtype=torch.bool) if need_mask else None
    rowsum = torch.empty(rows, dtype=torch.int32) if need_rowsum else None
    if x.numel():
        _lib.intqat_quantize_rows(x.data_ptr(), rows, cols, s.data_ptr(), 1 if per_row else 0, float(zero_point),
                                  float(qmin), float(qmax), out.data_ptr(), _ptr(mask), _ptr(rowsum))
    elif rowsum is not None:
        rowsum.zero_()
    return out, mask, rowsum


def fake_quantize_rows(
    x: Tensor, scale: Tensor, zero_point: float, qmin: int, qmax: int, per_row: bool, need_mask: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """x float (rows, ...) -> (x_hat fp32 like x, clip mask bool like x or None), as quantize_rows."""
    x, rows, cols = _float_rows(x, 0 if per_row else None)
    s = _fp32_contiguous(scale)
    out = torch.empty_like(x, dtype=torch.float32)
    mask = torch.empty_like(x, dtype=torch.bool) if need_mask else None
    if x.numel():
        _lib.intqat_fake_quantize_rows(x.data_ptr(), rows, cols, s.data_ptr(), 1 if per_row else 0, float(zero_point),
                                       float(qmin), float(qmax), out.data_ptr(), _ptr(mask))
    return out, mask


def quantize_rows_dynamic(
    x: Tensor, qmin: int, qmax: int, eps: float, need_rowsum: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """x (M, K) float -> (codes int8 (M, K), scales fp32 (M, 1), rowsum int32 (M,) or None).

    s[m] = max(max|x[m]| / qmax, eps), z = 0: per-token activations, min-max per-channel weights.
    """
    x = _fp32_contiguous(x)
    M, K = x.shape
    out = torch.empty((M, K), dtype=torch.int8)
    scale = torch.empty((M, 1), dtype=torch.float32)
    rowsum = torch.empty(M, dtype=torch.int32) if need_rowsum else None
    if M:
        _lib.intqat_quantize_rows_dynamic(x.data_ptr(), M, K, float(qmin), float(qmax), float(eps),
                                          out.data_ptr(), scale.data_ptr(), _ptr(rowsum))
    return out, scale, rowsum


def mask_zero_bits_(g: Tensor, packed: Tensor) -> Tensor:
    """In place: g = where(unpack_bits(packed, g.shape), g, 0) for contiguous fp32 g, without the bool mask."""
    if g.dtype != torch.float32 or not g.is_contiguous() or packed.numel() != (g.numel() + 7) // 8:
        return g.copy_(torch.where(unpack_bits(packed, g.shape), g, 0.0))
    if g.numel():
        _lib.intqat_mask_zero_bits(g.data_ptr(), packed.contiguous().data_ptr(), g.numel())
    return g


def minmax(x: Tensor) -> tuple[float, float]:
    """(min, max) of a non-empty float tensor as Python floats, NaN if it holds a NaN (torch.aminmax's)."""
    x = _fp32_contiguous(x)
    out = torch.empty(2, dtype=torch.float32)
    _lib.intqat_minmax(x.data_ptr(), x.numel(), out.data_ptr())
    lo, hi = out.tolist()
    return lo, hi


def pack_bits(mask: Tensor) -> Tensor:
    """bool (...) -> uint8 (ceil(n / 8),): see intqat.ops.masks.pack_mask, the torch twin."""
    mask = mask.contiguous()
    out = torch.empty((mask.numel() + 7) // 8, dtype=torch.uint8)
    if mask.numel():
        _lib.intqat_pack_bits(mask.data_ptr(), mask.numel(), out.data_ptr())
    return out


def unpack_bits(packed: Tensor, shape) -> Tensor:
    """uint8 from pack_bits -> bool `shape`: see intqat.ops.masks.unpack_mask, the torch twin."""
    out = torch.empty(shape, dtype=torch.bool)
    if out.numel():
        _lib.intqat_unpack_bits(packed.contiguous().data_ptr(), out.numel(), out.data_ptr())
    return out


def epilogue(acc: Tensor, z_x: int, colsum: Tensor | None, s_x: Tensor, w_scale: Tensor,
             bias: Tensor | None) -> Tensor:
    """acc (M, N) int32 -> float32(acc - z_x * colsum[n]) * (s_x[m] * s_w[n]) + b[n], (M, N) fp32."""
    acc = acc.contiguous()
    M, N = acc.shape
    s_x = _fp32_contiguous(s_x)
    s_w = _fp32_contiguous(w_scale)
    b = None if bias is None else _fp32_contiguous(bias)
    cs = None if colsum is None else colsum.to(torch.int32).contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    if acc.numel():
        _lib.intqat_epilogue(acc.data_ptr(), M, N, int(z_x), _ptr(cs), s_x.data_ptr(), 1 if s_x.numel() > 1 else 0,
                             s_w.data_ptr(), _ptr(b), y.data_ptr())
    return y


def dequantize_rows(q: Tensor, scale: Tensor | None, zero_point: float, per_row: bool,
                    out: Tensor | None = None) -> Tensor:
    """q int8 (rows, ...) -> (float(q) - z) * scale (per row or one value); scale None: float(q).

    out: a contiguous fp32 tensor of q's shape to write into (e.g. a `scratch` buffer); without it the
    result has q's layout (channels_last stays channels_last, with one scale)."""
    if per_row or not _dense(q) or (out is not None and q.stride() != out.stride()):
        q = q.contiguous()
    rows = q.shape[0] if (per_row and q.dim()) else 1
    cols = q.numel() // rows if rows else 0
    s = None if scale is None else _fp32_contiguous(scale)
    if out is None:
        out = torch.empty_like(q, dtype=torch.float32)  # q's layout: memory order matches element for element
    if q.numel():
        _lib.intqat_dequantize_rows(q.data_ptr(), rows, cols, _ptr(s), 1 if per_row else 0, float(zero_point),
                                    out.data_ptr())
    return out


def split_digits(a: Tensor, col_scale: Tensor, need_rowsum: bool, digits: Tensor | None = None,
                 pad_rows: int = 1, pad_cols: int = 1) -> tuple[Tensor, Tensor, Tensor | None]:
    """a fp32 (R, C), any strides (a transposed view is gathered in blocks, no copy of a), col_scale
    (C,) or one value -> (digits int8 (3, Rp, Cp), shift int32 (R,), digit row sums int32 (3, R) or None).

    See intqat.ops.digit_gemm.split_digits, the torch twin. Rp, Cp: R, C rounded up to multiples of
    pad_rows, pad_cols, the padding zero digits (what the AMX kernel's tiles read). digits: an int8
    buffer of at least 3 * Rp * Cp elements to fill (a `scratch` view)."""
    R, C = a.shape
    Rp, Cp = _round_up(R, pad_rows), _round_up(C, pad_cols)
    if a.dtype != torch.float32:
        a = a.to(torch.float32)
    s = _fp32_contiguous(col_scale)
    digits = torch.empty((3, Rp, Cp), dtype=torch.int8) if digits is None else digits.view(3, Rp, Cp)
    if Rp > R:
        digits[:, R:].zero_()
    shift = torch.empty(R, dtype=torch.int32)
    rowsum = torch.empty((3, R), dtype=torch.int32) if need_rowsum else None
    if R:
        _lib.intqat_split_digits(a.data_ptr(), R, C, a.stride(0), a.stride(1), s.data_ptr(), 1 if s.numel() > 1 else 0,
                                 digits.data_ptr(), Cp, Rp * Cp, shift.data_ptr(), _ptr(rowsum))
    return digits, shift, rowsum


def combine_digits(acc: Tensor, shift: Tensor, rowsum: Tensor | None, z: int, mask: Tensor | None) -> Tensor:
    """acc int32 (3R, K) -> fp32 (R, K): see intqat.ops.digit_gemm.combine_digits, the torch twin."""
    acc = acc.contiguous()
    R, K = acc.shape[0] // 3, acc.shape[1]
    mask = None if mask is None else mask.contiguous()
    out = torch.empty((R, K), dtype=torch.float32)
    if out.numel():
        _lib.intqat_combine_digits(acc.data_ptr(), R, K, shift.data_ptr(), _ptr(rowsum), int(z), _ptr(mask),
                                   out.data_ptr())
    return out


# ---------------------------------------------------------------------------------------------
# The digit GEMM on AMX tiles (kernels/cpu/amx_digits.c)
# ---------------------------------------------------------------------------------------------

AMX_ROWS, AMX_COLS, AMX_DEPTH = 32, 32, 64  # output block, contraction step: what inputs pad to


def amx_available() -> bool:
    """The library is built with AMX and Linux granted this process the AMX state (asked once)."""
    return _library_says("intqat_amx_available")


def amx_digit_matmul(a: Tensor, col_scale: Tensor, q: Tensor, z: int, mask: Tensor | None) -> Tensor:
    """where(mask, (a * col_scale) @ (float(q) - z), 0): fp32 (R, K), the same bits as `split_digits`
    -> torch._int_mm -> `combine_digits`, with the three planes accumulated in AMX tiles and
    combined before anything is written (no (3R, K) int32 product). a fp32 (R, C) any strides,
    q int8 (C, K) with unit column stride, mask bool (R, K) or None. Call only if `amx_available()`."""
    R, C = a.shape
    K = q.shape[1]
    Kp = _round_up(K, AMX_COLS)
    digits, shift, rowsum = split_digits(a, col_scale, need_rowsum=bool(z), pad_rows=AMX_ROWS, pad_cols=AMX_DEPTH,
                                         digits=scratch("digits", (3 * _round_up(R, AMX_ROWS) * _round_up(C, AMX_DEPTH),),
                                                       torch.int8))
    ld = digits.shape[2]
    bpack = scratch("amx_b", (ld * Kp,), torch.int8)
    _lib.intqat_amx_pack_b(q.data_ptr(), C, K, q.stride(0), ld, Kp, bpack.data_ptr())
    mask = None if mask is None else mask.contiguous()
    out = torch.empty((R, K), dtype=torch.float32)
    _lib.intqat_amx_digit_gemm(digits.data_ptr(), R, ld, bpack.data_ptr(), K, shift.data_ptr(), _ptr(rowsum),
                               int(z), _ptr(mask), out.data_ptr())
    return out


def amx_linear(q_x: Tensor, q_w: Tensor, z_x: int, colsum: Tensor | None, s_x: Tensor, w_scale: Tensor,
               bias: Tensor | None) -> Tensor:
    """`epilogue(torch._int_mm(q_x, q_wᵀ), ...)` in one pass on AMX tiles: the same bits, no int32
    accumulator in memory. q_x int8 (M, K), q_w int8 (N, K), both row-major; s_x (M,) or one value;
    colsum (N,) int32 or None (no zero-point correction). Call only if `amx_available()`."""
    M, K = q_x.shape
    N = q_w.shape[0]
    Kp, Np = _round_up(K, AMX_DEPTH), _round_up(N, AMX_COLS)
    tail = None
    if Kp != K:  # tile rows are Kp bytes: copy into a padded buffer (its pad meets zero rows of B)
        a = scratch("amx_a", (_round_up(M, AMX_ROWS), Kp), torch.int8)
        a[:M, :K].copy_(q_x)
    else:
        a = q_x
        if M % AMX_ROWS:  # the last, partial row block is read from a 32-row copy, not past q_x's end
            tail = scratch("amx_a_tail", (AMX_ROWS, Kp), torch.int8)
            tail[: M % AMX_ROWS].copy_(q_x[M - M % AMX_ROWS:])
    bpack = scratch("amx_bt", (Np * Kp,), torch.int8)
    _lib.intqat_amx_pack_bt(q_w.data_ptr(), N, K, q_w.stride(0), Kp, Np, bpack.data_ptr())
    s_x = _fp32_contiguous(s_x)
    s_w = _fp32_contiguous(w_scale)
    b = None if bias is None else _fp32_contiguous(bias)
    cs = None if colsum is None else colsum.to(torch.int32).contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    _lib.intqat_amx_linear(a.data_ptr(), _ptr(tail), M, a.stride(0), bpack.data_ptr(), Kp, N, int(z_x), _ptr(cs),
                           s_x.data_ptr(), 1 if s_x.numel() > 1 else 0, s_w.data_ptr(), _ptr(b), y.data_ptr())
    return y


# ---------------------------------------------------------------------------------------------
# Exact int8 GEMMs through AVX2's int16 multiply-add (kernels/cpu/int16_gemm.c)
# ---------------------------------------------------------------------------------------------


def int16_gemm_available() -> bool:
    """The library is built with AVX2 (vpmaddwd)."""
    return _library_says("intqat_int16_gemm_available")


def int16_gemm(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32, exact, any strides, K <= MAX_K_INT32 (the
    caller's bound). Call only if `int16_gemm_available()`."""
    M, K = a.shape
    N = b.shape[1]
    kp = K + (K & 1)
    ap = scratch("int16_a", (_round_up(M, 12) * kp,), torch.int16)
    bp = scratch("int16_b", (_round_up(N, 16) * kp,), torch.int16)
    c = torch.empty((M, N), dtype=torch.int32)
    if M and N:
        _lib.intqat_int16_gemm(a.data_ptr(), M, K, a.stride(0), a.stride(1), b.data_ptr(), N, b.stride(0), b.stride(1),
                               ap.data_ptr(), bp.data_ptr(), c.data_ptr())
    return c


def int16_linear(q_x: Tensor, q_w: Tensor, z_x: int, colsum: Tensor | None, s_x: Tensor, w_scale: Tensor,
                 bias: Tensor | None) -> Tensor:
    """`epilogue(int16_gemm(q_x, q_wᵀ), ...)` in one pass: the same bits, no int32 accumulator in memory.
    q_x (M, K), q_w (N, K) row-major int8, K <= MAX_K_INT32; s_x (M,) or one value; colsum (N,) int32 or
    None (no zero-point correction). Call only if `int16_gemm_available()`."""
    M, K = q_x.shape
    N = q_w.shape[0]
    kp = K + (K & 1)
    ap = scratch("int16_a", (_round_up(M, 12) * kp,), torch.int16)
    bp = scratch("int16_b", (_round_up(N, 16) * kp,), torch.int16)
    s_x = _fp32_contiguous(s_x)
    s_w = _fp32_contiguous(w_scale)
    b = None if bias is None else _fp32_contiguous(bias)
    cs = None if colsum is None else colsum.to(torch.int32).contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    if M and N:
        _lib.intqat_int16_linear(q_x.data_ptr(), M, K, q_w.data_ptr(), N, int(z_x), _ptr(cs), s_x.data_ptr(),
                                 1 if s_x.numel() > 1 else 0, s_w.data_ptr(), _ptr(b), ap.data_ptr(), bp.data_ptr(),
                                 y.data_ptr())
    return y


def int16_linear_grouped(q_x: Tensor, q_w: Tensor, s_w: Tensor, z: int, s_x: Tensor, bias: Tensor | None) -> Tensor:
    """The per-group forward (`grouped_reference`'s bits) on AVX2's vpmaddwd: each group's exact int32 sum
    in registers, scaled and added in the K loop (kernels/cpu/int16_gemm.c). q_x (M, K), q_w (N, K) int8,
    s_w (N, G) with an even group size K / G; s_x (M, 1) or one value. Call only if `int16_gemm_available()`."""
    M, K = q_x.shape
    N, G = s_w.shape
    q_x, q_w = q_x.contiguous(), q_w.contiguous()
    Np = _round_up(N, 16)
    swt = torch.zeros(G, Np, dtype=torch.float32)
    swt[:, :N] = s_w.detach().t()
    s_x = _fp32_contiguous(s_x)
    b = None if bias is None else _fp32_contiguous(bias)
    ap = scratch("int16_a", (_round_up(M, 12) * K,), torch.int16)
    bp = scratch("int16_b", (Np * K,), torch.int16)
    y = torch.empty((M, N), dtype=torch.float32)
    if M and N:
        _lib.intqat_int16_linear_grouped(q_x.data_ptr(), M, K, q_w.data_ptr(), N, K // G, int(z), swt.data_ptr(), Np,
                                         s_x.data_ptr(), 1 if s_x.numel() > 1 else 0, _ptr(b), ap.data_ptr(),
                                         bp.data_ptr(), y.data_ptr())
    return y


# ---------------------------------------------------------------------------------------------
# The per-group integer linear (kernels/cpu/grouped_linear.c; formulas in intqat/ops/int_linear_grouped.py)
# ---------------------------------------------------------------------------------------------


def amx_grouped_available() -> bool:
    """The library's per-group AMX kernel was built and Linux granted this process the AMX state."""
    return _library_says("intqat_amx_grouped_available")


def grouped_vnni_available() -> bool:
    """The library's per-group kernel was built with AVX512-VNNI."""
    return _library_says("intqat_grouped_has_vnni")


def grouped_linear(q_x: Tensor, q_w: Tensor, s_w: Tensor, z: int, s_x: Tensor, bias: Tensor | None,
                   fp32_codes: bool, amx: bool = False) -> Tensor:
    """y (M, N) of the per-group integer linear, the same bits as `grouped_reference`. fp32_codes: the
    kernel for CPUs without int8 dot products (exact fp32 multiply-adds of the codes); amx: the AMX tile kernel
    (kernels/cpu/amx_grouped.c; call only if `amx_grouped_available()`); else VNNI (call only if
    `grouped_vnni_available()`). The int8 kernels need a group size that is a multiple of 4."""
    M, K = q_x.shape
    N, G = s_w.shape
    gs = K // G
    q_x, q_w = q_x.contiguous(), q_w.contiguous()
    s_x = s_x.detach().to(torch.float32).contiguous()
    bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    y = torch.empty(M, N, dtype=torch.float32)
    sx_stride = 0 if s_x.numel() == 1 else 1
    if M == 0 or N == 0:
        return y
    if not fp32_codes:  # both int8 kernels take the same packed operands (grouped_linear.c's pack)
        Np = -(-N // 32) * 32
        bp = torch.empty(Np * K, dtype=torch.int8)
        cs = torch.empty(G, Np, dtype=torch.int32)
        _lib.intqat_grouped_pack(q_w.data_ptr(), N, K, K, gs, Np, bp.data_ptr(), cs.data_ptr())
        swt = torch.zeros(G, Np, dtype=torch.float32)
        swt[:, :N] = s_w.detach().t()
        kernel = _lib.intqat_amx_grouped_linear if amx else _lib.intqat_grouped_linear_vnni
        kernel(q_x.data_ptr(), M, K, K, bp.data_ptr(), cs.data_ptr(), swt.data_ptr(), N, Np, gs, z, s_x.data_ptr(),
               sx_stride, _ptr(bias), y.data_ptr(), N)
    else:
        Np = -(-N // 64) * 64
        # (K, Np) fp32 codes: transposed as int8 first (1 byte an element moved, not 4), then widened;
        # padded columns are zeros (3.8x faster than writing the strided transpose into fp32 at 1024^2)
        wt = F.pad(q_w.t().contiguous(), (0, Np - N)).to(torch.float32)
        swt = torch.zeros(G, Np, dtype=torch.float32)
        swt[:, :N] = s_w.detach().t()
        _lib.intqat_grouped_linear_f32(q_x.data_ptr(), M, K, K, wt.data_ptr(), swt.data_ptr(), N, Np, gs, z,
                                       s_x.data_ptr(), sx_stride, _ptr(bias), y.data_ptr(), N)
    return y


# ---------------------------------------------------------------------------------------------
# The depthwise conv's STE backward (kernels/cpu/depthwise_backward.c): groups == C == O, by channel blocks


def _geometry(B, C, H, W, kh, kw, stride, padding, dilation) -> tuple[Tensor, int, int]:
    Ho = (H + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (W + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    geom = torch.tensor([B, C, H, W, kh, kw, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
                         Ho, Wo], dtype=torch.int64)
    return geom, Ho, Wo


def _strides(t: Tensor) -> Tensor:
    return torch.tensor(t.stride(), dtype=torch.int64)


def _like_layout(shape, like: Tensor) -> Tensor:
    """An fp32 tensor of `shape` (4-D) in like's memory format (channels_last stays channels_last)."""
    channels_last = like.is_contiguous(memory_format=torch.channels_last) and not like.is_contiguous()
    return torch.empty(shape, dtype=torch.float32,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def depthwise_backward(g: Tensor, q_x: Tensor, z: int, s_x: float, q_w: Tensor, s_w: Tensor, stride, padding,
                       dilation, need_x: bool, need_w: bool, need_b: bool
                       ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The straight-through gradients of a depthwise conv (x_hat = (q_x - z) s_x, w_hat = q_w s_w[c]), unmasked:
    grad_x (B, C, H, W) in q_x's memory format, grad_w (C, 1, kh, kw), grad_b (C,); each None where not asked.
    g fp32 (B, C, Ho, Wo) any strides. fp32 sums in depthwise_backward.c's fixed order (independent of threads and vector width)."""
    B, C, H, W = q_x.shape
    kh, kw = q_w.shape[2], q_w.shape[3]
    geom, _, _ = _geometry(B, C, H, W, kh, kw, stride, padding, dilation)
    g = g if g.dtype is torch.float32 else g.to(torch.float32)
    q_w = q_w.contiguous()
    s_w = _fp32_contiguous(s_w.reshape(-1))
    gx = _like_layout((B, C, H, W), q_x) if need_x else None
    gw = torch.empty(q_w.shape, dtype=torch.float32) if need_w else None
    gb = torch.empty(C, dtype=torch.float32) if need_b else None
    if B * C == 0 or g.numel() == 0:  # nothing to sum: zeros (an empty batch still has weight gradients)
        return (None if gx is None else gx.zero_(), None if gw is None else gw.zero_(),
                None if gb is None else gb.zero_())
    gs, xs = _strides(g), _strides(q_x)  # (named: a temporary's memory would be freed before the call)
    gxs = None if gx is None else _strides(gx)
    if _lib.intqat_dw_backward(g.data_ptr(), gs.data_ptr(), q_x.data_ptr(), xs.data_ptr(), int(z), float(s_x),
                               q_w.data_ptr(), s_w.data_ptr(), geom.data_ptr(), _ptr(gx), _ptr(gxs), _ptr(gw), _ptr(gb)):
        raise MemoryError(f"intqat: the depthwise backward could not allocate its per-thread buffers (input {tuple(q_x.shape)}, "
                          f"kernel {tuple(q_w.shape[2:])})")
    return gx, gw, gb
