"""LSQ (Esser et al., ICLR 2020) and LSQ+ gradients, shared by the fake-quant and integer paths.

d x_hat / d s  = (x_hat - x) / s   inside the range     (= round(v) - v)
               = qmin - z          where r < qmin
               = qmax - z          where r > qmax
d x_hat / d z  = 0 inside, -s outside                    (LSQ+)
Scale gradient = sum(dL/dx_hat * d x_hat/d s) * gscale, gscale = 1 / sqrt(n * qmax).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["lsq_grad_factor", "lsq_scale_grad_elem", "activation_lsq_grads", "weight_scale_grad"]


def lsq_grad_factor(n: int, qmax: int) -> float:
    """LSQ's gradient scale 1 / sqrt(n * qmax); n = elements sharing one scale."""
    return 1.0 / math.sqrt(max(n, 1) * qmax)


def lsq_scale_grad_elem(q: Tensor, mask: Tensor, x: Tensor, s: Tensor, z: Tensor, qmin: int, qmax: int) -> Tensor:
    """d x_hat / d s per element, from the codes q, the clip mask and the input x (s, z broadcast).

    Written the way torch's learnable fake-quant kernel writes it, so the two agree to the last bits.
    """
    qf = q.to(torch.float32)
    zf = z.to(torch.float32)
    inside = ((qf - zf) * s - x) / s
    below = (q == qmin) & ~mask  # clipped from below: r < qmin
    outside = torch.where(below, qmin - zf, qmax - zf)
    return torch.where(mask, inside, outside)


def activation_lsq_grads(grad_xhat: Tensor, q_x: Tensor, mask_x: Tensor, x: Tensor, s_x: Tensor, z_x: Tensor,
                         qmin: int, qmax: int, need_s: bool, need_z: bool) -> tuple[Tensor | None, Tensor | None]:
    """(grad of the per-tensor activation scale, of its zero point) from grad_xhat = dL/dx_hat (M, K),
    unmasked; mask_x empty: nothing clipped. Both scalars (reshape to the parameters' shapes)."""
    m = mask_x if mask_x.numel() else torch.ones_like(q_x, dtype=torch.bool)
    gf = lsq_grad_factor(q_x.numel(), qmax)
    s = s_x.reshape(())
    grad_s = grad_z = None
    if need_s:
        ds = lsq_scale_grad_elem(q_x, m, x.to(torch.float32), s, z_x.reshape(()), qmin, qmax)
        grad_s = (grad_xhat * ds).sum() * gf
    if need_z:  # LSQ+: d x_hat / d z = 0 inside the range, -s outside
        grad_z = -(grad_xhat * ~m).sum() * s * gf
    return grad_s, grad_z


def weight_scale_grad(grad_what: Tensor, q_w: Tensor, mask_w: Tensor, weight: Tensor, scale: Tensor, qmin: int,
                      qmax: int) -> Tensor:
    """The LSQ gradient of symmetric weight scales (z = 0), one scale per row of the last dim: grad_what = dL/dw_hat,
    the codes q_w, the clip mask (empty: nothing clipped) and the weight, all (..., n); scale (..., 1) -> (...):
    sum_n(grad_what * d w_hat / d s) * lsq_grad_factor(n, qmax). Per channel: (N, K) with (N, 1); per group:
    (N, G, group_size) with (N, G, 1)."""
    m = mask_w if mask_w.numel() else torch.ones_like(q_w, dtype=torch.bool)
    ds = lsq_scale_grad_elem(q_w, m, weight.detach().to(torch.float32), scale, torch.zeros((), dtype=torch.int32),
                             qmin, qmax)
    return (grad_what * ds).sum(dim=-1) * lsq_grad_factor(q_w.shape[-1], qmax)
