"""fake_quantize_ste: dequantize(quantize(x)) with the straight-through and LSQ gradients.

Forward is bit-identical to torch.fake_quantize_per_{tensor,channel}_affine; backward passes the
gradient where the code was not clipped (STE) and gives LSQ / LSQ+ gradients to a scale or zero
point that requires grad. It saves the clip mask (1 byte / element), and x only when a scale is learned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from intqat.ops.lsq import lsq_grad_factor, lsq_scale_grad_elem
from intqat.ops.quant import _broadcast, fake_quantize_with_mask, quantize_with_mask

__all__ = ["fake_quantize_ste"]


def _reduce_to(t: Tensor, like: Tensor, axis: int | None) -> Tensor:
    """Sum a per-element gradient down to the shape of a per-tensor / per-channel parameter."""
    if axis is None:
        return t.sum().reshape(like.shape)
    dims = [d for d in range(t.dim()) if d != axis % t.dim()]
    return t.sum(dim=dims).reshape(like.shape)


class _FakeQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax, axis):
        s_flat = scale.detach().to(torch.float32)
        z_flat = torch.round(zero_point.detach().to(torch.float32)).clamp_(qmin, qmax)
        learn = scale.requires_grad or zero_point.requires_grad
        if learn:  # LSQ's backward needs the codes
            q, mask = quantize_with_mask(x.detach(), s_flat, z_flat, qmin, qmax, axis)
            s, z = _broadcast(s_flat, x, axis, "scale"), _broadcast(z_flat, x, axis, "zero_point")
            x_hat = (q.to(torch.float32) - z) * s
        else:  # one fused pass on the CPU, same bits
            q = None
            x_hat, mask = fake_quantize_with_mask(x.detach(), s_flat, z_flat, qmin, qmax, axis)
        ctx.save_for_backward(mask, q, x if learn else None, scale, zero_point)
        ctx.qrange, ctx.axis = (qmin, qmax), axis
        return x_hat.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        mask, q, x, scale, zero_point = ctx.saved_tensors
        qmin, qmax = ctx.qrange
        axis = ctx.axis
        grad_x = torch.where(mask, g, 0.0) if ctx.needs_input_grad[0] else None
        grad_s = grad_z = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            g32 = g.to(torch.float32)
            n = x.numel() if axis is None else x.numel() // x.shape[axis]
            gf = lsq_grad_factor(n, qmax)
            s = _broadcast(scale.detach().to(torch.float32), x, axis, "scale")
            z = _broadcast(torch.round(zero_point.detach().to(torch.float32)).clamp_(qmin, qmax), x, axis, "zero_point")
            if ctx.needs_input_grad[1]:
                ds = lsq_scale_grad_elem(q, mask, x.detach().to(torch.float32), s, z, qmin, qmax)
                grad_s = _reduce_to(g32 * ds, scale, axis) * gf
            if ctx.needs_input_grad[2]:
                grad_z = _reduce_to(g32 * ~mask * -s, zero_point, axis) * gf
        return grad_x, grad_s, grad_z, None, None, None


def fake_quantize_ste(
    x: Tensor, scale: Tensor, zero_point: Tensor, qmin: int, qmax: int, axis: int | None = None
) -> Tensor:
    """Differentiable fake quantization. scale / zero_point: (1,) per tensor or (C,) along `axis`."""
    return _FakeQuantizeSTE.apply(x, scale, zero_point, qmin, qmax, axis)
