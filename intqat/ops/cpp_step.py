"""The eager CPU training step of integer layers in C++: `int_linear`'s, `int_linear_grouped`'s and `int_conv2d`'s
forward and backward as one autograd op each (kernels/cpu/train_linear.cpp, train_grouped.cpp, train_conv.cpp), and
the static activation observer's update before them as one call (kernels/cpu/observe.cpp).

Why: the Python path runs ~12 small steps per integer linear layer and call (backend choices, three C
passes, an autograd.Function, a mask pack; in the backward a split, a GEMM and a combine twice): ~0.15 ms of
interpreter and dispatch per layer and step, measured at every size (~0.3 ms per conv), and the observer
~18 us more. A BERT-tiny layer's whole fp32 step is 0.2-0.5 ms at 2 threads, so that overhead decided
whether an integer transformer block trained faster than fp32. The C++ ops run the same kernels (the fused
C library, linked by path) and the same aten calls in one call forward and one autograd node backward:
same bits, ~5 us overhead.

Which calls they take is the backend table's decision: they are the `cpp_step` backend
(intqat/ops/backends/cpp_step.py, primitives `linear_step`, `grouped_step` and `conv_step`), which refuses, with the reason,
what they cannot do (tracing, CUDA, LSQ, a NaN scale, a forward GEMM or pass the table puts on a backend
whose kernels the ops do not call); `intqat.ops.explain("linear_step", ...)` prints it. This module only
builds, loads and calls them. The observer op runs where the observer's own Python scalar path would, with
`minmax` on `cpu_fused` (`ActivationQuantizer.integer_input`). INTQAT_CPP_STEP=0 turns them all off (tests
compare both ways); a build failure (no C++ compiler, no torch headers) warns once and keeps the Python paths.

The library is compiled on first use (~25 s, `$CXX`, default `c++`) against torch's headers into the
kernels' cache dir, keyed like the C library (`cbuild.build_library`).
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from intqat.ops import cbuild, cpu_kernels
from intqat.ops.qparams import SCALE_EPS

__all__ = ["available", "unavailable_reason", "disabled", "disabled_depth", "run_linear", "run_conv",
           "observe_minmax_", "observed_linear_op", "grouped_op", "OBSERVE_NOTHING",
           "OBSERVE_CHECK", "OBSERVE_UPDATE", "LINEAR_GEMMS", "CONV_ONEDNN", "run_grouped"]

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_reason: str | None = None  # why it is not available (None: it is, or not tried)
_switch = cbuild.OffSwitch()


def _sources() -> list[Path]:
    return cbuild.kernel_sources(("train_linear.cpp", "train_conv.cpp", "train_grouped.cpp", "observe.cpp"))


def _build_and_load() -> None:
    global _loaded
    from torch.utils import cpp_extension  # (imports setuptools: only when the op is first needed)

    torch_lib = Path(torch.__file__).parent / "lib"
    flags = ["-O2", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    # the fused C library by its path: the loader finds the copy intqat.ops.cpu_kernels already loaded
    link = [cpu_kernels.library_path(), f"-L{torch_lib}", "-ltorch_cpu", "-lc10"]
    path = cbuild.build_library(_sources(), compiler=os.environ.get("CXX", "c++"), flag_sets=[flags],
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


def disabled_depth() -> int:
    """How many `disabled()` blocks are open: part of the backend table's cache key."""
    return _switch.depth


# The forward GEMMs the ops can run, by the backend whose kernel it is -> the ops' `gemm` argument
# torch._int_mm (int8 dot-product CPUs), AVX2 vpmaddwd, AMX tiles (the linear and per-group ops: the table never runs
# a conv's int_mm on amx, which does not implement int_mm)
LINEAR_GEMMS = {"cpu_fused": 0, "avx2_int16": 1, "amx": 2}
CONV_ONEDNN = 2  # the conv op's `gemm` for oneDNN's int8 conv (backend onednn_conv), no im2col
_linear_op = None
_conv_op = None
_grouped_op = None
_observe_op = None
# observed_int_linear's `observe`: eval-mode training (the kept scale) / training with the observer off (refuse
# NaN / inf: the op hands such a batch back) / training, observing (the update, then the step)
OBSERVE_NOTHING, OBSERVE_CHECK, OBSERVE_UPDATE = 0, 1, 2


def run_linear(gemm: int, digits_x: bool, digits_w: bool, x2d: Tensor, weight: Tensor, bias: Tensor | None,
               w_scale: Tensor | None, x_scale: float, z_x: int, x_qmin: int, x_qmax: int, w_qmin: int, w_qmax: int,
               x_dynamic: bool, w_clip_mask: bool) -> Tensor:
    """y (M, N) through intqat_train::int_linear (forward now, backward as its autograd node); x2d (M, K) fp32
    row-major. gemm: LINEAR_GEMMS' code; digits_x / digits_w: that backward GEMM as digits (digit_gemm.py)."""
    global _linear_op
    if _linear_op is None:
        _linear_op = torch.ops.intqat_train.int_linear.default
    return _linear_op(x2d, weight, bias, w_scale, x_scale, z_x, x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic,
                      w_clip_mask, gemm, digits_x, digits_w, SCALE_EPS)


def run_conv(gemm: int, digits_x: bool, digits_w: bool, digits_amx: bool, x: Tensor, weight: Tensor,
             bias: Tensor | None, w_scale: Tensor, x_scale: float, z_x: int, stride: list[int], padding: list[int],
             dilation: list[int], groups: int, x_qmin: int, x_qmax: int, w_qmin: int, w_qmax: int,
             w_clip_mask: bool) -> Tensor:
    """y (B, O, Ho, Wo) through intqat_train::int_conv2d; x fp32 (B, C, H, W). gemm: LINEAR_GEMMS' code or CONV_ONEDNN
    (grouped convs run an exact fp32 conv of the codes and ignore it). digits_x / digits_w: that backward GEMM as a
    digit GEMM on the im2col form (groups == 1; int_conv2d._digit_grads), on AMX tiles if digits_amx."""
    global _conv_op
    if _conv_op is None:
        _conv_op = torch.ops.intqat_train.int_conv2d.default
    return _conv_op(x, weight, bias, w_scale, x_scale, z_x, stride, padding, dilation, groups, x_qmin, x_qmax,
                    w_qmin, w_qmax, w_clip_mask, gemm, digits_x, digits_w, digits_amx)


def run_grouped(digits_w: bool, x2d: Tensor, weight: Tensor, bias: Tensor | None, w_scale: Tensor | None,
                x_scale: float, z_x: int, group_size: int, x_qmin: int, x_qmax: int, w_qmin: int, w_qmax: int,
                x_dynamic: bool, w_clip_mask: bool, gemm: int = 0) -> Tensor:
    """y (M, N) through intqat_train::int_linear_grouped (kernels/cpu/train_grouped.cpp); x2d (M, K) fp32 row-major.
    digits_w: grad_w as a digit GEMM (digit_gemm.py); gemm: LINEAR_GEMMS' code of the per-group forward kernel
    (cpu_fused: VNNI, avx2_int16: vpmaddwd, amx: tiles)."""
    global _grouped_op
    if _grouped_op is None:
        _grouped_op = torch.ops.intqat_train.int_linear_grouped.default
    return _grouped_op(x2d, weight, bias, w_scale, x_scale, z_x, group_size, x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic,
                       w_clip_mask, gemm, digits_w, SCALE_EPS)


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


def grouped_op():
    """intqat_train::int_linear_grouped (kernels/cpu/train_grouped.cpp), for intqat.nn.eager_step.grouped_step, which
    calls it directly with the arguments run_grouped passes (its hot path). Call only when `available()`."""
    return torch.ops.intqat_train.int_linear_grouped.default


def observed_linear_op():
    """intqat_train::observed_int_linear (kernels/cpu/train_linear.cpp): a static activation observer's update and
    the linear step in one call, for intqat.nn.eager_step.fused_linear, which calls it directly (its hot path):

        op(x (..., K) fp32, weight, bias, min_val, max_val, scale, zero_point, initialized, observe, first,
           moving_average, averaging_constant, symmetric, x_qmin, x_qmax, w_qmin, w_qmax, gemm, digits_x, digits_w,
           eps) -> y (..., N), or an empty (0,) tensor, nothing changed: the general path must run.
    Call only when `available()`."""
    return torch.ops.intqat_train.observed_int_linear.default
