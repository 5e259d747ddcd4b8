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

    linear_step(owner, slot, x, weight, bias, aq, w_qmin, w_qmax, grad_gemm)     int_linear with w_scale None
    grouped_step(owner, slot, x, weight, bias, aq, group_size, w_qmin, w_qmax)   int_linear_grouped, w_scale None
Each returns y, or None: the caller runs its general path. `owner` keeps the decisions (one per `slot`: an
attention layer has several projections) in its __dict__, so they go with the module and are not saved.
The caller has already run `aq.integer_input(x)` (or the observer) and checked that autograd needs the op.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from intqat.ops import backends
from intqat.ops.int_linear import linear_call, rounded_zero_point_int
from intqat.ops.int_linear_grouped import grouped_call

__all__ = ["linear_step", "grouped_step"]

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


def grouped_step(owner: nn.Module, slot: str, x: Tensor, weight: Tensor, bias: Tensor | None, aq, group_size: int,
                 w_qmin: int, w_qmax: int) -> Tensor | None:
    """int_linear_grouped(x, weight, bias, aq.scale, aq.zero_point, None, ..., w_clip_mask=False) through the C++
    step, or None (run int_linear_grouped)."""
    act = _activation(x, weight, bias, aq)
    if act is None:
        return None
    s_x, z, finite, scale_dtype = act
    x2d = x.reshape(-1, x.shape[-1]).to(_F32).contiguous()  # (int_linear_grouped's own steps)
    key = (x2d.shape, weight.shape, weight.dtype, None if bias is None else bias.shape, aq.dynamic, aq.qmin, aq.qmax,
           group_size, w_qmin, w_qmax, finite, scale_dtype, backends._state())
    b, spec = _decision(owner, slot, key, lambda: grouped_call(
        x, weight, bias, aq.scale, aq.zero_point, None, group_size=group_size, x_qmin=aq.qmin, x_qmax=aq.qmax,
        w_qmin=w_qmin, w_qmax=w_qmax, x_dynamic=aq.dynamic, w_clip_mask=False, record=False))
    if b is None:
        return None
    backends.note_ran(_GROUPED_RAN)
    y = b.grouped_step(x2d, weight, bias, aq.scale, aq.zero_point, None, spec, s_x, z)
    return y.reshape(*x.shape[:-1], weight.shape[0])
