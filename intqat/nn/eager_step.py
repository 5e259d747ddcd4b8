"""The integer layers' eager CPU training step, decided once per layer and input shape.

Why: a training call of IntLinear went IntLinear.forward -> int_linear (checks of every argument, two range checks,
the op's spec) -> the backend table (eager test, cache key, choice) -> the C++ op: ~25 Python steps, measured ~0.1 ms
a layer and step inside a BERT-tiny training step on the AMX Xeon (2026-11-27), where the C++ op's forward takes a
few tens of microseconds. What those steps decide depends only on what the key below holds (the input's shape,
the layer's options and quantizer ranges, the activation scale being a number, the table's state: forced backend
and off switches), so the first call of a key runs them (`int_linear.linear_call`, asking the table without
recording) and later calls go straight to the backend it chose, with the same arguments: the same op, the same
bits. Only the C++ step (`cpp_step`) is cached; any other choice, and every case the key does not cover
(tracing, a non-float32 or non-CPU input, learned scales), runs the general path as before.

    fused_linear(owner, slot, x, weight, bias, aq, w_qmin, w_qmax, grad_gemm)    aq.integer_input(x), then
                                                                                  linear_step: in one op call
    linear_step(owner, slot, x, weight, bias, aq, w_qmin, w_qmax, grad_gemm)     int_linear with w_scale None
    grouped_step(owner, slot, x, weight, bias, aq, group_size, w_qmin, w_qmax)   int_linear_grouped, w_scale None
Each returns y, or None: the caller runs its general path. `owner` keeps the decisions (one per `slot`: an
attention layer has several projections) in its __dict__, so they go with the module and are not saved.
linear_step / grouped_step: the caller has already run `aq.integer_input(x)` (or the observer); all three: the
caller has checked that autograd needs the op.

fused_linear (2026-11-28): at BERT-tiny sizes (256 tokens, K, N <= 512) the observer's C++ call, reading its scale
and zero point back in Python, and linear_step's key and lookups cost ~30-40 us a layer and step on the AMX Xeon,
about what the layer's forward GEMM does. So for a static activation quantizer that is not learned, the observer
update (or, observer off, the NaN / inf check; eval mode: nothing) and the C++ step run as one op,
intqat_train::observed_int_linear (kernels/cpu/train_linear.cpp), which reads the scale and zero point it leaves
itself: the same passes and arguments as integer_input + linear_step, so the same bits and the same buffers. What
is checked per call is what can change between calls (the input, the module's mode, the observer switch, a tracer,
the table's state); the first call of a key asks int_linear's checks and the table (as linear_step does), and an
input the op cannot take (NaN / inf, a state that is not finite) is handed back unchanged to the general path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _python_dispatch

from intqat.ops import backends, cpp_step
from intqat.ops.qparams import SCALE_EPS
from intqat.ops.int_linear import linear_call, rounded_zero_point_int
from intqat.ops.int_linear_grouped import grouped_call

__all__ = ["fused_linear", "linear_step", "grouped_step"]

_F32 = torch.float32
_LINEAR_RAN = (("linear_step", "cpp_step"),)  # what the table's select would have recorded
_GROUPED_RAN = (("grouped_step", "cpp_step"),)


def _activation(x: Tensor, weight: Tensor, bias: Tensor | None, aq) -> tuple | None:
    """(s_x, z, finite, scale dtype) of a plain float32 CPU input in eager mode; None: not this case."""
    if type(x) is not Tensor or x.dtype is not _F32 or not backends.eager_cpu((x, weight, bias)):
        return None
    if aq.dynamic:
        return None, None, True, None
    scale, zero_point = aq.scale, aq.zero_point
    if scale.requires_grad or zero_point.requires_grad or (type(scale) is not Tensor and type(scale) is not nn.Parameter):
        return None  # learned (LSQ) scales: their gradients are the Python path's
    s_x, z = float(scale), rounded_zero_point_int(zero_point, aq.qmin, aq.qmax)
    return s_x, z, s_x == s_x and z is not None, scale.dtype


def _decision(owner: nn.Module, slot: str, key: tuple, ask):
    """(backend or None, spec) cached for `key`; `ask()` -> (backend, linear_step's arguments) on a miss."""
    steps = owner.__dict__.get("_eager_steps")
    if steps is None:
        steps = owner.__dict__["_eager_steps"] = {}
    hit = steps.get(slot)
    if hit is None or hit[0] != key:
        b, args = ask()
        hit = steps[slot] = (key, b if b.name == "cpp_step" else None, args[6])
    return hit[1], hit[2]


def linear_step(owner: nn.Module, slot: str, x: Tensor, weight: Tensor, bias: Tensor | None, aq, w_qmin: int,
                w_qmax: int, grad_gemm: str) -> Tensor | None:
    """int_linear(x, weight, bias, aq.scale, aq.zero_point, None, ..., w_clip_mask=False) through the C++ step, or
    None (run int_linear)."""
    act = _activation(x, weight, bias, aq)
    if act is None:
        return None
    s_x, z, finite, scale_dtype = act
    flat = x.dim() == 2
    x2d = (x if flat else x.reshape(-1, x.shape[-1])).to(_F32).contiguous()  # (int_linear's own steps)
    key = (x2d.shape, weight.shape, weight.dtype, None if bias is None else bias.shape, aq.dynamic, aq.qmin, aq.qmax,
           w_qmin, w_qmax, grad_gemm, finite, scale_dtype, backends._state())
    b, spec = _decision(owner, slot, key, lambda: linear_call(
        x, weight, bias, aq.scale, aq.zero_point, None, x_qmin=aq.qmin, x_qmax=aq.qmax, w_qmin=w_qmin, w_qmax=w_qmax,
        x_dynamic=aq.dynamic, w_clip_mask=False, grad_gemm=grad_gemm, record=False))
    if b is None:
        return None
    backends.note_ran(_LINEAR_RAN)
    y = b.linear_step(x2d, weight, bias, aq.scale, aq.zero_point, None, spec, s_x, z)
    return y if flat else y.reshape(*x.shape[:-1], weight.shape[0])


class _Grouped(NamedTuple):
    """What the first grouped_step call of a key decided: the op's constant arguments and what the table records."""

    key: tuple
    args: tuple | None  # (group_size, x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic, w_clip_mask, gemm, digits_w, eps):
    #                     int_linear_grouped's arguments after x_zero_point; None: the general path runs this key
    ran: tuple  # (primitive, backend) pairs, as the table's select and the backend's plan record them


_grouped_op = None


def grouped_step(owner: nn.Module, slot: str, x: Tensor, weight: Tensor, bias: Tensor | None, aq, group_size: int,
                 w_qmin: int, w_qmax: int) -> Tensor | None:
    """int_linear_grouped(x, weight, bias, aq.scale, aq.zero_point, None, ..., w_clip_mask=False) through the C++
    step, or None (run int_linear_grouped).

    The first call of a key asks int_linear_grouped's checks and the table (grouped_call) and the cpp_step
    backend's plan (its forward kernel, the digit GEMM), and keeps the op's constant arguments; later calls call
    the op with them directly: the same op and arguments as the backend's grouped_step, ~6 us of Python less per
    layer and call (AMX Xeon, 2026-11-28, 1 thread: a 16 x 64 -> 16 layer's training forward 34 -> 30 us, the op
    alone 15-18)."""
    act = _activation(x, weight, bias, aq)
    if act is None:
        return None
    s_x, z, finite, scale_dtype = act
    flat = x.dim() == 2
    x2d = x if flat else x.reshape(-1, x.shape[-1])  # (float32: _activation checked; int_linear_grouped's steps)
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    key = (x2d.shape, weight.shape, weight.dtype, None if bias is None else bias.shape, aq.dynamic, aq.qmin, aq.qmax,
           group_size, w_qmin, w_qmax, finite, scale_dtype, backends._state())
    cache = owner.__dict__.get("_grouped_steps")
    if cache is None:
        cache = owner.__dict__["_grouped_steps"] = {}
    hit = cache.get(slot)
    if hit is None or hit.key != key:
        hit = cache[slot] = _grouped_decision(key, x, x2d, weight, bias, aq, group_size, w_qmin, w_qmax)
    if hit.args is None:
        return None
    global _grouped_op
    if _grouped_op is None:
        _grouped_op = cpp_step.grouped_op()._op  # (the OpOverload's builtin: fused_linear says why)
    backends.note_ran(hit.ran)
    y = _grouped_op(x2d, weight, bias, None, 0.0 if s_x is None else s_x, 0 if z is None else z, *hit.args)
    return y if flat else y.reshape(*x.shape[:-1], weight.shape[0])


def _grouped_decision(key: tuple, x: Tensor, x2d: Tensor, weight: Tensor, bias: Tensor | None, aq, group_size: int,
                      w_qmin: int, w_qmax: int) -> _Grouped:
    b, args = grouped_call(x, weight, bias, aq.scale, aq.zero_point, None, group_size=group_size, x_qmin=aq.qmin,
                           x_qmax=aq.qmax, w_qmin=w_qmin, w_qmax=w_qmax, x_dynamic=aq.dynamic, w_clip_mask=False,
                           record=False)
    if b.name != "cpp_step":
        return _Grouped(key, None, ())
    spec = args[6]
    gemm, _, digits_w, ran = b._plan("grouped_step", (x2d.shape[0], x2d.shape[1], weight.shape[0]), spec)
    op = spec.op
    return _Grouped(key, (op.group_size, op.x_qmin, op.x_qmax, op.w_qmin, op.w_qmax, op.x_dynamic,
                          op.w_clip_mask and spec.w_scale_given, gemm, digits_w, SCALE_EPS), _GROUPED_RAN + ran)


class _Fused(NamedTuple):
    """What the first fused_linear call of a key decided: the op's constant arguments and what the table records."""

    key: tuple
    spec: object  # the activation quantizer's QuantSpec the constants were read from (checked by identity)
    args: tuple  # (moving_average, averaging_constant, symmetric, x_qmin, x_qmax, w_qmin, w_qmax, gemm, digits_x,
    #              digits_w, eps): observed_int_linear's arguments after `first`
    ran: tuple  # (primitive, backend) pairs: linear_step's, and with the observer's update, its minmax
    ran_check: tuple  # the same without minmax (observer off, eval)


_MINMAX_RAN = (("minmax", "cpu_fused"),)
_fused_op = None


def _untraced() -> bool:
    """Nothing watches the aten calls (eager_cpu's test without its tensors: the caller checked those)."""
    return not (torch.compiler.is_compiling() or torch.compiler.is_exporting()
                or torch._C._are_functorch_transforms_active()
                or _python_dispatch._get_current_dispatch_mode() is not None)


def _fused_decision(owner: nn.Module, slot: str, key: tuple, x: Tensor, weight: Tensor, bias: Tensor | None, aq,
                    w_qmin: int, w_qmax: int, grad_gemm: str) -> _Fused | None:
    """The cached decision for `key`, or on a miss int_linear's checks and the table's choice (linear_step's);
    None (not cached) where they say the C++ step does not run now, or raise: the general path runs this call."""
    cache = owner.__dict__.get("_fused_steps")
    if cache is None:
        cache = owner.__dict__["_fused_steps"] = {}
    hit = cache.get(slot)
    if hit is not None and hit.key == key and hit.spec is aq.spec:
        return hit
    spec = aq.spec
    if spec.observer == "percentile" or not cpp_step.available():
        return None  # (percentile: the tensor path's; integer_input's C++ observer does not take it either)
    try:
        b, args = linear_call(x, weight, bias, aq.scale, aq.zero_point, None, x_qmin=aq.qmin, x_qmax=aq.qmax,
                              w_qmin=w_qmin, w_qmax=w_qmax, x_dynamic=False, w_clip_mask=False, grad_gemm=grad_gemm,
                              record=False)
    except ValueError:
        return None  # the general path raises it, after integer_input, as before
    if b is None or b.name != "cpp_step" or backends.select("minmax", x, record=False).name != "cpu_fused":
        return None  # (a NaN scale among the reasons: not cached, the next call asks again)
    step = args[6]
    gemm, digits_x, digits_w, ran = b._plan("linear_step", (args[0].shape[0], args[0].shape[1], weight.shape[0]), step)
    op = step.op
    hit = cache[slot] = _Fused(key, spec, (spec.observer != "minmax", spec.averaging_constant, spec.symmetric,
                                           op.x_qmin, op.x_qmax, op.w_qmin, op.w_qmax, gemm, digits_x, digits_w,
                                           SCALE_EPS),
                               _LINEAR_RAN + ran + _MINMAX_RAN, _LINEAR_RAN + ran)
    return hit


def _no_process_group() -> bool:
    return not dist.is_initialized()


# (dist.is_available() cannot change in a process: asked once; is_initialized() per call)
_dist_uninitialized = _no_process_group if dist.is_available() else (lambda: True)


def fused_linear(owner: nn.Module, slot: str, x: Tensor, weight: Tensor, bias: Tensor | None, aq, w_qmin: int,
                 w_qmax: int, grad_gemm: str) -> Tensor | None:
    """aq.integer_input(x), then int_linear(x, weight, bias, aq.scale, aq.zero_point, None, ..., w_clip_mask=False),
    as one C++ op call (intqat_train::observed_int_linear); or None, nothing changed: the caller runs both.

    Its own cost is paid per layer and call (8 x 128 -> 10: the op ~16 us, this function ~4 us before 2026-12-07):
    the checks below are _untraced()'s and the cache's read inline, the op is called through its OpOverload's
    builtin (`_op`, what OpOverload.__call__ forwards to: ~1.5 us less a call, Zen 4)."""
    if type(x) is not Tensor or x.dtype is not _F32 or not x.is_cpu or aq.dynamic or aq.spec.learnable:
        return None
    if not (weight.is_cpu and (bias is None or bias.is_cpu)):
        return None
    # _untraced(), inline
    if (torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch._C._are_functorch_transforms_active()
            or _python_dispatch._get_current_dispatch_mode() is not None):
        return None
    first = not aq._initialized
    if aq.training:
        # aq.observing (not learned, eager): not inside a backward pass (a checkpoint's recompute)
        observe = cpp_step.OBSERVE_UPDATE if (aq._observer_enabled and torch._C._current_graph_task_id() == -1) \
            else cpp_step.OBSERVE_CHECK
        if observe == cpp_step.OBSERVE_UPDATE and not _dist_uninitialized():
            return None  # (the tensor path all-reduces the range)
    else:
        observe = cpp_step.OBSERVE_NOTHING
    if first and observe != cpp_step.OBSERVE_UPDATE:
        return None  # no scale yet: integer_input says so
    key = (x.shape, weight.shape, weight.dtype, None if bias is None else bias.shape, w_qmin, w_qmax, grad_gemm,
           backends._state())
    cache = owner.__dict__.get("_fused_steps")
    hit = None if cache is None else cache.get(slot)
    if hit is None or hit.key != key or hit.spec is not aq.spec:
        hit = _fused_decision(owner, slot, key, x, weight, bias, aq, w_qmin, w_qmax, grad_gemm)
        if hit is None:
            return None
    global _fused_op
    if _fused_op is None:
        _fused_op = cpp_step.observed_linear_op()._op
    buffers = aq._buffers  # (not learned: scale and zero_point are buffers too)
    y = _fused_op(x, weight, bias, buffers["min_val"], buffers["max_val"], buffers["scale"], buffers["zero_point"],
                  buffers["initialized"], observe, first, *hit.args)
    if not y.numel():
        return None  # NaN / inf in the batch or the state: the general path (which raises or takes the tensor path)
    if first:
        aq._initialized = True
    backends.note_ran(hit.ran if observe == cpp_step.OBSERVE_UPDATE else hit.ran_check)
    return y
