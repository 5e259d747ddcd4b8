"""Affine quantize / dequantize with torch's own formula (see docs/numerics.md).

    inv_s = float32(1 / s)
    r     = nearbyint(x * inv_s) + z        # round half to even, before clamping
    q     = clamp(r, qmin, qmax)            # int8 codes (4-bit codes too)
    x_hat = (q - z) * s

Multiplying by the float32 reciprocal (not dividing) is what makes
`dequantize(quantize(x))` equal `torch.fake_quantize_per_*_affine` bit for bit.

On plain CPU tensors these run as one fused pass (the backend table's `cpu_fused`, same bits); the
torch code below is the reference, and the path taken under tracing (torch.compile / export).
"""

from __future__ import annotations

import torch
from torch import Tensor

from intqat.ops import backends

__all__ = ["quantize", "dequantize", "quantize_with_mask", "fake_quantize", "fake_quantize_with_mask", "check_qrange"]


def check_qrange(qmin: int, qmax: int) -> None:
    for name, v in (("qmin", qmin), ("qmax", qmax)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"quantization range: {name} must be an int, got {type(v).__name__} {v!r}")
    if not (-128 <= qmin < qmax <= 127):
        raise ValueError(
            f"quantization range [qmin={qmin}, qmax={qmax}] must satisfy -128 <= qmin < qmax <= 127 "
            "(codes are stored in int8)"
        )


def _broadcast(p: Tensor | float | int, x: Tensor, axis: int | None, name: str) -> Tensor:
    """Shape a scale / zero point so it broadcasts against x: () for per-tensor, along `axis` otherwise."""
    p = torch.as_tensor(p, device=x.device)
    if name == "zero_point" and p.is_floating_point() and p.is_cpu and not backends.tracing(p) and not torch.equal(p, p.round()):
        # torch's quantize takes integer zero points: a fractional one would be truncated toward zero, off by
        # one on one side only. A learned (LSQ+) float zero point is rounded first (intqat.ops.rounded_zero_point).
        raise ValueError(f"zero_point must hold integers, got {p.flatten()[:4].tolist()}: round a learned zero point "
                         "first (intqat.ops.rounded_zero_point)")
    if axis is None:
        if p.numel() != 1:
            raise ValueError(
                f"per-tensor {name} must have one element, got shape {tuple(p.shape)}; "
                f"pass axis=... for per-channel parameters"
            )
        return p.reshape(())
    if p.numel() == 1 and p.dim() <= 1:
        return p.reshape(())  # one value shared by every channel (e.g. a symmetric zero point of 0)
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"per-channel {name}: axis {axis} is out of range for input of shape {tuple(x.shape)}")
    axis = axis % x.dim()
    if p.dim() != 1 or p.numel() != x.shape[axis]:
        raise ValueError(
            f"per-channel {name} along axis {axis} must have shape ({x.shape[axis]},) for input of shape "
            f"{tuple(x.shape)}, got {tuple(p.shape)}"
        )
    shape = [1] * x.dim()
    shape[axis] = -1
    return p.reshape(shape)


def _rounded(x: Tensor, scale: Tensor, zero_point: Tensor | int) -> Tensor:
    """r = nearbyint(x * float32(1/s)) + z, as a fresh float32 tensor (callers work in place on it)."""
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point input, got dtype {x.dtype}")
    inv_scale = torch.reciprocal(scale.to(torch.float32))
    r = x.to(torch.float32) * inv_scale
    r.round_()  # torch.round is round-half-to-even, like nearbyint
    if isinstance(zero_point, int) and zero_point == 0:
        return r  # symmetric: adding an exact 0 changes no bit, skip the pass
    return r.add_(zero_point.to(torch.float32))


def _fused_rows(x: Tensor, s: Tensor, z, axis: int | None, primitive: str):
    """-> (backend, per_row flag) when a backend other than the reference takes this call in the
    row form (one scale for all, or one per slice along axis 0, and a single zero point); else None."""
    if not isinstance(z, int) and z.numel() != 1:
        return None
    if s.numel() == 1:
        per_row = False
    elif axis is not None and x.dim() >= 1 and axis % x.dim() == 0:
        per_row = True
    else:
        return None
    b = backends.select(primitive, x, s, None if isinstance(z, int) else z)
    return None if b.traceable else (b, per_row)


def _checked_params(x, scale, zero_point, qmin, qmax, axis, what: str, primitive: str):
    """Validate a quantize call -> (s, z broadcast against x, (backend, per_row) or None, z as float)."""
    check_qrange(qmin, qmax)
    s = _broadcast(scale, x, axis, "scale")
    z = zero_point if isinstance(zero_point, int) and zero_point == 0 else _broadcast(zero_point, x, axis, "zero_point")
    if not x.is_floating_point():
        raise ValueError(f"{what} expects a floating-point input, got dtype {x.dtype}")
    fused = _fused_rows(x, s, z, axis, primitive)
    z_val = None if fused is None else (0.0 if isinstance(z, int) else float(z.reshape(()).to(torch.float32)))
    return s, z, fused, z_val


def _codes(x, scale, zero_point, qmin, qmax, axis, need_mask):
    s, z, fused, z_val = _checked_params(x, scale, zero_point, qmin, qmax, axis, "quantize", "quantize_rows")
    if fused is not None:
        b, per_row = fused
        q, mask, _ = b.quantize_rows(x, s, z_val, qmin, qmax, per_row, need_mask=need_mask)
        return q, mask
    r = _rounded(x, s, z)
    if not need_mask:
        return r.clamp_(qmin, qmax).to(torch.int8), None
    clamped = r.clamp(qmin, qmax)
    return clamped.to(torch.int8), clamped == r  # the clip mask: qmin <= r <= qmax


def quantize(
    x: Tensor,
    scale: Tensor | float,
    zero_point: Tensor | int,
    qmin: int,
    qmax: int,
    axis: int | None = None,
) -> Tensor:
    """Float tensor -> int8 codes. `axis=None`: one scale; `axis=a`: scale[i] applies to x.select(a, i)."""
    return _codes(x, scale, zero_point, qmin, qmax, axis, need_mask=False)[0]


def quantize_with_mask(
    x: Tensor,
    scale: Tensor | float,
    zero_point: Tensor | int,
    qmin: int,
    qmax: int,
    axis: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Like `quantize`, plus torch's clip mask `(qmin <= r) & (r <= qmax)` (bool, x's shape).

    The mask cannot be recovered from the codes (a code equal to qmax may or may not have been
    clipped), so the straight-through backward needs it saved.
    """
    return _codes(x, scale, zero_point, qmin, qmax, axis, need_mask=True)


def dequantize(
    q: Tensor, scale: Tensor | float, zero_point: Tensor | int, axis: int | None = None
) -> Tensor:
    """int8 codes -> float32: (q - z) * s. (q - z) is an exact small integer, so one rounding."""
    if q.dtype not in (torch.int8, torch.uint8, torch.int32):
        raise ValueError(f"dequantize expects integer codes (int8/uint8/int32), got dtype {q.dtype}")
    s = _broadcast(scale, q, axis, "scale").to(torch.float32)
    z = _broadcast(zero_point, q, axis, "zero_point").to(torch.float32)
    if q.dtype == torch.int8 and z.numel() == 1:
        fused = _fused_rows(q, s, z, axis, "dequantize_rows")
        if fused is not None:
            b, per_row = fused
            return b.dequantize_rows(q, s, float(z), per_row)
    return (q.to(torch.float32) - z) * s


def fake_quantize(
    x: Tensor,
    scale: Tensor | float,
    zero_point: Tensor | int,
    qmin: int,
    qmax: int,
    axis: int | None = None,
) -> Tensor:
    """dequantize(quantize(x)): the fp32 simulation of the codes (no autograd; see intqat.nn for STE)."""
    return fake_quantize_with_mask(x, scale, zero_point, qmin, qmax, axis, need_mask=False)[0]


def fake_quantize_with_mask(
    x: Tensor,
    scale: Tensor | float,
    zero_point: Tensor | int,
    qmin: int,
    qmax: int,
    axis: int | None = None,
    need_mask: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """(dequantize(quantize(x)) fp32, clip mask or None); on plain CPU tensors in one fused pass."""
    s, _, fused, z_val = _checked_params(x, scale, zero_point, qmin, qmax, axis, "fake_quantize", "fake_quantize_rows")
    if fused is not None:
        b, per_row = fused
        return b.fake_quantize_rows(x, s, z_val, qmin, qmax, per_row, need_mask=need_mask)
    q, mask = _codes(x, scale, zero_point, qmin, qmax, axis, need_mask)
    # a NaN goes on to the output as the fused pass gives: an int8 code cannot hold it (its cast is 0), and a
    # finite -z*s would hide a diverged batch from the loss where this path runs (torch.compile, GPUs)
    return torch.where(torch.isnan(x), x.to(torch.float32), dequantize(q, scale, zero_point, axis)), mask
