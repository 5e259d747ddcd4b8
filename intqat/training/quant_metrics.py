"""Per-layer quantization error, measured on the layers' own inputs while the model trains.

For a quantized layer with float input x and output y_q (fake-quant or integer arithmetic):

    y_ref       = the same layer in float: F.linear(x, W, b) / F.conv2d(x, W_fold, b_fold)
    sqnr_db     = 10 * log10(sum(y_ref^2) / sum((y_q - y_ref)^2))     pooled over batches and ranks
    saturation  = fraction of input codes r = round(x * inv_s) + z outside [qmin, qmax]

`LayerMonitor` hangs forward hooks on the layers and feeds one `QuantErrorMetric` per phase
(train / val / test); torchmetrics adds the sums up across ranks in compute().
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric

from intqat.nn import (FakeQuantConv2d, FakeQuantEmbedding, FakeQuantGroupedLinear, FakeQuantLinear, GroupedIntLinear,
                       IntEmbedding, IntLinear)
from intqat.ops.quant import quantize_with_mask

__all__ = ["LayerMonitor", "QuantErrorMetric", "float_reference", "layer_error_sums", "non_finite_scales"]

# a perfect match would be +inf dB; capped so that a mean over layers stays a number
_MAX_SQNR_DB = 150.0


class QuantErrorMetric(Metric):
    """SQNR (dB) and input saturation of `num_layers` layers; compute() -> ((L,) sqnr_db, (L,) saturation)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, num_layers: int, **kwargs):
        super().__init__(**kwargs)
        # (L, 4): signal power, noise power, saturated codes, codes; one all_gather syncs every layer
        self.add_state("sums", default=torch.zeros(num_layers, 4, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, index: int, sums: Tensor) -> None:
        self.sums[index] += sums.to(self.sums)

    def compute(self) -> tuple[Tensor, Tensor]:
        signal, noise, saturated, total = self.sums.unbind(1)
        noise = torch.maximum(noise, signal * 10 ** (-_MAX_SQNR_DB / 10))
        return (10 * torch.log10(signal / noise)).float(), (saturated / total).float()


def float_reference(module: nn.Module, x: Tensor) -> Tensor:
    """What `module` computes without quantization, on the branch (BN folded or live) it took."""
    if isinstance(module, (FakeQuantLinear, IntLinear, FakeQuantGroupedLinear, GroupedIntLinear)):
        return F.linear(x, module.weight, module.bias)
    if isinstance(module, (FakeQuantEmbedding, IntEmbedding)):  # x: the token ids
        return F.embedding(x, module.weight, module.padding_idx)
    conv_args = (module.stride, module.padding, module.dilation, module.groups)
    bn = module.bn
    if isinstance(module, FakeQuantConv2d) and bn is not None and module.training and not bool(module.bn_frozen):
        # live BN statistics: conv, then BN with this batch's statistics (running stats untouched)
        y = F.conv2d(x, module.weight, module.bias, *conv_args)
        return F.batch_norm(y, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)
    w, b = module.folded()
    return F.conv2d(x, w, b, *conv_args)


@torch.no_grad()
def layer_error_sums(module: nn.Module, x: Tensor, y_q: Tensor) -> Tensor:
    """(4,) float64 for one call: signal power, noise power, saturated input codes, input codes."""
    x = x.detach().to(torch.float32) if x.is_floating_point() else x.detach()  # embeddings take token ids
    y_ref = float_reference(module, x).to(torch.float32)
    err = y_q.detach().to(torch.float32) - y_ref
    aq = getattr(module, "input_quantizer", None)  # embeddings have none
    if aq is None or aq.dynamic:  # scales from the batch's own max |x|: nothing clips, by construction
        saturated = torch.zeros((), dtype=torch.float64, device=x.device)
    else:
        z = torch.round(aq.zero_point.detach().to(torch.float32)).clamp_(aq.qmin, aq.qmax)
        _, inside = quantize_with_mask(x, aq.scale.detach(), z, aq.qmin, aq.qmax)
        saturated = (~inside).sum().double()
    codes = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
    return torch.stack([y_ref.double().square().sum(), err.double().square().sum(), saturated, codes])


def non_finite_scales(layers: dict[str, nn.Module], loss: Tensor | None) -> tuple[list[str], bool]:
    """(names of the non-finite values among the loss and the layers' scales, whether any is)."""
    names, values = [], []
    if loss is not None:
        names.append("the loss")
        values.append(loss.detach().reshape(-1))
    for fqn, m in layers.items():
        if getattr(m, "input_quantizer", None) is not None and not m.input_quantizer.dynamic:
            names.append(f"the input scale of layer {fqn!r}")
            values.append(m.input_quantizer.scale.detach().reshape(-1))
        names.append(f"the weight scale of layer {fqn!r}")  # a min-max scale: non-finite iff a weight is
        values.append(m.weight_quantizer.channel_scale(m.weight).detach().reshape(-1))
    if not values:
        return [], False
    finite = torch.stack([torch.isfinite(v).all() for v in values]).tolist()  # one device sync
    bad = [n for n, ok in zip(names, finite) if not ok]
    return bad, bool(bad)


class LayerMonitor:
    """Forward hooks on quantized layers; measures the calls of the phase set in `phase`."""

    PHASES = ("train", "val", "test")

    def __init__(self) -> None:
        self.layers: dict[str, nn.Module] = {}
        self.phase: str | None = None  # whose layer calls are measured now; None: nobody's
        self._hooks: list = []
        self._metrics: dict[str, QuantErrorMetric] = {}
        self._updated: dict[str, bool] = {}

    def track(self, layers: dict[str, nn.Module], device: torch.device, hooks: bool = True) -> None:
        """Follow these layers (fqn -> module); a no-op but for the device when they are the same."""
        if layers.keys() == self.layers.keys() and all(layers[f] is self.layers[f] for f in layers):
            for metric in self._metrics.values():  # Lightning moves the model after `setup`
                metric.to(device)
            return
        self.remove()
        self.layers = layers
        if hooks:
            self._hooks = [
                m.register_forward_hook(partial(self._on_forward, i), with_kwargs=True)
                for i, m in enumerate(layers.values())
            ]
        with torch.inference_mode(False):  # created during validation, updated in training
            self._metrics = {p: QuantErrorMetric(len(layers)).to(device) for p in self.PHASES}
        self._updated = dict.fromkeys(self.PHASES, False)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.layers, self.phase = [], {}, None

    def _on_forward(self, index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.phase is None:
            return
        # the layer's input, passed by position or by keyword
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        if isinstance(x, Tensor) and isinstance(output, Tensor):
            self._metrics[self.phase].update(index, layer_error_sums(module, x, output))
            self._updated[self.phase] = True

    def compute(self, phase: str) -> dict[str, Tensor]:
        """{"<fqn>/sqnr_db", "<fqn>/saturation", "sqnr_db" (mean)} pooled over calls and ranks since the
        last compute; empty if nothing was measured. Every rank must call it (it all-gathers)."""
        if not self._updated.get(phase):
            return {}
        metric = self._metrics[phase]
        sqnr, saturation = (t.reshape(-1) for t in metric.compute())  # (torchmetrics squeezes one layer's)
        with torch.inference_mode(False):
            metric.reset()
        self._updated[phase] = False
        values = {}
        for i, fqn in enumerate(self.layers):
            values[f"{fqn}/sqnr_db"], values[f"{fqn}/saturation"] = sqnr[i], saturation[i]
        finite = sqnr[torch.isfinite(sqnr)]
        if finite.numel():
            values["sqnr_db"] = finite.mean()
        return values
