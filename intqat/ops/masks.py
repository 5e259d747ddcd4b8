"""STE clip masks kept for backward as bits, not bytes.

A clip mask (docs/numerics.md: mask = qmin <= r <= qmax) is one bit of information per element, but torch
stores a bool per byte: saved for backward, the masks of a static w8a8 layer were as large as its int8
codes (2 bytes kept per activation element, as much as a bf16 layer). Packed 8 to a byte they cost
1/8 of the codes; the backward unpacks them to the same bools (exact round trip, tested).

    pack_mask(mask bool (...))        -> uint8 (ceil(n / 8),), bit i of byte j = mask.flatten()[8 j + i]
    unpack_mask(packed, shape)        -> bool shape
The torch functions (pack_mask_torch / unpack_mask_torch, in intqat.ops.backends.formulas) are the definition (and what tracers see); eager CPU calls take one C
pass each (backend `cpu_fused`: `pack_mask` / `unpack_mask` primitives), the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from intqat.ops.backends.formulas import pack_mask_torch, unpack_mask_torch  # noqa: F401 (re-exported)

__all__ = ["pack_mask", "unpack_mask", "pack_mask_torch", "unpack_mask_torch"]

def pack_mask(mask: Tensor) -> Tensor:
    """bool (...) -> uint8 (ceil(n / 8),), little-endian bits: 8 elements a byte."""
    from intqat.ops import backends

    return backends.select("pack_mask", mask).pack_mask(mask)


def unpack_mask(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """uint8 (ceil(n / 8),) from `pack_mask` -> bool `shape` (n = prod(shape))."""
    from intqat.ops import backends

    return backends.select("unpack_mask", packed).unpack_mask(packed, shape)


