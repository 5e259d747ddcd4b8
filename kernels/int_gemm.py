"""int8 x int8 -> int32 GEMM with the integer-linear epilogue of docs/numerics.md.

One kernel serves four ops; a constexpr picks the epilogue:

    "none"        c = a @ b                                   int32   (int_mm)
    "zero_point"  acc = a @ b - z_x[m] * colsum[n]            int32   (int_linear_accumulator)
    "float"       y = float32(acc) * (s_x[m] * s_w[n]) + b[n] fp32 / bf16 / fp16
    "int8"        q = clamp(nearbyint(y * inv_s_out) + z_out, qmin, qmax)   int8

The linear ops read q_w (N, K) through its strides as b = q_wᵀ (K, N): no copy. Per-tensor
vectors (scale / zero point of shape (1,)) are read with stride 0, per-row ones with their
own stride, so one code path covers both. int32 accumulation is exact while the true
|acc| < 2^31 (docs/numerics.md: K <= 131071 for int8 codes); beyond, the interpreter wraps like
torch._int_mm, while on a GPU Triton's int8 mma.sync (sm_80) saturates (satfinite, in its PTX).
"""

from __future__ import annotations

import contextvars
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton
from triton.language.extra import libdevice

_FLOAT_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)  # zero points, column sums


# GPU configs, checked by `intqat-bench kernels` (ptxas for sm_80 and sm_90, no GPU needed): each
# compiles without spills for every epilogue and holds int8 tensor-core instructions (IMMA on
# sm_80; IGMMA = wgmma on sm_90 where BLOCK_M >= 64). int8 tensor-core dots need BLOCK_K >= 32.
# Triton specializes on 16-byte alignment, and the cubins differ: aligned operands load in vectors
# through cp.async; ragged ones (K or N not a multiple of 16) load bytewise, their pipeline staged in
# registers, so they get smaller tiles.
ALIGNED_CONFIGS = [
    # dropped: 128x256x64 w8 s3. Its 128-register int32 accumulator plus the float epilogue needs
    # more than 255 registers: spilled 632 B on sm_80 (every epilogue) and 252 B on sm_90 (+bias).
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),  # 242-244 regs sm_80
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),  # up to 254 regs sm_80
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_stages=3, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_stages=4, num_warps=4),  # IMMA on sm_90 too
]
RAGGED_CONFIGS = [
    # every aligned config above spills on ragged operands (24-960 B, e.g. 128x64x64 w4 s3: 960 B
    # on sm_90; 64x128x64 w4 s3: 844 B on sm_90); these two do not, on either arch.
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8}, num_stages=3, num_warps=4),
]


def gpu_configs() -> list[triton.Config]:
    """Every GPU autotune config, whatever TRITON_INTERPRET says (the aligned ones, then the ragged)."""
    return ALIGNED_CONFIGS + RAGGED_CONFIGS


def is_aligned(tensors) -> bool:
    """True when Triton specializes every one of these 2-D tensors as 16-aligned: base address
    and every stride other than 1 divisible by 16. False also where that cannot be read (fake
    tensors): the ragged configs are safe everywhere, only slower."""
    try:
        return all(t.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in t.stride() if st != 1) for t in tensors)
    except (RuntimeError, NotImplementedError):
        return False


def alignment_pruner(aligned: list, ragged: list, operands: tuple[str, ...]) -> Callable:
    """An early_config_prune for triton.autotune: the aligned or the ragged configs, from the
    alignment of the launch's main operands (named args). The interpreter's config passes through."""

    def prune(configs, named_args, **kwargs):
        if triton.knobs.runtime.interpret:
            return configs
        chosen = aligned if is_aligned([named_args[name] for name in operands]) else ragged
        return [c for c in configs if any(c is x for x in chosen)]

    return prune


prune_configs = alignment_pruner(ALIGNED_CONFIGS, RAGGED_CONFIGS, ("a_ptr", "b_ptr"))


def get_autotune_config() -> list[triton.Config]:
    if triton.knobs.runtime.interpret:
        # The interpreter runs one program at a time in numpy: one config (no benchmarking),
        # tiles big enough to keep the program count low.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4})]
    return gpu_configs()


# ---------------------------------------------------------------------------------------------
# Device helpers, shared with ste_backward.py. libdevice.rint is not available in the
# interpreter, so rounding is spelled out with operations every backend has, exactly.
# ---------------------------------------------------------------------------------------------


@triton.jit
def round_half_even(x):
    # nearbyint(x) (round half to even) for fp32 x, bit-exact, = torch.round.
    # |x| >= 2^23 is already an integer; below, t = trunc(|x|) fits int32 and
    # f = |x| - t is exact, so the tie test f == 0.5 is exact too.
    a = tl.abs(x)
    a_small = tl.minimum(a, 8388608.0)
    t = a_small.to(tl.int32)
    f = a_small - t.to(tl.float32)
    up = (f > 0.5) | ((f == 0.5) & ((t & 1) == 1))
    r = (t + up.to(tl.int32)).to(tl.float32)
    r = tl.where(x < 0, -r, r)
    return tl.where(a < 8388608.0, r, x)  # also passes inf / nan through


# mul_rn(x, y): the fp32 product, rounded once and never fused with a following add. docs/numerics.md
# rounds each epilogue step separately; on a GPU, Triton's default fp fusion would contract
# `float(acc) * scale + bias` into one fma (one rounding: other bits than the CPU path, seen in
# the PTX as fma.rn.f32). PTX mul.rn (libdevice mul_rn) is never contracted. The interpreter's
# numpy multiply rounds once and fuses nothing, and it has no libdevice.
if triton.knobs.runtime.interpret:

    @triton.jit
    def mul_rn(x, y):
        return x * y

else:

    @triton.jit
    def mul_rn(x, y):
        return libdevice.mul_rn(x, y)


@triton.jit
def to_bfloat16_rtne(x):
    # fp32 -> bf16 rounding to nearest even (torch's .to(torch.bfloat16)), the same on GPU and
    # in the interpreter (whose own cast truncates): round the bits, then the cast is exact.
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
    rounded = bits.to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded).to(tl.bfloat16)


@triton.autotune(configs=get_autotune_config(), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": prune_configs})
@triton.jit
def _int_gemm_kernel(
    # pointers
    a_ptr,  # (M, K) int8
    b_ptr,  # (K, N) int8 (q_wᵀ for the linear ops)
    c_ptr,  # (M, N) int32 / fp32 / bf16 / fp16 / int8
    x_zero_point_ptr,  # (1,) or (M,) int32   [EPILOGUE != "none"]
    w_colsum_ptr,  # (N,) int32               [EPILOGUE != "none"]
    x_scale_ptr,  # (1,) or (M,) fp32         [float / int8]
    w_scale_ptr,  # (N,) fp32                 [float / int8]
    bias_ptr,  # (N,) float or None           [float / int8]
    out_inv_scale_ptr,  # (1,) fp32           [int8]
    out_zero_point_ptr,  # (1,) int32         [int8]
    # sizes
    M,
    N,
    K,
    # strides (vector strides are 0 for a per-tensor value)
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_xzp,
    stride_colsum,
    stride_xs,
    stride_ws,
    stride_bias,
    # requantization range
    out_qmin,
    out_qmax,
    # meta-parameters
    EPILOGUE: tl.constexpr,  # "none" | "zero_point" | "float" | "int8"
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped ordering: GROUP_M row-blocks share the same b columns while they are in L2.
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # int64 offsets: M * stride_am may exceed 2^31 for large activations.
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)

    # acc[m, n] = sum_k a[m, k] * b[k, n]      int32, exact
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if EPILOGUE != "none":
        # acc[m, n] -= z_x[m] * colsum_k(q_w)[n]      int32, exact (wraps like the CPU path)
        x_zero_point = tl.load(x_zero_point_ptr + offs_m * stride_xzp, mask=mask_m, other=0).to(tl.int32)
        w_colsum = tl.load(w_colsum_ptr + offs_n * stride_colsum, mask=mask_n, other=0).to(tl.int32)
        acc = acc - x_zero_point[:, None] * w_colsum[None, :]

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask_c = mask_m[:, None] & mask_n[None, :]
    if EPILOGUE == "none" or EPILOGUE == "zero_point":
        tl.store(c_ptrs, acc, mask=mask_c)
    else:
        # y[m, n] = float32(acc[m, n]) * (s_x[m] * s_w[n]) + bias[n]     one rounding per step
        x_scale = tl.load(x_scale_ptr + offs_m * stride_xs, mask=mask_m, other=0.0)
        w_scale = tl.load(w_scale_ptr + offs_n * stride_ws, mask=mask_n, other=0.0)
        y = mul_rn(acc.to(tl.float32), x_scale[:, None] * w_scale[None, :])  # not fused with + bias
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
            y = y + bias[None, :]
        if EPILOGUE == "float":
            if c_ptr.dtype.element_ty == tl.bfloat16:
                tl.store(c_ptrs, to_bfloat16_rtne(y), mask=mask_c)
            else:
                tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=mask_c)
        else:
            # q = clamp(nearbyint(y * inv_s_out) + z_out, qmin, qmax)
            # v is clamped to [qmin - z - 1, qmax - z + 1] first: same q, and the int
            # conversion below stays in range whatever y is.
            out_inv_scale = tl.load(out_inv_scale_ptr)
            out_zero_point = tl.load(out_zero_point_ptr).to(tl.int32)
            lo = (out_qmin - out_zero_point - 1).to(tl.float32)
            hi = (out_qmax - out_zero_point + 1).to(tl.float32)
            v = tl.minimum(tl.maximum(y * out_inv_scale, lo), hi)
            q = round_half_even(v).to(tl.int32) + out_zero_point
            q = tl.minimum(tl.maximum(q, out_qmin), out_qmax)
            tl.store(c_ptrs, q.to(tl.int8), mask=mask_c)


# ---------------------------------------------------------------------------------------------
# Host helpers: input checks raise ValueError naming shapes and dtypes.
# ---------------------------------------------------------------------------------------------


def vector_stride(t: Optional[Tensor]) -> int:
    # A (1,) vector is broadcast over its axis: stride 0. None -> unused, any value.
    if t is None or t.numel() == 1:
        return 0
    return t.stride(0)


def check_matrix(name: str, t: Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != 2 or t.dtype not in dtypes:
        raise ValueError(
            f"{name} must be a 2-D tensor of {' / '.join(map(str, dtypes))}, got shape {tuple(t.shape)} {t.dtype}"
        )


def check_vector(name: str, t: Tensor, lengths: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, Tensor) or t.dim() > 1 or t.numel() not in lengths or t.dtype not in dtypes:
        got = f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        want = " or ".join(f"({n},)" for n in dict.fromkeys(lengths))
        raise ValueError(f"{name} must be a {want} tensor of {' / '.join(map(str, dtypes))}, got {got}")


def check_same_device(**tensors: Optional[Tensor]) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


# Under TRITON_INTERPRET=1, wrap_triton hands kernels back unwrapped (torch cannot trace the
# interpreter's kernels), so triton_op's fake impl and its decomposition under torch.compile
# would run them on fake tensors. There each launcher becomes an opaque custom op instead,
# whose fake impl is the same function with the launches skipped.
_launches_skipped = contextvars.ContextVar("intqat_kernel_launches_skipped", default=False)


def launches_skipped() -> bool:
    """True while a launcher runs as its own fake impl: allocate outputs, launch nothing."""
    return _launches_skipped.get()


def kernel_op(name: str) -> Callable:
    """``torch.library.triton_op(name, mutates_args={})``; an opaque custom op when interpreting."""

    def register(fn: Callable):
        if not triton.knobs.runtime.interpret:
            return triton_op(name, fn, mutates_args={})
        op = torch.library.custom_op(name, fn, mutates_args=())

        @op.register_fake
        def _(*args, **kwargs):
            token = _launches_skipped.set(True)
            try:
                return fn(*args, **kwargs)
            finally:
                _launches_skipped.reset(token)

        return op

    return register


def gemm_launch_args(a, b, c, epilogue, *, x_zero_point=None, w_colsum=None, x_scale=None, w_scale=None,
                     bias=None, out_inv_scale=None, out_zero_point=None, out_qmin=-128,
                     out_qmax=127) -> tuple[tuple, dict]:
    """(positional args, constexpr kwargs) of one _int_gemm_kernel launch; the autotuner adds
    the config's. Shared with `intqat-bench kernels`, which compiles the kernel for these."""
    M, K = a.shape
    N = b.shape[1]
    args = (
        a, b, c,
        x_zero_point, w_colsum, x_scale, w_scale, bias, out_inv_scale, out_zero_point,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        vector_stride(x_zero_point), vector_stride(w_colsum), vector_stride(x_scale),
        vector_stride(w_scale), vector_stride(bias),
        out_qmin, out_qmax,
    )
    return args, {"EPILOGUE": epilogue, "HAS_BIAS": bias is not None}


def _launch(a, b, c, epilogue, **vectors):
    M, N = a.shape[0], b.shape[1]
    if launches_skipped():
        return c

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    args, constexprs = gemm_launch_args(a, b, c, epilogue, **vectors)
    wrap_triton(_int_gemm_kernel)[grid](*args, **constexprs)
    return c


def _check_linear_operands(q_x: Tensor, q_w: Tensor) -> tuple[int, int, int]:
    check_matrix("q_x", q_x, (torch.int8,))
    check_matrix("q_w", q_w, (torch.int8,))
    if q_x.shape[1] != q_w.shape[1]:
        raise ValueError(
            f"q_x (M, K) and q_w (N, K) must share K, got q_x {tuple(q_x.shape)} and q_w {tuple(q_w.shape)}"
        )
    return q_x.shape[0], q_w.shape[0], q_x.shape[1]


@kernel_op("intqat::int_mm")
def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """Exact int8 (M, K) @ int8 (K, N) -> int32 (M, N), any strides (= torch._int_mm)."""
    check_matrix("a", a, (torch.int8,))
    check_matrix("b", b, (torch.int8,))
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a (M, K) @ b (K, N) needs matching K, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    check_same_device(a=a, b=b)
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=torch.int32, device=a.device)
    c = torch.empty((M, N), dtype=torch.int32, device=a.device)
    return _launch(a, b, c, "none")


@kernel_op("intqat::int_linear_accumulator")
def int_linear_accumulator(q_x: Tensor, q_w: Tensor, x_zero_point: Tensor, w_colsum: Tensor) -> Tensor:
    """acc[m, n] = sum_k q_x[m, k] * q_w[n, k] - z_x[m] * w_colsum[n], int32 (M, N), exact."""
    M, N, K = _check_linear_operands(q_x, q_w)
    check_vector("x_zero_point", x_zero_point, (1, M), _INT_DTYPES)
    check_vector("w_colsum", w_colsum, (N,), _INT_DTYPES)
    check_same_device(q_x=q_x, q_w=q_w, x_zero_point=x_zero_point, w_colsum=w_colsum)
    c = torch.empty((M, N), dtype=torch.int32, device=q_x.device)
    if M == 0 or N == 0:
        return c
    return _launch(q_x, q_w.t(), c, "zero_point", x_zero_point=x_zero_point, w_colsum=w_colsum)


@kernel_op("intqat::int_linear_forward")
def int_linear_forward(
    q_x: Tensor,
    q_w: Tensor,
    x_scale: Tensor,
    x_zero_point: Tensor,
    w_scale: Tensor,
    w_colsum: Tensor,
    bias: Optional[Tensor],
    out_dtype: torch.dtype = torch.float32,
    out_scale: Optional[Tensor] = None,
    out_zero_point: Optional[Tensor] = None,
    out_qmin: int = -128,
    out_qmax: int = 127,
) -> Tensor:
    """Integer linear forward, docs/numerics.md "Integer linear":

        acc = q_x @ q_wᵀ - z_x[:, None] * w_colsum[None, :]          int32, exact
        y   = float32(acc) * (x_scale[:, None] * w_scale[None, :]) + bias

    y is returned as out_dtype (fp32 / bf16 / fp16, round to nearest even), or, for
    out_dtype=torch.int8, requantized: clamp(nearbyint(y * float32(1 / out_scale)) +
    out_zero_point, out_qmin, out_qmax). x_scale / x_zero_point are (1,) per tensor or
    (M,) per row; out_scale (1,) fp32 and out_zero_point (1,) int32 are tensors.
    """
    M, N, K = _check_linear_operands(q_x, q_w)
    check_vector("x_zero_point", x_zero_point, (1, M), _INT_DTYPES)
    check_vector("w_colsum", w_colsum, (N,), _INT_DTYPES)
    check_vector("x_scale", x_scale, (1, M), (torch.float32,))
    check_vector("w_scale", w_scale, (N,), (torch.float32,))
    if bias is not None:
        check_vector("bias", bias, (N,), _FLOAT_OUT_DTYPES)
    check_same_device(q_x=q_x, q_w=q_w, x_scale=x_scale, x_zero_point=x_zero_point, w_scale=w_scale,
                      w_colsum=w_colsum, bias=bias, out_scale=out_scale, out_zero_point=out_zero_point)

    out_inv_scale = None
    if out_dtype == torch.int8:
        if out_scale is None or out_zero_point is None:
            raise ValueError("out_dtype=torch.int8 needs out_scale (1,) float32 and out_zero_point (1,) int32 tensors")
        check_vector("out_scale", out_scale, (1,), (torch.float32,))
        check_vector("out_zero_point", out_zero_point, (1,), _INT_DTYPES)
        if not -128 <= out_qmin <= out_qmax <= 127:
            raise ValueError(f"need -128 <= out_qmin <= out_qmax <= 127, got out_qmin={out_qmin}, out_qmax={out_qmax}")
        # inv_s = float32(1 / s), computed once; the kernel multiplies (docs/numerics.md).
        out_inv_scale = torch.reciprocal(out_scale.reshape(1))
    elif out_dtype not in _FLOAT_OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.float32, bfloat16, float16 or int8, got {out_dtype}")

    c = torch.empty((M, N), dtype=out_dtype, device=q_x.device)
    if M == 0 or N == 0:
        return c
    return _launch(
        q_x, q_w.t(), c, "int8" if out_dtype == torch.int8 else "float",
        x_zero_point=x_zero_point, w_colsum=w_colsum, x_scale=x_scale, w_scale=w_scale, bias=bias,
        out_inv_scale=out_inv_scale, out_zero_point=out_zero_point, out_qmin=out_qmin, out_qmax=out_qmax,
    )

