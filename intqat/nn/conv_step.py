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

fused_conv(owner, x) -> y, or None (2026-12-07, second pass): IntConv2d.forward's whole autograd call, the static
observer's update, the BN fold and this step, as one op (intqat_train::observed_int_conv2d, train_conv.cpp; with BN
the fold and the conv are one autograd node, FoldedConvTrain), as eager_step.fused_linear does for the linear layers:
the same passes and arguments, so the same bits and buffers. On Zen 4 (1 thread, CPU time) a 1x1 SE conv's training
forward went from 102-105 to 38-40 us, its forward + backward from 278-289 to 198-204 us.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _python_dispatch

from intqat.ops import backends, cpp_step
from intqat.ops.int_conv2d import conv_call
from intqat.ops.int_linear import rounded_zero_point_int
from intqat.ops.qparams import SCALE_EPS

__all__ = ["conv_step", "fused_conv"]

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


class _Fused(NamedTuple):
    """What the first fused_conv call of a key decided: the op's constant arguments and what the table records."""

    key: tuple
    spec: object  # the activation quantizer's QuantSpec the constants were read from (checked by identity)
    args: tuple  # (moving_average, averaging_constant, symmetric, stride ... digits_amx, eps): observed_int_conv2d's
    #              arguments after `first`
    ran: tuple  # (primitive, backend) pairs: conv_step's, and with the observer's update, its minmax
    ran_check: tuple  # the same without minmax (observer off, eval)


_MINMAX_RAN = (("minmax", "cpu_fused"),)
_fused_op = None
_Parameter = nn.Parameter
_BatchNorm2d = nn.BatchNorm2d


def _plain(t) -> bool:
    """None, or a plain (not subclassed) tensor or Parameter"""
    return t is None or type(t) is Tensor or type(t) is _Parameter


def fused_conv(owner: nn.Module, x: Tensor) -> Tensor | None:
    """IntConv2d.forward's autograd call in one C++ op, or None, nothing changed: the caller runs its general path.

    What it replaces: aq.integer_input(x) (the static observer's update; observer off: the NaN / inf check; eval mode:
    the kept scale), _folded_eager() (intqat_train::bn_fold) and conv_step (intqat_train::int_conv2d with w_scale None)
    as one call, intqat_train::observed_int_conv2d (kernels/cpu/train_conv.cpp), which reads the scale and zero point
    the observer leaves: the same passes and arguments, so the same bits and the same buffers (eager_step.fused_linear's
    scheme for the linear layers). Taken for a float32 CPU input in eager mode, with or without autograd (a validation
pass under no_grad / inference_mode too: the op then saves nothing; its forward is the plain-aten path's arithmetic,
which torch.export traces, bit for bit), a static observer
    that is not learned (min-max or moving average), a min-max weight scale per channel, a plain BatchNorm2d or none;
    what can change between calls (the input, the modes, the observer switch, a tracer, the table's state, the
    tensors' types) is checked per call, and the first call of a key asks int_conv2d's checks and the table
    (conv_step's _decide). A batch or state the op cannot take (NaN / inf, a range that is not finite, a non-float32
    BN) is handed back, nothing changed, to the general path, which raises or takes it as before.

    Why (Zen 4, 1 thread, 2026-12-07): the observer's call 11-12 us, the fold's 22-23, conv_step's key and call ~15
    beyond the op and ~28 of IntConv2d.forward's own Python, at a 1x1 SE conv whose op takes ~24 us. Without autograd
    the plain-aten path (im2col, quantize, layout copies as separate aten calls) made the bench's MBConv block's eval
    forward 1.75x-1.86x fp32's; through the op, 1.02x-1.11x (same Zen 4, 1 thread, inference_mode)."""
    if type(x) is not Tensor or x.dtype is not _F32 or not x.is_cpu:
        return None
    d = owner.__dict__
    params, mods = d["_parameters"], d["_modules"]
    weight = params.get("weight")
    bias = params["bias"] if "bias" in params else d.get("bias", x)  # (x: neither: not this case)
    if bias is x or not (type(weight) is _Parameter and _plain(bias)):
        return None
    aq, wq = mods["input_quantizer"], mods["weight_quantizer"]
    bn = mods["bn"] if "bn" in mods else d.get("bn", x)  # (None: a plain attribute)
    if bn is x:
        return None
    spec = aq.spec
    if aq.dynamic or spec.learnable or wq.scale is not None or not wq.per_channel or spec.observer == "percentile":
        return None
    if bn is not None:
        if type(bn) is not _BatchNorm2d:
            return None
        bn_b = bn._buffers
        running_mean, running_var = bn_b["running_mean"], bn_b["running_var"]
        if bn.affine:
            bn_p = bn._parameters
            gamma, beta = bn_p["weight"], bn_p["bias"]
        else:
            gamma = beta = None
        if (running_var is None or running_mean is None or not (_plain(gamma) and _plain(beta) and _plain(running_mean)
                                                                 and _plain(running_var))):
            return None
        bn_eps = bn.eps
    else:
        gamma = beta = running_mean = running_var = None
        bn_eps = 0.0
    buffers = aq._buffers  # (not learned: scale and zero_point are buffers)
    scale, zero_point = buffers["scale"], buffers["zero_point"]
    if not (type(scale) is Tensor and type(zero_point) is Tensor) or not _untraced():
        return None
    first = not aq._initialized
    if aq.training:
        # aq.observing (not learned, eager): not inside a backward pass (a checkpoint's recompute)
        observe = cpp_step.OBSERVE_UPDATE if (aq._observer_enabled and torch._C._current_graph_task_id() == -1) \
            else cpp_step.OBSERVE_CHECK
        if observe == cpp_step.OBSERVE_UPDATE and dist.is_available() and dist.is_initialized():
            return None  # (the tensor path all-reduces the range)
    else:
        observe = cpp_step.OBSERVE_NOTHING
    if first and observe != cpp_step.OBSERVE_UPDATE:
        return None  # no scale yet: integer_input says so
    key = (x.shape, weight.shape, None if bias is None else bias.shape, bn is None, gamma is None, beta is None,
           owner.stride, owner.padding, owner.dilation, owner.groups, wq.qmin, wq.qmax, owner.grad_gemm,
           backends._state())
    hit = d.get("_fused_conv")
    if hit is None or hit.key != key or hit.spec is not spec:
        hit = _fused_decision(owner, key, x, aq, wq)
        if hit is None:
            return None
    global _fused_op
    if _fused_op is None:
        _fused_op = torch.ops.intqat_train.observed_int_conv2d.default
    y = _fused_op(x, weight, bias, gamma, beta, running_mean, running_var, bn_eps, buffers["min_val"],
                  buffers["max_val"], scale, zero_point, buffers["initialized"], observe, first, *hit.args)
    if not y.numel():
        return None  # NaN / inf in the batch or the state, a tensor the op does not take: the general path
    if first:
        aq._initialized = True
    backends.note_ran(hit.ran if observe == cpp_step.OBSERVE_UPDATE else hit.ran_check)
    return y


def _untraced() -> bool:
    """Nothing watches the aten calls (eager_cpu's test without its tensors: the caller checked those)."""
    return not (torch.compiler.is_compiling() or torch.compiler.is_exporting()
                or torch._C._are_functorch_transforms_active()
                or _python_dispatch._get_current_dispatch_mode() is not None)


def _fused_decision(owner: nn.Module, key: tuple, x: Tensor, aq, wq) -> _Fused | None:
    """conv_step's decision (int_conv2d's checks, the table's choice, the cpp_step backend's plan) for the folded
    weight, cached in owner.__dict__ when it is the C++ step; None (not cached): the general path runs this call (it
    raises what the checks refuse, after integer_input, as before)."""
    if not cpp_step.available() or backends.select("minmax", x, record=False).name != "cpu_fused":
        return None
    try:
        with torch.no_grad():  # (the checks read shapes, dtypes and the scale's finiteness: no graph)
            w, b = owner.folded()
    except (RuntimeError, ValueError):
        return None  # (e.g. a BN of another size: the general path raises it, after integer_input, as before)
    if w.dtype is not _F32:
        return None
    scale, zero_point = aq.scale, aq.zero_point
    if not zero_point.is_floating_point():
        zero_point = zero_point.to(_F32)
    try:
        decided = _decide(None, owner, x, w, b, aq, scale, zero_point, None)
    except ValueError:
        return None
    if decided.args is None:
        return None  # (a NaN scale among the reasons: not cached, the next call asks again)
    (stride, padding, dilation, groups, x_qmin, x_qmax, w_qmin, w_qmax, _clip, gemm, digits_x, digits_w,
     digits_amx) = decided.args
    spec = aq.spec
    hit = owner.__dict__["_fused_conv"] = _Fused(
        key, spec, (spec.observer != "minmax", spec.averaging_constant, spec.symmetric, stride, padding, dilation,
                    groups, x_qmin, x_qmax, w_qmin, w_qmax, gemm, digits_x, digits_w, digits_amx, SCALE_EPS),
        decided.ran + _MINMAX_RAN, decided.ran)
    return hit
