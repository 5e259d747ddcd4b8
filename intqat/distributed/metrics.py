"""IntQAT's per-layer measurements on FSDP2-sharded layers.

Under FSDP2 a layer's Parameters are DTensor shards between forwards, and during a forward the unsharded
weight may be W_hat, rebuilt from int8 codes (intqat.distributed.int8_gather), not W. IntQAT's checks read:

- `non_finite_scales` (every step): the loss and the layers' scales. `local_layers` hands it each rank's
  local shards (a min-max scale of a row needs only the row); IntQAT reduces the verdict over the ranks.
- the per-layer SQNR (`LayerMonitor`, measured steps and validation): the float reference F.linear(x, W, b)
  needs the true W. `ShardedLayerMonitor` puts the whole fp32 Parameters (all-gathered: a collective each
  rank's forward hook runs in the same order) in place while it measures, and the module's own
  Parameters back afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

from torch import Tensor, nn

from intqat.distributed.shards import fsdp_params_of
from intqat.training.quant_metrics import LayerMonitor

__all__ = ["local_layers", "full_parameters", "ShardedLayerMonitor"]


def _local(t: Tensor | None) -> Tensor | None:
    return t.to_local() if hasattr(t, "to_local") else t


def _sharded(m: nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in m.parameters())


def local_layers(layers: dict[str, nn.Module]) -> dict[str, object]:
    """fqn -> the layer, or for a sharded one what `non_finite_scales` reads of it (input_quantizer.dynamic /
    .scale, weight_quantizer.channel_scale(weight), weight) with this rank's local shards."""
    out: dict[str, object] = {}
    for fqn, m in layers.items():
        if not _sharded(m):
            out[fqn] = m
            continue
        aq, wq = getattr(m, "input_quantizer", None), m.weight_quantizer
        learned = getattr(wq, "scale", None)
        out[fqn] = SimpleNamespace(
            input_quantizer=None if aq is None else SimpleNamespace(dynamic=aq.dynamic, scale=_local(aq.scale)),
            weight_quantizer=SimpleNamespace(
                channel_scale=(lambda w, s=learned: _local(s)) if learned is not None else wq.channel_scale),
            weight=_local(m.weight))
    return out


@contextmanager
def full_parameters(module: nn.Module, params: dict[int, tuple] | None = None):
    """Within: each FSDP2-managed Parameter of `module` (and its submodules) is its whole fp32 tensor, all-gathered
    from the shards (a collective); after: the module holds what it held before (sharded or unsharded)."""
    params = fsdp_params_of(module) if params is None else params
    holders = []  # (module, attribute, what it holds now, the FSDPParam)
    for _, fp in params.values():
        info = fp._module_info
        for m, name in zip((info.module, *info.shared_modules), (info.param_name, *info.shared_param_names)):
            holders.append((m, name, m._parameters[name], fp))
    full = {id(fp): fp.sharded_param.full_tensor().detach() for _, fp in params.values()}
    try:
        for m, name, _, fp in holders:
            m._parameters[name] = full[id(fp)]
        yield
    finally:
        for m, name, held, _ in holders:
            m._parameters[name] = held


class ShardedLayerMonitor(LayerMonitor):
    """LayerMonitor whose measurements of FSDP2-sharded layers use their whole fp32 Parameters."""

    def track(self, layers: dict[str, nn.Module], device, hooks: bool = True) -> None:
        self._params = {id(m): fsdp_params_of(m) for m in layers.values()}
        super().track(layers, device, hooks)

    def _on_forward(self, index: int, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if self.phase is None:
            return
        params = self._params.get(id(module)) or {}
        if not params:
            return super()._on_forward(index, module, args, kwargs, output)
        with full_parameters(module, params):
            super()._on_forward(index, module, args, kwargs, output)
