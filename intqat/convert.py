"""Model-level entry points: prepare_qat (float -> fake quant), to_integer (fake quant -> integer),
to_deployed (integer -> frozen int8 weights for export), and the stage switches.

Every swap keeps the very same nn.Parameter objects, so an optimizer built earlier keeps its
state (momentum, Adam moments), and applying a swap twice changes nothing.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from intqat import interop, registry
from intqat.config import QuantConfig, resolve_config
from intqat.fold import find_conv_bn_pairs
from intqat.nn import ActivationQuantizer, IntLinear
from intqat.nn.conv import _QuantConvBase
from intqat.nn.quantizers import name_quantizers
from intqat.registry import QUANT_TYPES, PrepareContext, Refused, register_converter

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
    "float_census",
    "disable_float_fast_paths",
]

FilterFn = Callable[[nn.Module, str], bool]
interop.register()  # torchao's and torch.ao's fake-quant modules convert too (intqat.registry.FOREIGN)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def prepare_qat(
    model: nn.Module, config: QuantConfig | str | dict | None = "w8a8", filter_fn: FilterFn | None = None
) -> nn.Module:
    """Swap (in place) nn.Linear and transformers' Conv1D for FakeQuantLinear, nn.Conv2d for
    FakeQuantConv2d, nn.MultiheadAttention for FakeQuantMultiheadAttention; returns model.

    A BatchNorm2d that takes a Conv2d's output (and nothing else does) is folded: the BN moves inside the
    FakeQuantConv2d and its slot becomes nn.Identity. The pairs come from the model's data flow
    (intqat.fold: a torch.fx trace, per submodule where the whole model does not trace).
    `filter_fn(module, fqn)` -> False keeps a module float. Every linear-like layer, conv, BatchNorm and
    attention left float is named, with the reason, in one warning. torch's fused TransformerEncoderLayer
    fast path (which reads the float weights) is turned off where a layer was quantized.
    """
    cfg = resolve_config(config)
    reasons: dict[str, str] = {}
    _prepare_model(model, cfg, filter_fn, reasons)
    name_quantizers(model)  # their messages name the layer
    float_layers = float_census(model, reasons)
    if float_layers:
        warnings.warn("prepare_qat left these modules in float: " + _listing(float_layers), stacklevel=2)
    return model


def _listing(float_layers: dict[str, str]) -> str:
    return "; ".join(f"{fqn} ({why})" for fqn, why in float_layers.items())


def _prepare_model(model: nn.Module, cfg: QuantConfig, filter_fn, reasons: dict[str, str]) -> None:
    leaves = QUANT_TYPES + tuple({type(m) for m in model.modules() if registry.is_foreign_fake_quant(m)})
    found = find_conv_bn_pairs(model, leaves)
    names = {id(m): n for n, m in model.named_modules()}
    for fqn, err in found.untraced.items():
        for child_name, child in (model.get_submodule("" if fqn == "<model>" else fqn)).named_children():
            if type(child) is nn.BatchNorm2d:
                reasons.setdefault(names.get(id(child), child_name),
                                   f"BatchNorm2d not folded: torch.fx could not trace {fqn} to see what feeds it ({err})")
    _prepare(model, "", cfg, filter_fn, reasons, PrepareContext(found.pairs))
    disable_float_fast_paths(model)


def _prepare(parent: nn.Module, prefix: str, cfg: QuantConfig, filter_fn, reasons: dict[str, str],
             ctx: PrepareContext) -> None:
    for name in list(parent._modules):
        child = parent._modules[name]
        if child is None:
            continue
        fqn = _join(prefix, name)
        if registry.is_quantized(child):
            continue  # already quantized (by intqat or another library): preparing twice is a no-op
        if filter_fn is not None and not filter_fn(child, fqn):
            reasons[fqn] = "filter_fn returned False"
            if not registry.is_float_layer(child):
                _prepare(child, fqn, cfg, filter_fn, reasons, ctx)
            continue
        kind = registry.kind_for_float(child, cfg)
        if kind is not None:
            try:
                registry.replace(parent, name, kind.prepare(child, cfg, ctx))
            except Refused as e:
                reasons[fqn] = str(e)
        elif isinstance(child, (nn.Linear, nn.Conv2d, nn.MultiheadAttention)):
            reasons[fqn] = registry.subclass_reason(child)
        else:
            _prepare(child, fqn, cfg, filter_fn, reasons, ctx)


def float_census(model: nn.Module, reasons: dict[str, str] | None = None) -> dict[str, str]:
    """fqn -> why, for every linear-like layer, conv, BatchNorm and attention of `model` that computes in
    float (not inside an intqat or converted module), and every quantized module conversion recorded a
    reason for leaving as it was. `reasons`: what conversion recorded, by fqn."""
    reasons = reasons or {}
    out: dict[str, str] = {}

    def visit(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            fqn = _join(prefix, name)
            if registry.is_quantized(child):
                if fqn in reasons:  # a fake-quant module kept by filter_fn, another library's that did not convert
                    out[fqn] = reasons[fqn]
                continue
            if registry.is_float_layer(child):
                out[fqn] = reasons.get(fqn) or registry.float_reason(child)
                if not isinstance(child, nn.MultiheadAttention):
                    continue
            else:
                out.update(_raw_weight_parameters(child, fqn))
            visit(child, fqn)

    visit(model, "")
    return out


def _unobserved_quantizers(model: nn.Module) -> list[str]:
    """Names of static, not learned input quantizers that never observed data. An attention layer's key / value
    quantizers count only when its query one observed nothing either: self-attention quantizes its one input
    with the query's (the others are for cross-attention, which the data may never have had)."""
    siblings = set()
    for m in model.modules():
        q = getattr(m, "q_input_quantizer", None)
        if isinstance(q, ActivationQuantizer) and q._initialized:
            siblings.update(id(getattr(m, f"{r}_input_quantizer", None)) for r in ("k", "v"))
    return [q.layer_name or "(unnamed)" for q in model.modules()
            if isinstance(q, ActivationQuantizer) and not q.dynamic and not q.spec.learnable and not q._initialized
            and id(q) not in siblings]


def _raw_weight_parameters(m: nn.Module, fqn: str) -> dict[str, str]:
    """Matrices a custom forward multiplies by itself (Mixtral's experts, XLNet's attention): Parameters of
    the module's own with >= 2 dims all >= 2. No module to convert holds them, so they compute in float;
    the census names them. (Position embeddings and class tokens have a size-1 dim: not named.)"""
    found = {}
    for pname, p in m.named_parameters(recurse=False):
        if p.dim() >= 2 and min(p.shape) >= 2 and p.is_floating_point():
            found[_join(fqn, pname)] = (
                f"a {tuple(p.shape)} Parameter that {type(m).__name__}'s forward uses directly, not an nn.Linear / "
                "Conv1D / Conv2d / attention module: intqat cannot see its matmul")
    return found


def disable_float_fast_paths(model: nn.Module) -> list[str]:
    """Turn off torch's fused transformer fast paths where intqat quantized a layer; returns the fqns.

    In eval / no_grad, nn.TransformerEncoderLayer runs torch._transformer_encoder_layer_fwd on
    `linear1.weight`, `self_attn.in_proj_weight`, ... directly: the float weights, past the integer modules
    (and a deployed layer has no `.weight` at all). Its checks stop at `activation_relu_or_gelu` being
    falsy, before reading any weight; the attribute is read nowhere else. nn.TransformerEncoder's
    nested-tensor path reads its first layer's weights the same way unless `use_nested_tensor` is False.
    """
    changed = []
    for fqn, m in model.named_modules():
        quantized = any(isinstance(x, QUANT_TYPES) for x in m.modules())
        if isinstance(m, nn.TransformerEncoderLayer) and quantized and m.activation_relu_or_gelu:
            m.activation_relu_or_gelu = 0
            changed.append(fqn)
        elif isinstance(m, nn.TransformerEncoder) and quantized and getattr(m, "use_nested_tensor", False):
            m.use_nested_tensor = False
            changed.append(fqn)
    return changed


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
    # a model that holds any quantized module was prepared already (maybe with a filter_fn that
    # kept some layers float on purpose): only a purely float model is prepared here
    has_source = any(registry.is_quantized(m) for m in model.modules())
    reasons: dict[str, str] = {}
    if not has_source:
        _prepare_model(model, resolve_config(config or "w8a8"), filter_fn, reasons)
    if calibration_data is not None:
        batches = list(calibration_data)  # used twice below: a generator must not run dry
        if batches and not isinstance(batches[0], Mapping):  # (torch.ao models take one positional input)
            first = batches[0][0] if isinstance(batches[0], (tuple, list)) else batches[0]
            interop.attach_torch_ao_input_qparams(model, (first,))
        calibrate(model, batches)
    _swap_to_integer(model, "", filter_fn, reasons)
    name_quantizers(model)  # (converters of other libraries' modules make new quantizers)
    disable_float_fast_paths(model)
    left = float_census(model, reasons)
    if left:
        warnings.warn("to_integer left these modules as they were: " + _listing(left), stacklevel=2)
    unset = _unobserved_quantizers(model)
    if unset:
        warnings.warn(f"to_integer: the input quantizers of {', '.join(unset)} never observed data, so they have no "
                      "scale: train with observers on, or pass calibration_data=batches (until then their "
                      "forward raises)", stacklevel=2)
    return model


def _swap_to_integer(parent: nn.Module, prefix: str, filter_fn, reasons: dict[str, str]) -> None:
    for name, child in list(parent._modules.items()):
        if child is None:
            continue
        fqn = _join(prefix, name)
        where = registry.stage(child)
        if where in ("integer", "deployed"):
            continue
        wanted = filter_fn is None or filter_fn(child, fqn)
        if where in ("fake", "foreign"):
            if not wanted:
                reasons[fqn] = "still fake-quant: filter_fn returned False" if where == "fake" else "filter_fn returned False"
                continue
            try:
                registry.replace(parent, name, registry.to_integer_module(child))
            except (ValueError, NotImplementedError) as e:  # a converter that cannot take this one says why
                reasons[fqn] = str(e)
            continue
        if not wanted and registry.is_float_layer(child):
            reasons[fqn] = "filter_fn returned False"
        _swap_to_integer(child, fqn, filter_fn, reasons)


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
        if child is not None and registry.stage(child) == "integer":
            registry.replace(parent, name, child.to_deployed())
        elif child is not None:
            _swap_deployed(child)


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable) -> nn.Module:
    """Observe activation ranges on batches without training (BN statistics untouched).

    Each batch is called as the model takes it: a tensor as `model(x)`, a (inputs, targets) tuple / list as
    `model(batch[0])`, a dict (a Hugging Face tokenizer's output) as `model(**batch)`."""
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
        if isinstance(batch, Mapping):
            model(**batch)
        else:
            model(batch[0] if isinstance(batch, (tuple, list)) else batch)
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
