"""STE clip masks kept for backward as bits, not bytes.

A clip mask (docs/numerics.md: mask = qmin <= r <= qmax) is one bit of information per element, but torch
stores a bool per byte: saved for backward, the masks of a static w8a8 layer were as large as its int8
codes (2 bytes kept per activation element, as much as a bf16 layer). Packed 8 to a byte they cost
1/8 of the codes; the backward unpacks them to the same bools (exact round trip, tested).

    pack_mask(mask bool (...))        -> uint8 (ceil(n / 8),), bit i of byte j = mask.flatten()[8 j + i]
    unpack_mask(packed, shape)        -> bool shape
The torch functions below are the definition (and what tracers see); eager CPU calls take one C
pass each (backend `cpu_fused`: `pack_mask` / `unpack_mask` primitives), the same bits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["pack_mask", "unpack_mask", "pack_mask_torch", "unpack_mask_torch"]

# x * _GATHER moves the low bit of byte i of an int64 to bit 56 + i (the classic bit-gather multiply:
# every cross term lands below bit 56 or past bit 63), so (x * _GATHER) >> 56 is the packed byte.
_GATHER = 0x0102040810204080


def pack_mask(mask: Tensor) -> Tensor:
    """bool (...) -> uint8 (ceil(n / 8),), little-endian bits: 8 elements a byte."""
    from intqat.ops import backends

    return backends.select("pack_mask", mask).pack_mask(mask)


def unpack_mask(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """uint8 (ceil(n / 8),) from `pack_mask` -> bool `shape` (n = prod(shape))."""
    from intqat.ops import backends

    return backends.select("unpack_mask", packed).unpack_mask(packed, shape)


def pack_mask_torch(mask: Tensor) -> Tensor:
    """`pack_mask` in torch ops (the reference backend's)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    lanes = flat.view(torch.uint8).view(torch.int64)  # 8 mask bytes (0 / 1) per int64
    return ((lanes * _GATHER) >> 56).to(torch.uint8)  # wraps mod 2^64; the cast keeps bits 56..63


def unpack_mask_torch(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """`unpack_mask` in torch ops (the reference backend's)."""
    n = math.prod(shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts).bitwise_and_(1)  # (n / 8, 8) of 0 / 1
    # != 0, not .view(torch.bool): inductor's CPU code for a uint8 -> bool bit cast does not compile
    # (Vectorized<bool> has no cast), which broke torch.compile of every static-activation layer after a norm
    return bits.reshape(-1)[:n].ne(0).view(shape)
