"""int8 all-gather: under FSDP2 an integer layer's weight crosses the wire as int8 codes, not fp32.

FSDP2 shards a weight by rows, and the rows of intqat's integer layers are output channels: a
per-channel (or per-group) min-max scale, max|W[n, group]| / qmax, needs only its own row. So each rank
quantizes its own shard and FSDP2 all-gathers the codes plus each (row, group)'s absmax, 1 + 4G/K
bytes per weight instead of 4 (torchao does the same for float8 in torchao/float8/fsdp_utils.py, whose
hooks this follows). Gradients still reduce-scatter in fp32.

    rank r:  codes_r = nearbyint(W_r * inv_s_r)  (n, K) int8,  amax_r = max|W_r[row, group]|  (n, G) fp32
    wire:    all-gather (codes, amax)  ->  codes (N, K), amax (N, G)
    every rank: W_hat = codes * s, s = max(amax / qmax, eps); where |code| == qmax: W_hat = sign * amax

The layer then runs unchanged on W_hat: its min-max scale comes from each row's absmax, which W_hat
keeps exactly (the codes at the grid's ends carry it), so it finds the very scale of W; and
W_hat * inv_s lies within a few ulps of each code, so it rounds back to the very codes of W. The
integer forward is bit for bit what one process computes, and so is the straight-through backward:
it reads the codes and scales, never W (a min-max scale never clips, so there is no mask of W).

Which weights (`eligibility`): integer layers (IntLinear, GroupedIntLinear, IntConv2d without a folded
BatchNorm, IntEmbedding) with min-max scales on a symmetric grid, evenly sharded over the ranks, whose
every user quantizes them alike. Learned (LSQ) scales need W itself in backward, a folded BatchNorm
makes the codes of W * sf, a transformers Conv1D keeps its output channels in dim 1: those, and the
others named by `eligibility`, all-gather fp32 as before, and `enable` says which and why.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from intqat.nn import (FakeQuantConv2d, FakeQuantEmbedding, FakeQuantGroupedLinear, FakeQuantLinear, GroupedIntLinear,
                       IntConv2d, IntEmbedding, IntLinear, IntMultiheadAttention)
from intqat.distributed.shards import fsdp_params_of
from intqat.nn.grouped_linear import GroupWeightQuantizer
from intqat.ops.int_linear_grouped import quantize_weight_grouped
from intqat.ops.qparams import SCALE_EPS, row_absmax

__all__ = ["Int8GatherShard", "GatherSpec", "eligibility", "enable", "disable", "gathered_as_int8",
           "use_int8_all_gather", "follow"]

_ENABLED = True


def use_int8_all_gather(enabled: bool = True) -> None:
    """Switch int8 all-gathers on (the default) or off for the swaps from now on (`disable(model)` turns off
    those made)."""
    global _ENABLED
    _ENABLED = bool(enabled)


class GatherSpec:
    """How a weight's shard is quantized for the wire: rows of `group_size` values (a whole row: per channel)
    on the grid [-qmax, qmax]."""

    __slots__ = ("group_size", "qmax")

    def __init__(self, group_size: int, qmax: int):
        self.group_size, self.qmax = group_size, qmax

    def __eq__(self, other) -> bool:
        return isinstance(other, GatherSpec) and (self.group_size, self.qmax) == (other.group_size, other.qmax)

    def __repr__(self) -> str:
        return f"GatherSpec(group_size={self.group_size}, qmax={self.qmax})"


class Int8GatherShard(Tensor):
    """A weight's local shard (FSDP2's DTensor holds it as its local tensor) that FSDP2 all-gathers as int8
    codes plus each (row, group)'s absmax (`fsdp_pre_all_gather` / `fsdp_post_all_gather`).

    It is the shard's own storage under another Python class, and every op on it is a plain tensor op
    (torch function disabled: no dispatch of its own), so the optimizer, state_dict and distributed
    checkpoints see the fp32 shard as before.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: Tensor, spec: GatherSpec):
        t = Tensor._make_subclass(cls, local, local.requires_grad)
        t._spec = spec
        return t

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """(codes (n, K) int8, absmax (n, G) fp32) of this rank's n rows, K = values per row. Kept until the weight
        changes, so that the backward's all-gather reuses the forward's: keyed on the sharded Parameter's version
        (a DTensor's: in-place ops, the optimizer's step, bump the DTensor's counter, not this local tensor's)."""
        param = module._parameters.get("weight") if module is not None else None
        key = None if param is None or param._local_tensor is not self else (id(param), param._version)
        cached = self.__dict__.get("_wire")
        if key is not None and cached is not None and cached[0] == key:
            return cached[1], None
        spec = self._spec
        w = self.as_subclass(Tensor).detach()
        rows = w.reshape(w.shape[0], -1)
        n, K = rows.shape
        # the codes the integer layer computes from W: the min-max pass (nearbyint(w * inv_s), s = max(amax / qmax, eps))
        codes, _, _ = quantize_weight_grouped(rows, None, spec.group_size, -spec.qmax, spec.qmax)
        amax = row_absmax(rows.reshape(-1, spec.group_size), dim=1).reshape(n, K // spec.group_size)
        if key is not None:
            self.__dict__["_wire"] = (key, (codes, amax))
        return (codes, amax), None

    @torch.no_grad()
    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out: Tensor | None = None):
        """W_hat (the unsharded weight, fp32, the original shape) from every rank's codes and absmax."""
        codes, amax = all_gather_outputs
        if out is not None:  # the unsharded Parameter made by the first call: refill its storage
            with torch.autograd._unsafe_preserve_version_counter(out):
                dequantize_keeping_absmax(codes, amax, self._spec, out=out.view(-1))
            return None
        w_hat = dequantize_keeping_absmax(codes, amax, self._spec)
        return w_hat, (w_hat,)


def dequantize_keeping_absmax(codes: Tensor, amax: Tensor, spec: GatherSpec, out: Tensor | None = None) -> Tensor:
    """codes (N, K) int8, amax (N, G) -> W_hat (N * K,) fp32 flat (into `out` if given): codes * s, and +-amax
    where a code sits at an end of the grid, so that each (row, group) of W_hat has absmax exactly amax.

    codes * s alone reaches absmax fl(qmax * s), which is amax but in ~0.3% of int8 rows (~3% at int4): only
    those rows are patched."""
    N, K = codes.shape
    gs = spec.group_size
    q = codes.reshape(-1, gs)  # (N * G, group_size): one (row, group) per row
    a = amax.reshape(-1, 1)
    s = torch.clamp(a / spec.qmax, min=SCALE_EPS)
    w = torch.empty(N * K, dtype=torch.float32, device=codes.device) if out is None else out
    w2 = w.view(-1, gs)
    torch.mul(q, s, out=w2)  # one pass: int8 codes times their fp32 scale
    rows = (s * spec.qmax != a).reshape(-1).nonzero().reshape(-1)
    if rows.numel():
        qr, wr = q[rows], w2[rows]
        w2[rows] = torch.where(qr.abs() == spec.qmax, torch.copysign(a[rows], wr), wr)
    return w


# -- which weights, and switching it on ---------------------------------------------------------------


def _spec_of(m: nn.Module) -> tuple[GatherSpec | None, str | None]:
    """(spec, None) if module m's weight may cross as codes, else (None, why not)."""
    kind = type(m).__name__
    if isinstance(m, IntConv2d) and m.bn is not None:
        return None, f"{kind}: its codes are of the weight folded with BatchNorm, not of the weight FSDP2 shards"
    if isinstance(m, (IntLinear, GroupedIntLinear)) and m.transposed:
        return None, f"{kind} from a Conv1D: its weight is (in, out), so FSDP2's row shards are not output channels"
    wq = m.weight_quantizer
    if isinstance(wq, GroupWeightQuantizer):
        if wq.scale is not None:
            return None, f"{kind}: learned (LSQ) weight scales need the fp32 weight in backward"
        if not wq.narrow:
            return None, f"{kind}: codes on [{wq.qmin}, {wq.qmax}] with scale amax / {wq.scale_div:g} (torch's grid)"
        return GatherSpec(wq.group_size, wq.qmax), None
    if wq.scale is not None:
        return None, f"{kind}: learned (LSQ) weight scales need the fp32 weight in backward"
    if not wq.per_channel:
        return None, f"{kind}: a per-tensor weight scale needs the whole weight's absmax"
    if wq.qmin != -wq.qmax:
        return None, f"{kind}: weight codes on [{wq.qmin}, {wq.qmax}], not a symmetric grid"
    K = m.weight[0].numel()
    return GatherSpec(K, wq.qmax), None


_TAKES = (IntLinear, GroupedIntLinear, IntConv2d, IntEmbedding)
_FAKE = (FakeQuantLinear, FakeQuantGroupedLinear, FakeQuantConv2d, FakeQuantEmbedding)


def eligibility(group, fp) -> tuple[GatherSpec | None, str | None]:
    """(spec, None) if FSDP2 may all-gather this FSDPParam as int8 codes, else (None, the reason)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    info = fp._module_info
    users = [info.module, *info.shared_modules]
    if info.param_name != "weight" or any(n != "weight" for n in info.shared_param_names):
        return None, "not a layer's weight"
    specs = []
    for m in users:
        if not isinstance(m, _TAKES):
            return None, f"used by {type(m).__name__}, which computes with the fp32 weight"
        spec, why = _spec_of(m)
        if spec is None:
            return None, why
        specs.append(spec)
    if any(s != specs[0] for s in specs[1:]):
        return None, "shared by layers that quantize it differently"
    if fp.fsdp_placement.dim != 0 or not isinstance(fp.mesh_info, FSDPMeshInfo):
        return None, "not sharded by rows (FSDP2's Shard(0))"
    world = fp.mesh_info.shard_mesh_size
    if fp._orig_size[0] % world:
        return None, f"{fp._orig_size[0]} rows do not split evenly over {world} ranks (FSDP2 pads the last shard)"
    if fp.mp_policy.param_dtype not in (None, torch.float32) or fp.offload_to_cpu:
        return None, "FSDP2 mixed precision or CPU offload"
    if fp.sharded_param.dtype != torch.float32:
        return None, f"a {fp.sharded_param.dtype} weight, not fp32"
    return specs[0], None


def gathered_as_int8(fp) -> bool:
    return isinstance(fp.sharded_param._local_tensor, Int8GatherShard)


def _reset_gather_buffers(group, fp) -> None:
    # the next all-gather allocates outputs of the new layout and makes the unsharded Parameter anew
    if not group.is_sharded:
        group.reshard()
    fp._init_extensions()
    fp.all_gather_outputs = []
    fp._unsharded_inner_tensors = []
    if hasattr(fp, "_unsharded_param"):
        del fp._unsharded_param


def install(group, fp, spec: GatherSpec) -> None:
    """FSDP2 all-gathers this FSDPParam as int8 codes from the next unshard on."""
    if gathered_as_int8(fp) and fp.sharded_param._local_tensor._spec == spec:
        return
    _reset_gather_buffers(group, fp)
    local = fp.sharded_param._local_tensor
    if isinstance(local, Int8GatherShard):
        local = local.as_subclass(Tensor)
    fp.sharded_param._local_tensor = Int8GatherShard(local, spec)
    fp._init_extensions()
    # module.to() / .float() (nn.Module._apply swaps each Parameter for a converted copy) and load_state_dict
    # (assign=True) hand FSDP2 a new local tensor, after which it calls reset_sharded_param: wrap the new one too
    fp.reset_sharded_param = _KeepInt8(fp, group, spec)


class _KeepInt8:
    """FSDPParam.reset_sharded_param, then the local shard wrapped again (or, no longer fp32, all-gathered in fp32)."""

    def __init__(self, fp, group, spec: GatherSpec):
        self.fp, self.group, self.spec = fp, group, spec

    def __call__(self) -> None:
        fp = self.fp
        type(fp).reset_sharded_param(fp)
        local = fp.sharded_param._local_tensor
        if isinstance(local, Int8GatherShard):
            return
        if local.dtype != torch.float32:  # (e.g. model.half(): not the weight the codes were made for)
            del fp.reset_sharded_param
            _reset_gather_buffers(self.group, fp)
            fp._init_extensions()
            return
        fp.sharded_param._local_tensor = Int8GatherShard(local, self.spec)


def uninstall(group, fp) -> None:
    if not gathered_as_int8(fp):
        return
    _reset_gather_buffers(group, fp)
    fp.sharded_param._local_tensor = fp.sharded_param._local_tensor.as_subclass(Tensor)
    fp._init_extensions()
    fp.__dict__.pop("reset_sharded_param", None)


def _backward_reads_weights(group) -> bool:
    """Does the backward of this FSDP group's modules read its Parameters? Not when they are all integer layers'
    weights and biases with min-max scales: their backward reads the codes and scales their forward saved, so
    FSDP2 need not all-gather them again for it (its `unshard_in_backward`, meant for embeddings). A learned
    (LSQ) scale's gradient reads W; a folded BatchNorm's product W * sf keeps W for its own backward."""
    for fp in group.fsdp_params:
        info = fp._module_info
        for m, name in zip((info.module, *info.shared_modules), (info.param_name, *info.shared_param_names)):
            if not isinstance(m, _TAKES) or name not in ("weight", "bias") or m.weight_quantizer.scale is not None:
                return True
            if isinstance(m, IntConv2d) and m.bn is not None:
                return True
    return False


def _integer_weight(fp) -> bool:
    """Is this FSDPParam the weight of an integer layer (the only Parameters that may cross as codes)?"""
    info = fp._module_info
    return info.param_name == "weight" and any(isinstance(m, _TAKES) for m in (info.module, *info.shared_modules))


_warned: set[tuple[int, str]] = set()


def follow(group, fp) -> None:
    """After a swap (intqat.distributed.fsdp.carry_state): the FSDPParam's users changed; all-gather it as
    codes if it now may, as fp32 if not, and warn (once) when it stays fp32 for good. A weight that another
    fake-quant user shares (a tied embedding not converted yet) waits for that one's swap, unwarned."""
    group.unshard_in_backward = _backward_reads_weights(group)
    info = fp._module_info
    if _ENABLED and isinstance(info.module, IntMultiheadAttention) and info.param_name.endswith("proj_weight"):
        _warn_once(fp, "attention's in-projections cross in fp32 (int8 all-gathers are for IntLinear, GroupedIntLinear, "
                       "IntConv2d and IntEmbedding weights; its out_proj is an IntLinear)")
        return
    if not _ENABLED or not _integer_weight(fp):
        return
    spec, why = eligibility(group, fp)
    if spec is not None:
        install(group, fp, spec)
        return
    uninstall(group, fp)
    if any(isinstance(m, _FAKE) for m in (info.module, *info.shared_modules)):
        return  # its other user converts next
    _warn_once(fp, why)


def _warn_once(fp, why: str) -> None:
    key = (id(fp), why)
    if key not in _warned:
        _warned.add(key)
        info = fp._module_info
        name = fp._param_fqn or f"{type(info.module).__name__}.{info.param_name} {tuple(fp._orig_size)}"
        warnings.warn(f"intqat: FSDP2 all-gathers {name} in fp32, not as int8 codes: {why}", stacklevel=5)


def enable(model: nn.Module, warn: bool = True) -> dict[str, str]:
    """All-gather every eligible integer weight of a sharded `model` as int8 codes. Returns
    {parameter fqn: "int8" or why it stays fp32}; with warn, one warning names the fp32 ones."""
    report = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for pid, (group, fp) in fsdp_params_of(model).items():
        group.unshard_in_backward = _backward_reads_weights(group)
        if not _integer_weight(fp):
            continue  # biases, norms, float layers: fp32 as ever
        spec, why = eligibility(group, fp)
        name = names.get(pid, fp._param_fqn or fp._module_info.param_name)
        if spec is None:
            uninstall(group, fp)
            report[name] = why
        else:
            install(group, fp, spec)
            report[name] = "int8"
    fp32 = {n: why for n, why in report.items() if why != "int8"}
    if warn and fp32:
        warnings.warn("intqat: FSDP2 all-gathers these integer layers' weights in fp32, not as int8 codes: "
                      + "; ".join(f"{n} ({why})" for n, why in fp32.items()), stacklevel=2)
    return report


def disable(model: nn.Module) -> None:
    """Back to fp32 all-gathers for every weight of `model`."""
    for group, fp in fsdp_params_of(model).values():
        uninstall(group, fp)
