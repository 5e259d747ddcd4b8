"""Which Parameters FSDP2 manages, and writing a value into a sharded one (a leaf module: torch only, so
intqat.nn can call it without an import cycle).

Between forwards FSDP2 registers each managed Parameter as a DTensor shard; during a forward, an unsharded
copy, all-gathered from the shards and never written back (only gradients go back, reduce-scattered). A value
set on the unsharded copy, as an observer sets a learned activation scale's first value, is therefore lost
at the next all-gather unless it is written into the shard as well (`write_through`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

__all__ = ["states", "fsdp_params_of", "write_through", "average_gradients_of", "broadcast_batchnorm_stats"]

_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"


def states() -> Iterator:
    """Every live FSDPState, once each (none if FSDP2 was never imported: nothing is sharded then)."""
    if sys.modules.get(_FULLY_SHARD) is None:
        return
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    seen = set()
    for ref in list(_module_state_mapping.values()):
        state = ref()
        if isinstance(state, FSDPState) and id(state) not in seen:
            seen.add(id(state))
            yield state


def fsdp_params_of(model: nn.Module) -> dict[int, tuple]:
    """id(Parameter) -> (FSDPParamGroup, FSDPParam) for the Parameters FSDP2 manages in `model` (by the module
    and attribute each FSDPParam writes)."""
    mods = {id(m) for m in model.modules()}
    found = {}
    for state in states():
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                info = fp._module_info
                if id(info.module) in mods:
                    p = info.module._parameters.get(info.param_name)
                    if p is not None:
                        found[id(p)] = (group, fp)
    return found


@torch.no_grad()
def write_through(module: nn.Module, names: Iterable[str]) -> None:
    """module.<name> was set in place during a forward (the unsharded copy): write the same values into the
    shard FSDP2 keeps of it, each rank its own rows. Every rank holds the whole value (observers agree across
    ranks); no collective."""
    wanted = set(names)
    for _, fp in fsdp_params_of(module).values():
        info = fp._module_info
        if info.module is not module or info.param_name not in wanted:
            continue
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        whole: Tensor = module._parameters[info.param_name]
        shard = fp.sharded_param
        if shard is whole:
            continue  # (not unsharded now: the value went into the shard itself)
        shape, offset = compute_local_shape_and_global_offset(shard.shape, shard.device_mesh, shard.placements)
        rows = whole.detach().reshape(shard.shape)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        shard._local_tensor.copy_(rows)


def _average(p: Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(p.grad)
    p.grad.div_(dist.get_world_size())


def average_gradients_of(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters created on a sharded model that FSDP2 does not manage (a learned scale made by a swap after
    fully_shard) stay whole on every rank: average their gradients over the ranks after each backward, as DDP
    would, so that every rank steps them alike. Returns those newly hooked."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return []
    hooked = []
    for p in params:
        if p.requires_grad and not getattr(p, "_intqat_grads_averaged", False):
            p.register_post_accumulate_grad_hook(_average)
            p._intqat_grads_averaged = True
            hooked.append(p)
    return hooked


@torch.no_grad()
def broadcast_batchnorm_stats(module: nn.Module) -> int:
    """Every BatchNorm's running statistics of `module` from rank 0 to the others (one broadcast), as DDP does
    before each forward. FSDP2 shards Parameters, not buffers: each rank's statistics follow its own batches, and
    a BatchNorm folded into an integer conv would give each rank other codes. Returns the buffers sent."""
    import torch.distributed as dist
    from torch.nn.modules.batchnorm import _BatchNorm

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return 0
    bufs = [b for m in module.modules() if isinstance(m, _BatchNorm) for b in (m.running_mean, m.running_var)
            if b is not None]
    if not bufs:
        return 0
    flat = torch.cat([b.reshape(-1).to(torch.float32) for b in bufs])
    dist.broadcast(flat, src=0)
    for b, part in zip(bufs, flat.split([b.numel() for b in bufs])):
        b.copy_(part.reshape(b.shape))
    return len(bufs)
