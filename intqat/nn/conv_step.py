"""IntConv2d's eager CPU training step, decided once per layer and input shape (as intqat.nn.eager_step for the
linear layers).

Why: a training call of IntConv2d went IntConv2d.forward -> int_conv2d (checks of every argument, the three pairs,
the window check, two range checks, ConvStep with its facts) -> the backend table (eager test, cache key, choice)
-> the C++ op: ~80 us of Python per conv and step measured on the AMX Xeon (2026-11-28), beside a C++ forward of
0.1-1 ms. An MBConv block has 13 convs, and at 2 threads that Python does not shrink while the kernels do. What
those steps decide depends only on what the key below holds (the input's shape and dtype, the layer's options and
quantizer ranges, the activation scale being a finite number, the table's state: forced backend and off
switches), so the first call of a key runs them (`int_conv2d.conv_call`, asking the table without recording, and
the cpp_step backend's plan) and later calls call the C++ op with the constant arguments they chose: the same op,
the same arguments, the same bits. Any other choice, and every case the key does not cover (tracing, a
non-float32 or non-CPU input, learned scales, dynamic activations), runs int_conv2d as before.

    conv_step(owner, x, weight, bias, aq, w_scale) -> y, or None: the caller runs int_conv2d
`owner` (the IntConv2d) keeps the decision in its __dict__ (not saved with the module); the op's options are read
from it (`owner._op_args()` on the first call of a key; the key holds them). w_scale None: the layer's min-max
scale per output channel (a WeightQuantizer without a scale, per channel), which the op computes itself from the
weight it quantizes (`minmax_channel_scale` in kernels/cpu/train_conv.cpp: the float32 values of
`minmax_weight_scale`). The caller has already run `aq.integer_input(x)` and checked that autograd needs the op.

2026-12-07 (AMD Zen 4, 1 thread, CPU time, the ResNet block's convs): the Python around the op was ~130 us a call
(observer 26, BN fold 29, weight scale 21, _op_args + this key + the backend's plan and run_conv ~45-55); with the
scale in the op, this key and the direct call (and the fold as one op, conv.py) the training forward's Python went
from 159-229 to 104-141 us a conv (docs/performance.md, "The conv step's fixed costs per call").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from intqat.ops import backends
from intqat.ops.int_conv2d import conv_call
from intqat.ops.int_linear import rounded_zero_point_int
from intqat.ops.qparams import SCALE_EPS

__all__ = ["conv_step"]

_F32 = torch.float32
_RAN = (("conv_step", "cpp_step"),)  # what the table's select would have recorded


class _Decided(NamedTuple):
    """What the first call of a key decided."""

    key: tuple
    args: tuple | None  # int_conv2d's op arguments after x_zero_point (stride ... digits_amx); None: the general path
    ran: tuple  # (primitive, backend) pairs, as the table's select and the backend's plan record them


_op = None


def conv_step(owner: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None, aq,
              w_scale: Tensor | None) -> Tensor | None:
    """int_conv2d(x, weight, bias, aq.scale, aq.zero_point, w_scale, **owner._op_args()) through the C++ step, or
    None. w_scale None: the min-max scale per channel of `weight` (float32), computed by the op."""
    if type(x) is not Tensor or x.dtype is not _F32 or aq.dynamic:
        return None
    if w_scale is None:
        if weight.dtype is not _F32:
            return None  # (the op's own scale reads float32 weights; the caller computes it for the rest)
    elif w_scale.requires_grad:
        return None
    scale, zero_point = aq.scale, aq.zero_point
    if scale.requires_grad or zero_point.requires_grad or (type(scale) is not Tensor and type(scale) is not nn.Parameter):
        return None  # learned (LSQ) scales: their gradients are the Python path's
    if not backends.eager_cpu((x, weight, bias, scale, zero_point, w_scale)):
        return None
    if not zero_point.is_floating_point():
        zero_point = zero_point.to(_F32)  # (int_conv2d's own step)
    s_x, z = float(scale), rounded_zero_point_int(zero_point, aq.qmin, aq.qmax)
    wq = owner.weight_quantizer
    # what _op_args() holds, read without building it (the layer's options, the quantizers' ranges)
    key = (x.shape, weight.shape, weight.dtype, None if bias is None else (bias.shape, bias.dtype),
           None if w_scale is None else w_scale.shape, aq.qmin, aq.qmax, s_x == s_x and z is not None, scale.dtype,
           zero_point.dtype, owner.stride, owner.padding, owner.dilation, owner.groups, wq.qmin, wq.qmax,
           wq.scale is not None, owner.grad_gemm, backends._state())
    hit = owner.__dict__.get("_conv_step")
    if hit is None or hit.key != key:
        hit = owner.__dict__["_conv_step"] = _decide(key, owner, x, weight, bias, aq, scale, zero_point, w_scale)
    if hit.args is None:
        return None
    global _op
    if _op is None:
        _op = torch.ops.intqat_train.int_conv2d.default
    backends.note_ran(hit.ran)
    return _op(x, weight, bias, w_scale, s_x, z, *hit.args, SCALE_EPS)


def _decide(key: tuple, owner: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None, aq, scale: Tensor,
            zero_point: Tensor, w_scale: Tensor | None) -> _Decided:
    """int_conv2d's checks and the table's choice (conv_call), then the cpp_step backend's plan (its conv_step's)."""
    if w_scale is None:  # (the checks read the scale the op will compute: the same values)
        w_scale = owner.weight_quantizer.channel_scale(weight)
    b, args = conv_call(x, weight, bias, scale, zero_point, w_scale, **owner._op_args(), record=False)
    if b.name != "cpp_step":
        return _Decided(key, None, ())
    stride, padding, dilation, spec = args[6:10]
    plan = b._plan("conv_step", None, spec)
    if isinstance(plan, str):  # (select chose cpp_step, so its plan runs: defensive)
        return _Decided(key, None, ())
    gemm, digits_x, digits_w, digits_amx, ran = plan
    return _Decided(key, (stride, padding, dilation, spec.groups, spec.x_qmin, spec.x_qmax, spec.w_qmin, spec.w_qmax,
                          spec.w_clip_mask, gemm, digits_x, digits_w, digits_amx), _RAN + tuple(ran))
