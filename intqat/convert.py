"""Model-level entry points: prepare_qat (float -> fake quant), to_integer (fake quant -> integer),
to_deployed (integer -> frozen int8 weights for export), and the stage switches.

Every swap keeps the very same nn.Parameter objects, so an optimizer built earlier keeps its
state (momentum, Adam moments), and applying a swap twice changes nothing.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn

from intqat.config import QuantConfig, resolve_config
from intqat.nn import (
    DEPLOYED_TYPES,
    FAKE_QUANT_TYPES,
    INTEGER_TYPES,
    ActivationQuantizer,
    FakeQuantConv2d,
    FakeQuantEmbedding,
    FakeQuantGroupedLinear,
    FakeQuantLinear,
    GroupedIntLinear,
    IntConv2d,
    IntEmbedding,
    IntLinear,
)
from intqat.nn.conv import _QuantConvBase, conv_padding

__all__ = [
    "prepare_qat",
    "to_integer",
    "to_deployed",
    "chain_int8",
    "calibrate",
    "freeze_observers",
    "freeze_bn_stats",
    "quantized_modules",
    "register_converter",
]

FilterFn = Callable[[nn.Module, str], bool]
QUANT_TYPES = FAKE_QUANT_TYPES + INTEGER_TYPES + DEPLOYED_TYPES

# Converters for fake-quant modules of other libraries: (predicate, fn(module) -> IntLinear/IntConv2d).
# intqat.interop registers torchao's and torch.ao's when it is imported.
_CONVERTERS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], nn.Module]]] = []


def register_converter(predicate: Callable[[nn.Module], bool], convert: Callable[[nn.Module], nn.Module]) -> None:
    """Teach `to_integer` another library's fake-quant module."""
    _CONVERTERS.append((predicate, convert))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def prepare_qat(
    model: nn.Module, config: QuantConfig | str | dict | None = "w8a8", filter_fn: FilterFn | None = None
) -> nn.Module:
    """Swap nn.Linear / nn.Conv2d (in place) for FakeQuantLinear / FakeQuantConv2d; returns model.

    A Conv2d followed by a BatchNorm2d in an nn.Sequential is folded: the BN moves inside the
    FakeQuantConv2d and its slot becomes nn.Identity. `filter_fn(module, fqn)` -> False keeps a
    module float. Modules it cannot quantize stay float; one warning names them all.
    """
    from intqat import interop  # noqa: F401  (other libraries' QAT modules count as prepared)

    cfg = resolve_config(config)
    skipped: list[str] = []
    _prepare(model, "", cfg, filter_fn, skipped)
    if skipped:
        warnings.warn("prepare_qat left these modules in float: " + "; ".join(skipped), stacklevel=2)
    return model


def _prepare(parent: nn.Module, prefix: str, cfg: QuantConfig, filter_fn, skipped: list[str]) -> None:
    names = list(parent._modules)
    for i, name in enumerate(names):
        child = parent._modules[name]
        if child is None:
            continue
        fqn = _join(prefix, name)
        if isinstance(child, QUANT_TYPES) or any(pred(child) for pred, _ in _CONVERTERS):
            continue  # already quantized (by intqat or another library): preparing twice is a no-op
        wanted = filter_fn is None or filter_fn(child, fqn)
        if isinstance(child, nn.MultiheadAttention):
            if wanted:
                skipped.append(f"{fqn} (nn.MultiheadAttention reads out_proj.weight directly)")
            continue
        if type(child) is nn.Linear and wanted:
            grouped = cfg.weight.granularity == "group"  # per-group weights: intqat.nn.grouped_linear
            if grouped and child.in_features % cfg.weight.group_size:
                skipped.append(f"{fqn} (in_features {child.in_features} is not a multiple of group_size "
                               f"{cfg.weight.group_size})")
                continue
            parent._modules[name] = (FakeQuantGroupedLinear if grouped else FakeQuantLinear).from_linear(child, cfg)
        elif type(child) is nn.Embedding and wanted and cfg.embedding is not None:
            try:
                parent._modules[name] = FakeQuantEmbedding.from_embedding(child, cfg)
            except ValueError as e:
                skipped.append(f"{fqn} ({e})")
        elif type(child) is nn.Conv2d and wanted:
            if conv_padding(child) is None:
                skipped.append(f"{fqn} (padding {child.padding!r}, mode {child.padding_mode!r})")
                continue
            bn = None
            if isinstance(parent, nn.Sequential) and i + 1 < len(names):
                nxt = parent._modules[names[i + 1]]
                if type(nxt) is nn.BatchNorm2d and nxt.num_features == child.out_channels and nxt.track_running_stats:
                    bn = nxt
                    parent._modules[names[i + 1]] = nn.Identity()
            parent._modules[name] = FakeQuantConv2d.from_conv(child, cfg, bn)
        elif isinstance(child, (nn.Linear, nn.Conv2d)) and wanted and type(child) not in (nn.Linear, nn.Conv2d):
            skipped.append(f"{fqn} ({type(child).__name__}: a subclass whose forward intqat cannot vouch for)")
        else:
            _prepare(child, fqn, cfg, filter_fn, skipped)


def to_integer(
    model: nn.Module,
    filter_fn: FilterFn | None = None,
    *,
    config: QuantConfig | str | dict | None = None,
    calibration_data: Iterable | None = None,
) -> nn.Module:
    """Swap fake-quant modules (in place) for IntLinear / IntConv2d, carrying their learned scales.

    Sources: intqat's fake-quant modules, and any registered converter (torchao's
    FakeQuantizedLinear, torch.ao's eager QAT Linear / Conv2d: see intqat.interop). A model with
    none of those is prepared first (`config`, default w8a8) and, given `calibration_data`
    (batches of inputs), its activation scales are observed from it. Modules that cannot be
    converted stay as they were; one warning names them all.
    """
    from intqat import interop  # noqa: F401  (registers the other libraries' converters)

    # a model that holds any quantized module was prepared already (maybe with a filter_fn that
    # kept some layers float on purpose): only a purely float model is prepared here
    has_source = any(
        isinstance(m, QUANT_TYPES) or any(p(m) for p, _ in _CONVERTERS) for m in model.modules()
    )
    skipped: list[str] = []
    if not has_source:
        _prepare(model, "", resolve_config(config or "w8a8"), filter_fn, skipped)
    if calibration_data is not None:
        batches = list(calibration_data)  # used twice below: a generator must not run dry
        if batches:
            first = batches[0][0] if isinstance(batches[0], (tuple, list)) else batches[0]
            interop.attach_torch_ao_input_qparams(model, (first,))
        calibrate(model, batches)
    _swap_to_integer(model, "", filter_fn, skipped)
    if skipped:
        unique = list(dict.fromkeys(skipped))  # one line per module, even if both passes met it
        warnings.warn("to_integer left these modules as they were: " + "; ".join(unique), stacklevel=2)
    return model


def _swap_to_integer(parent: nn.Module, prefix: str, filter_fn, skipped: list[str]) -> None:
    for name, child in list(parent._modules.items()):
        if child is None:
            continue
        fqn = _join(prefix, name)
        wanted = filter_fn is None or filter_fn(child, fqn)
        if isinstance(child, INTEGER_TYPES + DEPLOYED_TYPES):
            continue
        if isinstance(child, FakeQuantLinear):
            if wanted:
                parent._modules[name] = IntLinear.from_fake_quant(child)
            continue
        if isinstance(child, (FakeQuantGroupedLinear, FakeQuantEmbedding)):
            if wanted:
                integer = GroupedIntLinear if isinstance(child, FakeQuantGroupedLinear) else IntEmbedding
                parent._modules[name] = integer.from_fake_quant(child)
            continue
        if isinstance(child, FakeQuantConv2d):
            if wanted:
                parent._modules[name] = IntConv2d.from_fake_quant(child)
            continue
        converter = next((fn for pred, fn in _CONVERTERS if pred(child)), None)
        if converter is not None:
            if wanted:
                try:
                    parent._modules[name] = converter(child)
                except (ValueError, NotImplementedError) as e:
                    skipped.append(f"{fqn} ({e})")
            continue
        if isinstance(child, nn.MultiheadAttention):
            skipped.append(f"{fqn} (nn.MultiheadAttention reads out_proj.weight directly)")
            continue
        _swap_to_integer(child, fqn, filter_fn, skipped)


def chain_int8(model: nn.Module) -> list[tuple[str, str]]:
    """Make int8 -> int8 chains: in every nn.Sequential, IntLinear [-> ReLU] -> IntLinear pairs with
    static activations. The producer requantizes its output onto the consumer's input grid (a
    ReLU between them becomes a max on the codes), so deployed layers pass int8 codes to each other.

    Training keeps working (the requantization has a straight-through gradient) and the
    training forward stays the deployed arithmetic. The consumer's activation range must be
    fixed first (freeze_observers). Returns the (producer, consumer) names chained.
    """
    chained: list[tuple[str, str]] = []
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        names = list(seq._modules)
        i = 0
        while i < len(names) - 1:
            a, j, relu = seq._modules[names[i]], i + 1, False
            if isinstance(seq._modules[names[j]], nn.ReLU) and j + 1 < len(names):
                j, relu = j + 1, True
            b = seq._modules[names[j]]
            if type(a) is IntLinear and type(b) is IntLinear and a.output_quantizer is None:
                q = b.input_quantizer
                if q.dynamic:
                    i += 1
                    continue  # per-token scales exist only at run time: nothing to requantize onto
                if q._observer_enabled or not q._initialized:
                    raise ValueError(
                        f"chain_int8: {_join(prefix, names[j])}'s activation range is not fixed yet; "
                        "call intqat.freeze_observers(model) after scales are observed, then chain"
                    )
                a.output_quantizer, a.output_relu, b.input_chained = q, relu, True
                if relu:
                    seq._modules[names[i + 1]] = nn.Identity()
                chained.append((_join(prefix, names[i]), _join(prefix, names[j])))
            i += 1
    return chained


def to_deployed(model: nn.Module, inplace: bool = False) -> nn.Module:
    """Integer modules -> Deployed* modules with int8 weight buffers (for export). Eval mode."""
    model = model if inplace else copy.deepcopy(model)
    _swap_deployed(model)
    return model.eval()


def _swap_deployed(parent: nn.Module) -> None:
    for name, child in list(parent._modules.items()):
        if isinstance(child, INTEGER_TYPES):
            parent._modules[name] = child.to_deployed()
        elif child is not None:
            _swap_deployed(child)


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable) -> nn.Module:
    """Observe activation ranges on batches without training (BN statistics untouched)."""
    quantizers = [m for m in model.modules() if isinstance(m, ActivationQuantizer) and not m.dynamic]
    if not quantizers:
        return model  # nothing to observe; other libraries' observers must not move either
    was_training = model.training
    model.eval()
    for q in quantizers:
        q.train()
        q.enable_observer(True)
    seen = 0
    for batch in batches:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        model(x)
        seen += 1
    if seen == 0 and quantizers:
        raise ValueError("calibrate: the calibration data yielded no batch")
    model.train(was_training)
    return model


def freeze_observers(model: nn.Module, frozen: bool = True) -> None:
    """Stop (or restart) updating activation ranges from data."""
    for m in model.modules():
        if isinstance(m, ActivationQuantizer):
            m.enable_observer(not frozen)


def freeze_bn_stats(model: nn.Module, frozen: bool = True) -> None:
    """Fold BatchNorm with fixed running statistics from now on (torch.ao's freeze_bn_stats)."""
    for m in model.modules():
        if isinstance(m, _QuantConvBase) and m.bn is not None:
            m.freeze_bn_stats(frozen)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """fqn -> every intqat fake-quant, integer or deployed module in the model."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QUANT_TYPES)}
