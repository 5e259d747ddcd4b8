"""Count the bytes FSDP2 all-gathers: a custom all-gather (FSDP2's `set_custom_all_gather` hook) that
does what FSDP2's default does (`dist.all_gather_single`) and adds up what it sends.

    counter = count_all_gathers(model)     # every FSDP module of model
    ...steps...
    counter.bytes_out                      # bytes this rank put on the wire (its inputs), all all-gathers so far

Each all-gather sends this rank's input and receives world_size of them; `bytes_out` counts the input
(the shard), `bytes_gathered` the output (what every rank ends up holding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CountingAllGather", "count_all_gathers"]


def _base():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    return DefaultAllGather


class CountingAllGather(_base()):
    """FSDP2's default all-gather, counting bytes and calls."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_out = 0
        self.bytes_gathered = 0
        self.calls = 0

    def reset(self) -> None:
        self.bytes_out = self.bytes_gathered = self.calls = 0

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        self.bytes_out += input_tensor.numel() * input_tensor.element_size()
        self.bytes_gathered += output_tensor.numel() * output_tensor.element_size()
        self.calls += 1
        return super().__call__(output_tensor, input_tensor, group, async_op)


def count_all_gathers(model: nn.Module) -> CountingAllGather:
    """One counter on every FSDP module of `model` (call after fully_shard, before the first forward)."""
    from torch.distributed.fsdp import FSDPModule

    counter = CountingAllGather()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(counter)
    return counter
