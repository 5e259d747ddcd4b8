"""IntConv2d's eager CPU training step, decided once per layer and input shape (as intqat.nn.eager_step for the
linear layers).

Why: a training call of IntConv2d went IntConv2d.forward -> int_conv2d (checks of every argument, the three pairs,
the window check, two range checks, ConvStep with its facts) -> the backend table (eager test, cache key, choice)
-> the C++ op: ~80 us of Python per conv and step measured on the AMX Xeon (2026-11-28), beside a C++ forward of
0.1-1 ms. An MBConv block has 13 convs, and at 2 threads that Python does not shrink while the kernels do. What
those steps decide depends only on what the key below holds (the input's shape and dtype, the layer's options and
quantizer ranges, the activation scale being a finite number, the table's state: forced backend and off
switches), so the first call of a key runs them (`int_conv2d.conv_call`, asking the table without recording) and
later calls go straight to the C++ step it chose, with the same arguments: the same op, the same bits. Any other
choice, and every case the key does not cover (tracing, a non-float32 or non-CPU input, learned scales, dynamic
activations), runs int_conv2d as before.

    conv_step(owner, x, weight, bias, aq, w_scale, op_args) -> y, or None: the caller runs int_conv2d
`owner` keeps the decision in its __dict__ (not saved with the module). The caller has already run
`aq.integer_input(x)` and checked that autograd needs the op.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from intqat.ops import backends
from intqat.ops.int_conv2d import conv_call
from intqat.ops.int_linear import rounded_zero_point_int

__all__ = ["conv_step"]

_F32 = torch.float32
_RAN = (("conv_step", "cpp_step"),)  # what the table's select would have recorded


def conv_step(owner: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None, aq, w_scale: Tensor,
              op_args: dict) -> Tensor | None:
    """int_conv2d(x, weight, bias, aq.scale, aq.zero_point, w_scale, **op_args) through the C++ step, or None."""
    if type(x) is not Tensor or x.dtype is not _F32 or aq.dynamic or w_scale.requires_grad:
        return None
    scale, zero_point = aq.scale, aq.zero_point
    if scale.requires_grad or zero_point.requires_grad or (type(scale) is not Tensor and type(scale) is not nn.Parameter):
        return None  # learned (LSQ) scales: their gradients are the Python path's
    if not backends.eager_cpu((x, weight, bias, scale, zero_point, w_scale)):
        return None
    if not zero_point.is_floating_point():
        zero_point = zero_point.to(_F32)  # (int_conv2d's own step)
    s_x, z = float(scale), rounded_zero_point_int(zero_point, aq.qmin, aq.qmax)
    key = (x.shape, weight.shape, weight.dtype, None if bias is None else (bias.shape, bias.dtype), w_scale.shape,
           aq.qmin, aq.qmax, s_x == s_x and z is not None, scale.dtype, zero_point.dtype,
           tuple((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in op_args.items()), backends._state())
    hit = owner.__dict__.get("_conv_step")
    if hit is None or hit[0] != key:
        b, args = conv_call(x, weight, bias, scale, zero_point, w_scale, **op_args, record=False)
        hit = owner.__dict__["_conv_step"] = (key, b if b.name == "cpp_step" else None, args[6:10])
    b = hit[1]
    if b is None:
        return None
    backends.note_ran(_RAN)
    stride, padding, dilation, spec = hit[2]
    return b.conv_step(x, weight, bias, scale, zero_point, w_scale, stride, padding, dilation, spec, s_x, z)
