"""The module registry: which float layers intqat quantizes, into which classes, and how.

One table (`KINDS`) holds every layer kind intqat implements:

    kind            float module (exact type)              fake quant                   integer                deployed
    linear          nn.Linear, transformers' Conv1D        FakeQuantLinear              IntLinear              DeployedIntLinear
    grouped_linear  the same, under a per-group config     FakeQuantGroupedLinear       GroupedIntLinear       DeployedGroupedIntLinear
    conv2d          nn.Conv2d (+ a BatchNorm2d it feeds)   FakeQuantConv2d              IntConv2d              DeployedIntConv2d
    attention       nn.MultiheadAttention                  FakeQuantMultiheadAttention  IntMultiheadAttention  DeployedIntMultiheadAttention
    embedding       nn.Embedding (config.embedding set)    FakeQuantEmbedding           IntEmbedding           DeployedIntEmbedding

and `FOREIGN` the fake-quant modules of other libraries that convert straight to integer modules
(torchao's FakeQuantizedLinear, torch.ao's eager QAT modules: `intqat.interop` registers them).
`prepare_qat`, `to_integer`, `to_deployed`, the float census and the checkpoint records read only
this module; every swap goes through `replace`, where sharding (and anything else that tracks
modules by identity) hooks in with `on_replace`.

Only exact types are taken: a subclass's forward may do anything, so subclasses are named in the
census, not converted. A wrapper that changes a module's class but not its forward (FSDP2 turns an
nn.Linear it shards into its own `FSDPLinear(FSDPModule, nn.Linear)`) is taught with
`register_wrapper`: the table then sees the class it wraps (`base_type`). intqat.distributed.fsdp
teaches FSDP2's classes and keeps FSDP2's state right across swaps (its `on_replace` hook).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from intqat.config import QuantConfig
from intqat.distributed import fsdp as _fsdp
from intqat.nn.attention import DeployedIntMultiheadAttention, FakeQuantMultiheadAttention, IntMultiheadAttention
from intqat.nn.conv import DeployedIntConv2d, FakeQuantConv2d, IntConv2d, conv_padding
from intqat.nn.embedding import DeployedIntEmbedding, FakeQuantEmbedding, IntEmbedding
from intqat.nn.grouped_linear import DeployedGroupedIntLinear, FakeQuantGroupedLinear, GroupedIntLinear
from intqat.nn.linear import DeployedIntLinear, FakeQuantLinear, IntLinear, is_hf_conv1d

__all__ = [
    "Kind", "Foreign", "Refused", "KINDS", "FOREIGN", "register_converter", "register_float_type", "on_replace", "replace",
    "register_wrapper", "base_type",
    "kind_for_float", "kind_of", "stage", "is_quantized", "is_foreign_fake_quant", "to_integer_module",
    "FAKE_QUANT_TYPES", "INTEGER_TYPES", "DEPLOYED_TYPES", "ATTENTION_TYPES", "QUANT_TYPES",
    "is_float_layer", "float_reason",
]


class Refused(ValueError):
    """A float layer of a known kind that this config cannot quantize; the message is the census's reason."""


@dataclass
class PrepareContext:
    """What preparing one layer may need beyond the layer: BatchNorm pairs (intqat.fold) found in the model."""

    conv_bn_pairs: dict[int, tuple[nn.Module, str, nn.Module]]


@dataclass(frozen=True)
class Kind:
    """One layer kind: the float module it takes, its three quantized classes, and how to prepare it.

    takes(module, config): is `module` a float layer of this kind under `config` (exact types only).
    prepare(module, config, ctx): the fake-quant module (same Parameter objects); raises Refused(reason).
    layer: one weight per module (the callback's per-layer metrics read it); attention is a container.
    """

    name: str
    takes: Callable[[nn.Module, QuantConfig], bool]
    fake: type
    integer: type
    deployed: type
    prepare: Callable[[nn.Module, QuantConfig, PrepareContext], nn.Module]
    layer: bool = True


@dataclass(frozen=True)
class Foreign:
    """Another library's fake-quant module: `matches(m)`; `convert(m)` -> an intqat integer module."""

    name: str
    matches: Callable[[nn.Module], bool]
    convert: Callable[[nn.Module], nn.Module]


# -- wrappers: classes around a layer class that keep its forward --------------------------------------

_UNWRAPPERS: list[Callable[[type], type | None]] = []


def register_wrapper(unwrap: Callable[[type], type | None]) -> None:
    """Teach the table a wrapping class: `unwrap(cls)` returns the layer class `cls` wraps without changing its
    forward (FSDP2's FSDPLinear -> nn.Linear), or None for any class it does not know."""
    if unwrap not in _UNWRAPPERS:
        _UNWRAPPERS.append(unwrap)


def base_type(m: nn.Module) -> type:
    """type(m), or the class a registered wrapper wraps (the type the table matches exactly)."""
    t = type(m)
    for unwrap in _UNWRAPPERS:
        inner = unwrap(t)
        if inner is not None:
            return inner
    return t


# -- intqat's own kinds ------------------------------------------------------------------------------


def _is_conv1d(m: nn.Module) -> bool:
    # transformers' Conv1D, exactly or under a registered wrapper
    if is_hf_conv1d(m):
        return True
    mod = sys.modules.get("transformers.pytorch_utils")
    return mod is not None and base_type(m) is getattr(mod, "Conv1D", None)


def _is_linear(m: nn.Module) -> bool:
    return base_type(m) is nn.Linear or _is_conv1d(m)


def _grouped(config: QuantConfig) -> bool:
    return config.weight.granularity == "group"


def _refuse_grouped(m: nn.Module, config: QuantConfig) -> None:
    # their integer modules hold one scale per output channel: a per-group config must not quietly become another scheme
    if _grouped(config):
        raise Refused(f"nn.{base_type(m).__name__}: per-group weights (group_size {config.weight.group_size}) are implemented "
                      "for nn.Linear and transformers' Conv1D; prepare it with a per-channel config (e.g. a second "
                      "prepare_qat with filter_fn)")


def _prepare_grouped(m: nn.Module, config: QuantConfig, ctx: PrepareContext) -> nn.Module:
    transposed = _is_conv1d(m)
    in_features = m.weight.shape[0 if transposed else 1]
    if in_features % config.weight.group_size:
        raise Refused(f"in_features {in_features} is not a multiple of group_size {config.weight.group_size}")
    return FakeQuantGroupedLinear.from_linear(m, config, transposed=transposed)


def _prepare_conv(m: nn.Module, config: QuantConfig, ctx: PrepareContext) -> nn.Module:
    _refuse_grouped(m, config)
    if conv_padding(m) is None:
        raise Refused(f"padding {m.padding!r}, mode {m.padding_mode!r}: no symmetric zero padding")
    bn = None
    if id(m) in ctx.conv_bn_pairs:
        bn_parent, bn_name, bn = ctx.conv_bn_pairs[id(m)]
        bn_parent._modules[bn_name] = nn.Identity()  # folded into the conv
    return FakeQuantConv2d.from_conv(m, config, bn)


def _prepare_attention(m: nn.Module, config: QuantConfig, ctx: PrepareContext) -> nn.Module:
    _refuse_grouped(m, config)
    return FakeQuantMultiheadAttention.from_mha(m, config)


def _prepare_embedding(m: nn.Module, config: QuantConfig, ctx: PrepareContext) -> nn.Module:
    try:
        return FakeQuantEmbedding.from_embedding(m, config)
    except ValueError as e:
        raise Refused(str(e)) from None


# Order matters where two kinds take the same float type: the first whose `takes` says yes prepares it.
KINDS: tuple[Kind, ...] = (
    Kind("attention", lambda m, c: base_type(m) is nn.MultiheadAttention, FakeQuantMultiheadAttention, IntMultiheadAttention,
         DeployedIntMultiheadAttention, _prepare_attention, layer=False),
    Kind("grouped_linear", lambda m, c: _grouped(c) and _is_linear(m), FakeQuantGroupedLinear, GroupedIntLinear,
         DeployedGroupedIntLinear, _prepare_grouped),
    Kind("linear", lambda m, c: _is_linear(m), FakeQuantLinear, IntLinear, DeployedIntLinear,
         lambda m, c, ctx: FakeQuantLinear.from_linear(m, c, transposed=_is_conv1d(m))),
    Kind("embedding", lambda m, c: base_type(m) is nn.Embedding and c.embedding is not None, FakeQuantEmbedding, IntEmbedding,
         DeployedIntEmbedding, _prepare_embedding),
    Kind("conv2d", lambda m, c: base_type(m) is nn.Conv2d, FakeQuantConv2d, IntConv2d, DeployedIntConv2d, _prepare_conv),
)

_LAYERS = tuple(k for k in KINDS if k.layer)
FAKE_QUANT_TYPES: tuple[type, ...] = tuple(k.fake for k in _LAYERS)
INTEGER_TYPES: tuple[type, ...] = tuple(k.integer for k in _LAYERS)
DEPLOYED_TYPES: tuple[type, ...] = tuple(k.deployed for k in _LAYERS)
# Kept apart from the layer types above: those hold one weight each; an attention module holds several projections.
ATTENTION_TYPES: tuple[type, ...] = tuple(t for k in KINDS if not k.layer for t in (k.fake, k.integer, k.deployed))
QUANT_TYPES: tuple[type, ...] = FAKE_QUANT_TYPES + INTEGER_TYPES + DEPLOYED_TYPES + ATTENTION_TYPES

_STAGE = {t: (k, s) for k in KINDS for s, t in (("fake", k.fake), ("integer", k.integer), ("deployed", k.deployed))}


def kind_of(m: nn.Module) -> Kind | None:
    """The kind of an intqat fake-quant / integer / deployed module (None for anything else)."""
    hit = _STAGE.get(type(m))
    if hit is None:  # a subclass of one of intqat's modules
        hit = next((v for t, v in _STAGE.items() if isinstance(m, t)), None)
    return hit[0] if hit else None


def stage(m: nn.Module) -> str | None:
    """'fake' | 'integer' | 'deployed' for intqat's modules, 'foreign' for another library's fake quant, else None."""
    hit = _STAGE.get(type(m)) or next((v for t, v in _STAGE.items() if isinstance(m, t)), None)
    if hit is not None:
        return hit[1]
    return "foreign" if is_foreign_fake_quant(m) else None


def is_quantized(m: nn.Module) -> bool:
    """An intqat quantized module, or another library's fake-quant module intqat converts."""
    return isinstance(m, QUANT_TYPES) or is_foreign_fake_quant(m)


def kind_for_float(m: nn.Module, config: QuantConfig) -> Kind | None:
    """The kind that prepares float module `m` under `config`, or None (not a layer intqat quantizes as such)."""
    return next((k for k in KINDS if k.takes(m, config)), None)


# -- other libraries' fake quant ---------------------------------------------------------------------

FOREIGN: list[Foreign] = []


def register_converter(predicate: Callable[[nn.Module], bool], convert: Callable[[nn.Module], nn.Module],
                       name: str | None = None) -> None:
    """Teach `to_integer` another library's fake-quant module: `convert(m)` returns an intqat integer module
    (or an nn.Sequential holding one) sharing m's Parameters; it raises ValueError with the reason it cannot."""
    FOREIGN.append(Foreign(name or getattr(convert, "__name__", "converter"), predicate, convert))


def is_foreign_fake_quant(m: nn.Module) -> bool:
    return any(f.matches(m) for f in FOREIGN)


def to_integer_module(m: nn.Module) -> nn.Module | None:
    """The integer module for fake-quant module `m` (intqat's or a registered library's); None if it is neither.
    A converter's ValueError (it cannot convert this one) propagates with its reason."""
    k = kind_of(m)
    if k is not None:
        return k.integer.from_fake_quant(m) if isinstance(m, k.fake) else None
    conv = next((f.convert for f in FOREIGN if f.matches(m)), None)
    return conv(m) if conv is not None else None


# -- swapping modules ---------------------------------------------------------------------------------

_REPLACE_HOOKS: list[Callable[[nn.Module, nn.Module], None]] = []


def on_replace(hook: Callable[[nn.Module, nn.Module], None]) -> Callable[[nn.Module, nn.Module], None]:
    """Call hook(old, new) after every module swap intqat makes (prepare, to_integer, to_deployed). For
    whatever tracks modules by identity: FSDP2's parameter groups, pruning's hooks. Returns the hook."""
    _REPLACE_HOOKS.append(hook)
    return hook


# FSDP2: its FSDPLinear / FSDPConv2d / ... are the float layers they wrap; a swap keeps its parameter groups,
# hooks and sharding on the new module (intqat.distributed.fsdp; both do nothing until FSDP2 is in use)
register_wrapper(_fsdp.unwrap_type)
on_replace(_fsdp.carry_state)


def replace(parent: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """parent.<name> = new (registered as the same child), then the on_replace hooks; returns new."""
    old = parent._modules[name]
    parent._modules[name] = new
    if old is not new:
        for hook in _REPLACE_HOOKS:
            hook(old, new)
    return new


# -- the census: float layers, and why ----------------------------------------------------------------

_FLOAT_TYPES: list[type] = [nn.Linear, nn.Conv2d, nn.MultiheadAttention]
_OTHER_CONVS = (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_RECURRENT = (nn.RNNBase,)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def register_float_type(t: type) -> None:
    """Another float layer type the census should name when it is left float (its subclasses too)."""
    if t not in _FLOAT_TYPES:
        _FLOAT_TYPES.append(t)


def is_float_layer(m: nn.Module) -> bool:
    """A module the census names when it computes in float: linear-like layers, convs, BatchNorm, attention,
    recurrent layers, embeddings."""
    return isinstance(m, tuple(_FLOAT_TYPES) + _OTHER_CONVS + _BNS + _RECURRENT + _EMBEDDINGS) or _is_conv1d(m)


def subclass_reason(m: nn.Module) -> str:
    base = next(b for b in _FLOAT_TYPES if isinstance(m, b))
    # (a wrapping class intqat does not know reads the same: intqat.registry.register_wrapper teaches one)
    return f"{type(m).__name__}: a subclass of nn.{base.__name__} whose forward intqat cannot vouch for"


def float_reason(m: nn.Module, config: QuantConfig | None = None) -> str:
    """Why float module `m` computes in float, when nothing more specific was recorded."""
    t = base_type(m)
    if isinstance(m, _OTHER_CONVS):
        return f"{t.__name__}: intqat has integer modules for Conv2d only"
    if t is nn.BatchNorm2d:
        return "BatchNorm2d not folded: no Conv2d's output feeds it alone (or its conv stays float)"
    if isinstance(m, _BNS):
        return f"{t.__name__}: only a BatchNorm2d after a Conv2d folds"
    if isinstance(m, _RECURRENT):
        return f"{t.__name__}: intqat has no integer recurrent layer; its weights compute in float"
    if t is nn.Embedding:
        return ("nn.Embedding: QuantConfig.embedding is None, so embeddings stay float (as torchao's 8da4w does); "
                "set it to quantize them, e.g. {'preset': '8da4w', 'embedding': {'bits': 4, 'granularity': 'group', "
                "'group_size': 32}}")
    if isinstance(m, _EMBEDDINGS):
        return f"{t.__name__}: intqat quantizes nn.Embedding only (QuantConfig.embedding)"
    if not any(t is f for f in _FLOAT_TYPES) and not _is_conv1d(m):
        return subclass_reason(m)
    kind = f"nn.{t.__name__}" if t.__module__.startswith("torch.nn") else t.__name__
    return f"{kind}: left float when the model was prepared (a filter_fn, another library's prepare, or added since)"


def describe() -> list[dict[str, Any]]:
    """The table as rows (docs, `intqat-graphs`, tests): kind, fake / integer / deployed class names."""
    rows = [{"kind": k.name, "fake": k.fake.__name__, "integer": k.integer.__name__, "deployed": k.deployed.__name__}
            for k in KINDS]
    rows += [{"kind": f.name, "fake": "(another library's)", "integer": "see intqat.interop", "deployed": ""}
             for f in FOREIGN]
    return rows
