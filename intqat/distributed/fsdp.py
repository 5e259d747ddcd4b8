"""FSDP2 (`torch.distributed.fsdp.fully_shard`) across intqat's module swaps.

fully_shard keeps, per sharded module, an FSDPState (forward hooks on the module, its class turned
into a dynamic `FSDP<Class>(FSDPModule, Class)`) and FSDPParamGroups whose FSDPParams each name the
module and attribute that hold one Parameter (`ParamModuleInfo`): before forward it all-gathers the
shards and sets the unsharded Parameters on those modules, after backward it puts the sharded ones
back. prepare_qat / to_integer replace modules, keeping the same Parameter objects; FSDP2 would go on
writing the old modules (the new one then computes with the sharded DTensor: "mixed torch.Tensor and
DTensor"). `carry_state(old, new)`, an intqat.registry.on_replace hook, points all of it at the new
module: the FSDPParams, the state-dict hooks, the FSDPState with its forward hooks and FSDP class.
The Parameters, their sharding and the optimizer's state are untouched.

`unwrap_type` (an intqat.registry.register_wrapper) tells the registry that FSDP2's FSDPLinear is an
nn.Linear: FSDP2 changes the class, not the forward.

Parameters a swap creates on a sharded model (learned scales) are not FSDP2's: they stay whole on every
rank, their gradients averaged over the ranks (intqat.distributed.shards.average_gradients_of).

Both do nothing until FSDP2 has been imported (nothing can be sharded before), so `import intqat`
does not import torch.distributed.fsdp. They lean on FSDP2's internals as of torch 2.13
(FSDPParam._module_info, FSDPState._modules and its hook handles); `check_internals` says clearly
when a torch release moved them.
"""

from __future__ import annotations

import sys

from torch import nn

from intqat.distributed.shards import average_gradients_of, fsdp_params_of, states

__all__ = ["unwrap_type", "carry_state", "is_sharded", "fsdp_params_of", "check_internals"]

_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"


def _fully_shard_module():
    """torch's _fully_shard module if FSDP2 was imported, else None (then nothing is sharded)."""
    return sys.modules.get(_FULLY_SHARD)


def unwrap_type(cls: type) -> type | None:
    """nn.Linear for FSDP2's FSDPLinear (exactly the class fully_shard made for it), else None."""
    fs = _fully_shard_module()
    if fs is None or not issubclass(cls, fs.FSDPModule):
        return None
    bases = cls.__bases__
    if len(bases) == 2 and bases[0] is fs.FSDPModule and fs.get_cls_to_fsdp_cls().get(bases[1]) is cls:
        return bases[1]
    return None


def _own_state(m: nn.Module):
    """The FSDPState fully_shard put on m itself (m is one of its modules), else None."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    state = _get_module_fsdp_state(m)
    return state if state is not None and any(x is m for x in state._modules) else None


def is_sharded(model: nn.Module) -> bool:
    """Does fully_shard manage any of model's Parameters?"""
    return bool(fsdp_params_of(model))


def check_internals() -> None:
    """Raise, naming what is missing, if this torch's FSDP2 lacks the internals carry_state rewrites."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

    missing = [name for obj, name in [
        (_fsdp_param.FSDPParam, "reset_sharded_param"), (_fsdp_param, "ParamModuleInfo"),
        (_fsdp_param_group.FSDPParamGroup, "_register_state_dict_hooks"), (_fsdp_state.FSDPState, "_pre_forward"),
        (_fsdp_state.FSDPState, "_post_forward"), (_fsdp_state, "_register_group_forward_hooks"),
    ] if not hasattr(obj, name)]
    if missing:
        import torch

        raise RuntimeError(f"intqat: this torch ({torch.__version__}) moved FSDP2 internals that intqat's swaps keep "
                           f"right ({', '.join(missing)}); intqat follows torch 2.13's: shard the model after "
                           "prepare_qat / to_integer, or use torch 2.13")


# -- the swap -------------------------------------------------------------------------------------


def carry_state(old: nn.Module, new: nn.Module) -> None:
    """intqat.registry.on_replace hook: `new` took `old`'s place holding the same Parameters; make FSDP2 manage
    them on `new` (and on new's submodules that now hold what old's held)."""
    if _fully_shard_module() is None:
        return
    old_mods = list(old.modules())
    old_ids = {id(m) for m in old_mods}
    touched = []  # (group, fsdp_param) whose module (or a sharer) is in old's subtree
    for state in states():
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                info = fp._module_info
                if id(info.module) in old_ids or any(id(m) in old_ids for m in info.shared_modules):
                    touched.append((group, fp))
    owners = [m for m in old_mods if _own_state(m) is not None]
    if not touched and not owners:
        return  # old holds nothing FSDP2 manages
    check_internals()
    holder = {id(p): (m, n) for m in new.modules() for n, p in m._parameters.items() if p is not None}
    moved: dict[int, nn.Module] = {id(old): new}  # old module -> the new module that holds its Parameters

    def new_home(module: nn.Module, name: str) -> tuple[nn.Module, str]:
        p = module._parameters.get(name)
        if p is None or id(p) not in holder:
            raise RuntimeError(
                f"intqat: FSDP2 manages {type(module).__name__}.{name}, but {type(new).__name__}, which replaced "
                f"{type(old).__name__}, does not hold that Parameter: FSDP2 could not all-gather it any more")
        return holder[id(p)]

    for group, fp in touched:
        info = fp._module_info
        if id(info.module) in old_ids:
            m, n = new_home(info.module, info.param_name)
            moved.setdefault(id(info.module), m)
            info.module, info.param_name = m, n
            fp._post_load_hook_handle.remove()  # (FSDP2 re-pads the shard after a load_state_dict into it)
            fp._post_load_hook_handle = m.register_load_state_dict_post_hook(
                lambda *args, fp=fp, **kwargs: fp.reset_sharded_param())
        for i, (m, n) in enumerate(zip(info.shared_modules, info.shared_param_names)):
            if id(m) in old_ids:
                info.shared_modules[i], info.shared_param_names[i] = new_home(m, n)
    for group in {id(g): g for g, _ in touched}.values():
        group.modules = tuple(moved.get(id(m), m) for m in group.modules)
        _move_state_dict_hooks(group, moved)
    for m in owners:
        _move_own_state(m, moved.get(id(m), new))
    _mark_managed(old, new)
    # Parameters the swap created (learned scales): FSDP2 shards only what it saw in fully_shard, so these stay
    # whole on every rank, their gradients averaged over the ranks after each backward
    managed = {id(fp.sharded_param) for _, fp in fsdp_params_of(new).values()}
    before = {id(p) for p in old.parameters()}
    average_gradients_of(p for p in new.parameters() if id(p) not in before and id(p) not in managed)
    from intqat.distributed import int8_gather  # (imports intqat.nn: loaded once a sharded model swaps)

    for group, fp in touched:  # an integer layer's weight crosses as int8 codes where it may
        int8_gather.follow(group, fp)


def _move_state_dict_hooks(group, moved: dict[int, nn.Module]) -> None:
    """FSDP2's lazy init hooks state_dict / load_state_dict of the modules holding its Parameters (to reshard
    first); re-hang those of moved modules on their successors."""
    save, load = group._module_to_pre_save_state_dict_hook_handle, group._module_to_pre_load_state_dict_hook_handle
    for m in [m for m in save if id(m) in moved]:
        save.pop(m).remove()
        load.pop(m).remove()
        target = moved[id(m)]
        if target not in save:
            save[target] = target.register_state_dict_pre_hook(lambda *a, group=group, **k: group._to_sharded())
            load[target] = target._register_load_state_dict_pre_hook(lambda *a, group=group, **k: group._to_sharded())


def _move_own_state(old: nn.Module, new: nn.Module) -> None:
    """old was passed to fully_shard: its FSDPState, forward hooks and FSDP class go to new."""
    from torch.distributed._composable_state import _insert_module_state, _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_init import _apply_to_module
    from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks
    from torch.distributed.fsdp._fully_shard._fully_shard import (
        FSDPModule, _unimplemented_deepcopy, get_cls_to_fsdp_cls)

    state = _own_state(old)
    del _module_state_mapping[old]
    _insert_module_state(new, state)
    state._modules = tuple(new if m is old else m for m in state._modules)
    for group in state._fsdp_param_groups:
        group.modules = tuple(new if m is old else m for m in group.modules)
    # the hooks FSDPState.init registers: all-gather before forward, reshard / backward hooks after it
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    if len(state._modules) == 1:
        state._pre_forward_hook_handle = new.register_forward_pre_hook(state._pre_forward, prepend=True,
                                                                       with_kwargs=True)
        state._post_forward_hook_handle = new.register_forward_hook(state._post_forward, prepend=False)
    else:  # fully_shard([a, b, ...]): one handle for the group's hooks
        handle = _register_group_forward_hooks(state._modules, state._pre_forward, state._post_forward,
                                               state._modules_to_run_forward, state._cast_output_dtype)
        state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
    if not isinstance(new, FSDPModule):
        _apply_to_module((new,), get_cls_to_fsdp_cls(), FSDPModule, "FSDP", _unimplemented_deepcopy)


def _mark_managed(old: nn.Module, new: nn.Module) -> None:
    # fully_shard marks the modules it manages (torch.compile reads the flags): so are their successors
    if getattr(old, "_is_fsdp_managed_module", False):
        for m in new.modules():
            m._is_fsdp_managed_module = True
            m._fsdp_use_orig_params = True
