"""The eager CPU training step of integer layers in C++: `int_linear`'s and `int_conv2d`'s forward and
backward as one autograd op each (kernels/cpu/train_linear.cpp, train_conv.cpp), and the static activation
observer's update before them as one call (kernels/cpu/observe.cpp).

Why: the Python path runs ~12 small steps per integer linear layer and call (backend choices, three C
passes, an autograd.Function, a mask pack; in the backward a split, a GEMM and a combine twice): ~0.15 ms of
interpreter and dispatch per layer and step, measured at every size (~0.3 ms per conv), and the observer
~18 us more. A BERT-tiny layer's whole fp32 step is 0.2-0.5 ms at 2 threads, so that overhead decided
whether an integer transformer block trained faster than fp32. The C++ ops run the same kernels (the fused
C library, linked by path) and the same aten calls in one call forward and one autograd node backward:
same bits, ~5 us overhead.

When the linear op runs (`plan`): eager calls on plain CPU tensors, with no learned (LSQ) scales, where the
backend table would run the forward GEMM on `cpu_fused` (torch._int_mm: CPUs with int8 dot products) or
`avx2_int16` (vpmaddwd: AVX2 CPUs without them) and every other primitive of the step on `cpu_fused`.
The conv op (`conv_plan`): the same, static activations, its GEMM on `cpu_fused` (groups == 1) or none
(grouped / depthwise convs: an exact fp32 conv of the codes, every CPU). Anything else (tracing, CUDA,
LSQ, the amx backend's large layers, a forced backend whose kernels the op does not call) takes the Python
path, which computes the same numbers. The observer op runs where the observer's own Python scalar path
would, with `minmax` on `cpu_fused` (`ActivationQuantizer.integer_input`). INTQAT_CPP_STEP=0 turns them all
off (tests compare both ways); a build failure (no C++ compiler, no torch headers) warns once and keeps
the Python paths.

The library is compiled on first use (~25 s, `$CXX`, default `c++`) against torch's headers into the
kernels' cache dir, keyed like the C library (`cpu_kernels.build_library`).
"""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from intqat.ops import backends, cpu_kernels
from intqat.ops.digit_gemm import digits_pay
from intqat.ops.qparams import SCALE_EPS

__all__ = ["RECORDED_AS", "available", "unavailable_reason", "disabled", "plan", "run", "conv_plan", "run_conv",
           "observe_minmax_"]

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_reason: str | None = None  # why it is not available (None: it is, or not tried)
_switch = cpu_kernels.OffSwitch()


def _sources() -> list[Path]:
    spec = importlib.util.find_spec("intqat.kernels")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package intqat.kernels not found")
    root = Path(next(iter(spec.submodule_search_locations))) / "cpu"
    return [root / "train_linear.cpp", root / "train_conv.cpp", root / "observe.cpp"]


def _build_and_load() -> None:
    global _loaded
    from torch.utils import cpp_extension  # (imports setuptools: only when the op is first needed)

    torch_lib = Path(torch.__file__).parent / "lib"
    flags = ["-O2", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    # the fused C library by its path: the loader finds the copy intqat.ops.cpu_kernels already loaded
    link = [cpu_kernels.library_path(), f"-L{torch_lib}", "-ltorch_cpu", "-lc10"]
    path = cpu_kernels.build_library(_sources(), compiler=os.environ.get("CXX", "c++"), flag_sets=[flags],
                                     prefix="train_step", link=link,
                                     announce="intqat: compiling the C++ training ops against this torch (once per "
                                              "machine and torch version, ~25 s)")
    torch.ops.load_library(str(path))
    _loaded = True


def _load() -> bool:
    global _loaded, _reason
    with _lock:
        if _loaded is None:
            _loaded = False
            if os.environ.get("INTQAT_CPP_STEP", "1") == "0":
                _reason = "switched off (INTQAT_CPP_STEP=0)"
            elif not cpu_kernels.available():
                _reason = "the fused C kernels are not built"
            else:
                try:
                    _build_and_load()
                except (OSError, RuntimeError, FileNotFoundError, ImportError) as e:
                    _reason = f"the C++ build failed: {str(e)[-300:]}"
                    warnings.warn(
                        "intqat: the C++ training ops (kernels/cpu/train_*.cpp, observe.cpp) are unavailable; "
                        "integer layers keep the Python path (same numbers, ~0.15 ms more per layer and step). "
                        f"Reason: {_reason}. Set INTQAT_CPP_STEP=0 to silence this.", RuntimeWarning, stacklevel=4)
        return _loaded


def available() -> bool:
    """Are the C++ ops built, loaded and not switched off (by `disabled()` / INTQAT_CPP_STEP=0)?"""
    return _switch.depth == 0 and (_loaded if _loaded is not None else _load())


def unavailable_reason() -> str | None:
    """Why the C++ ops do not run here (None: they do, where `plan` / `conv_plan` allow)."""
    return None if available() else (_reason or "disabled in this block")


def disabled():
    """Run the Python paths (int_linear, int_conv2d, the observer) inside the block (tests compare both)."""
    return _switch.off()


RECORDED_AS = "cpp_step"  # what `backends.recording()` counts per call of a C++ step op, beside its primitives
_GEMMS = {"cpu_fused": 0, "avx2_int16": 1}  # the forward GEMM the op can run: torch._int_mm, AVX2 vpmaddwd
_plans: dict[tuple, tuple | None] = {}


def plan(M: int, K: int, N: int, x_dynamic: bool, w_scale_given: bool, w_mask: bool, grad_gemm: str) -> tuple | None:
    """(gemm, digits_x, digits_w, ran) when the C++ op may run this call, else None.

    Decided once per shape and setting (and per forced backend / kernels switch): the op may run when
    the backend table would put the forward GEMM on cpu_fused (torch._int_mm) or avx2_int16, and every
    other primitive of the step on cpu_fused: the kernels the op calls. `ran`: (primitive, backend) per
    primitive one step runs, recorded per call as the backend table records the Python path's
    (`intqat.ops.backends.recording`). The caller has checked the tensors (plain CPU, nothing tracing,
    no learned scales).
    """
    if not available():
        return None
    key = (M, K, N, x_dynamic, w_scale_given, w_mask, grad_gemm, backends.forced(), cpu_kernels.disabled_depth())
    if key in _plans:
        return _plans[key]
    result = None
    if M and K and N and max(M, K, N) <= backends.MAX_K_INT32:
        digits_x = grad_gemm == "int8x3" and digits_pay(M, K, N, grad="x")
        digits_w = grad_gemm == "int8x3" and digits_pay(M, K, N, grad="w")
        x_mask = not x_dynamic
        steps = ["quantize_rows_dynamic" if x_dynamic else "quantize_rows",
                 "quantize_rows" if w_scale_given else "quantize_rows_dynamic"]
        steps += ["pack_mask"] * (x_mask + w_mask)
        for digits, masked in ((digits_x, x_mask), (digits_w, w_mask)):
            steps += ["digit_matmul" if digits else "dequantize_rows"] + ["mask_zero_packed_"] * masked

        def backend(primitive):
            return getattr(backends.select(primitive, record=False, at_run_time=True, shape=(M, K, N)), "name", None)

        linear = backend("linear")
        if linear in _GEMMS and all(backend(p) == "cpu_fused" for p in set(steps)):
            ran = ((RECORDED_AS, linear), ("linear", linear), *((p, "cpu_fused") for p in steps))
            result = (_GEMMS[linear], digits_x, digits_w, ran)
    if len(_plans) < 4096:
        _plans[key] = result
    return result


_op = None
_observe_op = None
_conv_op = None
_conv_plans: dict[tuple, int | None] = {}


def conv_plan(groups: int, per_group_terms: int, K: int) -> int | None:
    """The C++ conv op's GEMM for this static-activation conv (0: torch._int_mm, 1: AVX2 int16; grouped convs
    have none: 0), or None when the op may not run. per_group_terms = C/g * kh * kw, K = C * kh * kw.

    Grouped convs run as one exact fp32 conv of the codes: only while a group's terms fit 512 (int_conv2d's
    _EXACT_FP32_TERMS; longer ones are cut into chunks, in Python). Plain ones need int_mm on cpu_fused or
    avx2_int16. The elementwise passes must be cpu_fused's. The caller checked the tensors (plain CPU,
    nothing tracing, no learned scales, static activations)."""
    if not available():
        return None
    key = (groups > 1, backends.forced(), cpu_kernels.disabled_depth())
    gemm = _conv_plans.get(key, -1)
    if gemm == -1:
        steps = ["quantize_rows", "dequantize_rows"] + (["epilogue"] if groups == 1 else [])
        ok = all(_run_time_backend(p) == "cpu_fused" for p in steps)
        gemm = None if not ok else (0 if groups > 1 else _GEMMS.get(_run_time_backend("int_mm")))
        _conv_plans[key] = gemm
    if gemm is None or (per_group_terms > 512 if groups > 1 else not 0 < K <= backends.MAX_K_INT32):
        return None
    return gemm


def _run_time_backend(primitive: str) -> str | None:
    return getattr(backends.select(primitive, record=False, at_run_time=True), "name", None)


def run_conv(gemm: int, x: Tensor, weight: Tensor, bias: Tensor | None, w_scale: Tensor, x_scale: float, z_x: int,
             stride: list[int], padding: list[int], dilation: list[int], groups: int, x_qmin: int, x_qmax: int,
             w_qmin: int, w_qmax: int, w_clip_mask: bool) -> Tensor:
    """y (B, O, Ho, Wo) through the C++ conv op with the GEMM `conv_plan` chose; x fp32 (B, C, H, W)."""
    global _conv_op
    if _conv_op is None:
        _conv_op = torch.ops.intqat_train.int_conv2d.default
    backends.note_ran(_CONV_RAN[gemm if groups == 1 else None])
    return _conv_op(x, weight, bias, w_scale, x_scale, z_x, stride, padding, dilation, groups, x_qmin, x_qmax,
                    w_qmin, w_qmax, w_clip_mask, gemm)


_CONV_RAN = {  # what one conv step records, per GEMM (None: grouped, no integer GEMM)
    gemm: ((RECORDED_AS, "cpu_fused"), ("quantize_rows", "cpu_fused"), ("dequantize_rows", "cpu_fused"))
    + (() if gemm is None else (("int_mm", name), ("epilogue", "cpu_fused")))
    for gemm, name in ((None, None), *((g, n) for n, g in _GEMMS.items()))
}


def observe_minmax_(x: Tensor, min_val: Tensor, max_val: Tensor, scale: Tensor, zero_point: Tensor,
                    initialized: Tensor, first: bool, moving_average: bool, averaging_constant: float, qmin: int,
                    qmax: int, symmetric: bool) -> int:
    """One static activation-observer update in one C++ call (kernels/cpu/observe.cpp; buffers updated in
    place): 1 observed, 0 the batch held NaN / inf, -1 the kept range is not finite; on 0 / -1 nothing
    changed. Call only when `available()`, with float32 buffers and x a plain CPU tensor."""
    global _observe_op
    if _observe_op is None:
        _observe_op = torch.ops.intqat_train.observe_minmax_.default
    return _observe_op(x, min_val, max_val, scale, zero_point, initialized, first, moving_average,
                       averaging_constant, qmin, qmax, symmetric, SCALE_EPS)


def run(p: tuple, x2d: Tensor, weight: Tensor, bias: Tensor | None, w_scale: Tensor | None, x_scale: float,
        z_x: int, x_qmin: int, x_qmax: int, w_qmin: int, w_qmax: int, x_dynamic: bool, w_clip_mask: bool) -> Tensor:
    """y (M, N) through the C++ op, per plan `p`; x2d (M, K) fp32 contiguous."""
    global _op
    if _op is None:
        _op = torch.ops.intqat_train.int_linear.default
    gemm, digits_x, digits_w, ran = p
    backends.note_ran(ran)
    return _op(x2d, weight, bias, w_scale, x_scale, z_x, x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic, w_clip_mask,
               gemm, digits_x, digits_w, SCALE_EPS)
