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

__all__ = ["lsq_grad_factor", "lsq_scale_grad_elem"]


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
