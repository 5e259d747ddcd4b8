"""Self-describing checkpoints: which layers are fake-quant / integer, and each one's QuantConfig.

A checkpoint saved after the swap holds keys a float model lacks (`net.0.input_quantizer.scale`,
...), so the quantized layers must exist before its weights load. `save_quant_structure` writes
one record where each reader finds it:

    checkpoint["intqat"]                          restore_quant_structure (code outside Lightning),
                                                  IntQAT, intqat-export
    checkpoint["state_dict"]._metadata[""]        the load_state_dict pre-hook `register_restore_hook`
        ["intqat"]                                adds (torch keeps a state_dict's _metadata through
                                                  torch.save / torch.load, weights_only too)
    checkpoint["hyper_parameters"]["_instantiator"] = "intqat.checkpoint.instantiate_module"

`LightningModule.load_from_checkpoint` builds the module through the instantiator its
hyper-parameters name (lightning/pytorch/core/saving.py, `_load_state`): `instantiate_module`
calls `cls(**hparams)` as Lightning would, then adds that pre-hook, so a plain LightningModule,
with no intqat code, quantizes its layers just before its weights load. Lightning >= 2.6.6 runs only
instantiators in its allowlist; `trust_in_lightning()` (run by `import intqat`) adds this one, now
or as soon as Lightning loads. What the instantiator does is what Lightning does plus the swap:
it runs no code named by the checkpoint.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from torch import nn

from intqat.config import QuantConfig

__all__ = [
    "CHECKPOINT_KEY", "INSTANTIATOR", "save_quant_structure", "restore_quant_structure",
    "register_restore_hook", "instantiate_module", "trust_in_lightning",
]

CHECKPOINT_KEY = "intqat"
# 2: each layer's whole QuantConfig (every field, grad_gemm included); 1: weight / activation specs only
FORMAT = 2
INSTANTIATOR = "intqat.checkpoint.instantiate_module"
_QUANT_KEY = ".input_quantizer.observer_enabled"  # in the state_dict of every quantized layer
_GROUP_KEY = ".weight_quantizer.group_size_"  # ... and of every per-group one (embeddings have no input quantizer)
_SAVING = "lightning.pytorch.core.saving"


def _quant_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(fake-quant, integer) module types a checkpoint records: the layers and the attention modules."""
    from intqat.nn import FakeQuantMultiheadAttention, IntMultiheadAttention
    from intqat.registry import FAKE_QUANT_TYPES, INTEGER_TYPES

    return FAKE_QUANT_TYPES + (FakeQuantMultiheadAttention,), INTEGER_TYPES + (IntMultiheadAttention,)


# -- the record ----------------------------------------------------------------------------------


def layer_record(m: nn.Module) -> dict[str, Any]:
    """{"kind": "fake" | "integer", <every QuantConfig field the layer carries>: value}.

    weight / activation come from the layer's quantizers; any other field (grad_gemm, and fields
    added later) from the layer's attribute of the same name. Convolutions have no grad_gemm.
    """
    _, integer = _quant_types()
    rec: dict[str, Any] = {"kind": "integer" if isinstance(m, integer) else "fake"}
    # attention (intqat.nn.attention): one config for all its projections, read from the query's
    weight_q = getattr(m, "weight_quantizer", None) or getattr(m, "in_proj_weight_quantizer", None) or m.q_proj_weight_quantizer
    input_q = getattr(m, "input_quantizer", None) or getattr(m, "q_input_quantizer", None)
    for f in fields(QuantConfig):
        if f.name == "weight":
            rec[f.name] = asdict(weight_q.spec)
        elif f.name == "activation":
            # embeddings (intqat.nn.embedding) have no input quantizer: None marks an embedding's record
            rec[f.name] = asdict(input_q.spec) if input_q is not None else None
        elif f.name == "embedding":  # an embedding's spec is its weight's; other layers have none
            rec[f.name] = asdict(weight_q.spec) if input_q is None else None
        elif hasattr(m, f.name):
            rec[f.name] = getattr(m, f.name)
    return rec


def _config_of(fqn: str, rec: Mapping) -> QuantConfig:
    kw = {k: v for k, v in rec.items() if k != "kind"}
    valid = [f.name for f in fields(QuantConfig)]
    unknown = sorted(set(kw) - set(valid))
    if unknown:
        raise ValueError(
            f"checkpoint layer {fqn!r} records QuantConfig field(s) {unknown} this intqat does not know "
            f"(it knows {', '.join(valid)}): load it with the intqat release that saved it, or a newer one"
        )
    if kw.get("activation", {}) is None:  # an embedding: its weight spec is the config's embedding spec
        return QuantConfig(embedding=kw["weight"])
    kw.pop("embedding", None)  # (a layer's config: embeddings are configured apart)
    return QuantConfig(**kw)


def save_quant_structure(module: nn.Module, checkpoint: dict) -> None:
    """Record the fake-quant / integer layers of `module` and their configs in the checkpoint.

    IntQAT calls it in on_save_checkpoint; a LightningModule calls it itself only for
    ModelCheckpoint(save_weights_only=True), where Lightning skips the callbacks' hook.
    """
    from intqat._version import __version__

    fake, integer = _quant_types()
    layers = {fqn: layer_record(m) for fqn, m in module.named_modules() if isinstance(m, fake + integer)}
    record = {"format": FORMAT, "intqat_version": __version__, "modules": layers}
    checkpoint[CHECKPOINT_KEY] = record
    if not layers:
        return
    metadata = getattr(checkpoint.get("state_dict"), "_metadata", None)
    if metadata is not None:  # (None: a strategy that gathers a plain dict, e.g. FSDP's)
        metadata[""] = {**metadata.get("", {}), CHECKPOINT_KEY: record}
    if hasattr(module, "CHECKPOINT_HYPER_PARAMS_KEY"):  # a LightningModule
        _name_instantiator(module, checkpoint)


def _name_instantiator(module: nn.Module, checkpoint: dict) -> None:
    key = module.CHECKPOINT_HYPER_PARAMS_KEY
    hparams = checkpoint.get(key)
    hparams = {} if hparams is None else hparams
    current = hparams.get("_instantiator") if isinstance(hparams, Mapping) else None
    # Lightning passes all hyper-parameters as one argument when save_hyperparameters got one
    # dict / Namespace (`def __init__(self, hparams)`): an `_instantiator` inside would reach it
    packed = checkpoint.get(module.CHECKPOINT_HYPER_PARAMS_NAME)
    init_args = list(inspect.signature(type(module).__init__).parameters)[1:]
    if current == INSTANTIATOR:
        return
    if not isinstance(hparams, Mapping) or current is not None or (packed and packed in init_args):
        why = (f"its hyper-parameters name another instantiator ({current!r})" if current is not None
               else f"its hyper-parameters are passed as one argument ({packed!r})")
        if type(module).on_load_checkpoint is _lightning_on_load_checkpoint():
            _warn_once(
                f"intqat: {type(module).__name__}.load_from_checkpoint cannot rebuild the quantized layers by "
                f"itself ({why}); add def on_load_checkpoint(self, checkpoint): "
                "intqat.callback.restore_quant_structure(self, checkpoint)"
            )
        return
    checkpoint[key] = {**hparams, "_instantiator": INSTANTIATOR}


def _lightning_on_load_checkpoint():
    from lightning.pytorch import LightningModule

    return LightningModule.on_load_checkpoint


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def _record_in(checkpoint: Mapping) -> Mapping | None:
    record = checkpoint.get(CHECKPOINT_KEY)
    if record is None:  # a bare state_dict, or a checkpoint whose top-level record was dropped
        state_dict = checkpoint.get("state_dict", checkpoint)
        record = (getattr(state_dict, "_metadata", None) or {}).get("", {}).get(CHECKPOINT_KEY)
    return record


# -- restoring ------------------------------------------------------------------------------------


def restore_quant_structure(module: nn.Module, checkpoint: Mapping) -> None:
    """Quantize the layers recorded in the checkpoint (each with its saved QuantConfig) so that its
    state_dict loads. `checkpoint` is a Lightning checkpoint dict, or a state_dict that a checkpoint
    held (its record travels in the state_dict's _metadata).

    For code outside Lightning: LightningModule.load_from_checkpoint needs no call (see the module
    docstring). Layers already quantized stay as they are: calling it twice changes nothing.
    """
    record = _record_in(checkpoint)
    if record is None:
        still_float = [f for f in _quantized_fqns(checkpoint.get("state_dict", {})) if not _is_quant(module, f)]
        if still_float:
            raise ValueError(
                f"the checkpoint holds quantized layers {still_float} but no checkpoint['{CHECKPOINT_KEY}'] record "
                "(saved with ModelCheckpoint(save_weights_only=True)?); have the LightningModule write it: "
                "def on_save_checkpoint(self, checkpoint): intqat.callback.save_quant_structure(self, checkpoint)"
            )
        return
    _restore(module, record)


def _restore(module: nn.Module, record: Mapping) -> None:
    from intqat.convert import prepare_qat, to_integer

    fake, integer = _quant_types()
    if record.get("format", 1) > FORMAT:
        raise ValueError(
            f"the checkpoint's intqat record has format {record['format']} (intqat {record.get('intqat_version')}); "
            f"this intqat reads formats up to {FORMAT}: upgrade intqat to load it"
        )
    layers = record["modules"]
    by_config: dict[QuantConfig, set[str]] = {}
    for fqn, rec in layers.items():
        if not _is_quant(module, fqn):
            by_config.setdefault(_config_of(fqn, rec), set()).add(fqn)
    for cfg, fqns in by_config.items():
        with warnings.catch_warnings():
            # each pass quantizes its config's layers only: its census would call the other configs' layers (and
            # the record's float ones, named when that run prepared them) "left in float, filter_fn returned False"
            warnings.filterwarnings("ignore", message="prepare_qat left these modules in float")
            prepare_qat(module, cfg, filter_fn=lambda m, n, fqns=fqns: n in fqns)
    wanted_integer = {f for f, rec in layers.items() if rec["kind"] == "integer"}
    if any(not isinstance(_find(module, f), integer) for f in wanted_integer):
        with warnings.catch_warnings():  # (the checkpoint's state brings the scales the fresh layers lack)
            warnings.filterwarnings("ignore", message="to_integer: the input quantizers")
            to_integer(module, filter_fn=lambda m, n: n in wanted_integer)
    for fqn, rec in layers.items():
        m = _find(module, fqn)
        if not isinstance(m, integer if rec["kind"] == "integer" else fake):
            raise ValueError(
                f"checkpoint layer {fqn!r} is a {rec['kind']} quantized layer but the model has "
                f"{type(m).__name__ if m is not None else 'no such module'} there: build the model with the "
                "architecture of the run that saved the checkpoint"
            )
        here = layer_record(m)
        saved = {k: v for k, v in rec.items() if k != "kind"}
        if {k: here.get(k) for k in saved} != saved:
            raise ValueError(
                f"layer {fqn!r} was quantized with {saved} in the checkpoint but with "
                f"{ {k: here.get(k) for k in saved} } here: pass the checkpoint's config, e.g. IntQAT(config=...) "
                "as in the run that saved it"
            )


def _quantized_fqns(state_dict: Mapping, prefix: str = "") -> list[str]:
    found = set()
    for key in (_QUANT_KEY, _GROUP_KEY):
        found.update(k[len(prefix) : -len(key)] for k in state_dict if k.startswith(prefix) and k.endswith(key))
    return sorted(found)


def _find(module: nn.Module, fqn: str) -> nn.Module | None:
    try:
        return module.get_submodule(fqn)
    except AttributeError:
        return None


def _is_quant(module: nn.Module, fqn: str) -> bool:
    fake, integer = _quant_types()
    return isinstance(_find(module, fqn), fake + integer)


# -- load_state_dict and load_from_checkpoint -----------------------------------------------------


def _restore_before_load(module: nn.Module, state_dict, prefix, local_metadata, *args) -> None:
    # runs in module._load_from_state_dict, before torch descends into the children: the layers
    # swapped here are the ones that receive their weights
    record = local_metadata.get(CHECKPOINT_KEY)
    if record is not None:
        _restore(module, record)


def register_restore_hook(module: nn.Module) -> nn.Module:
    """Make `module.load_state_dict(sd)` quantize the layers `sd` records (in its _metadata, as
    intqat checkpoints' state_dicts do) before loading. Registering twice adds one hook."""
    if not module.__dict__.get("_intqat_restore_hook", False):
        module.register_load_state_dict_pre_hook(_restore_before_load)
        module.__dict__["_intqat_restore_hook"] = True
    return module


def instantiate_module(cls: type, kwargs: dict[str, Any]) -> nn.Module:
    """The instantiator intqat checkpoints name for LightningModule.load_from_checkpoint:
    `cls(**kwargs)`, as Lightning builds a module, with `register_restore_hook` added."""
    return register_restore_hook(cls(**kwargs))


def _allow(saving) -> None:
    allowed = getattr(saving, "_ALLOWED_INSTANTIATORS", None)
    if isinstance(allowed, set):  # Lightning < 2.6.6 has no allowlist: it imports any instantiator
        allowed.add(INSTANTIATOR)


class _AllowWhenLoaded(importlib.abc.MetaPathFinder):
    """Adds INSTANTIATOR to the allowlist right after lightning.pytorch.core.saving executes; finds
    nothing itself (the regular finders do) and leaves sys.meta_path after that one import."""

    def find_spec(self, name, path, target=None):
        if name != _SAVING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_then_allow(module):
                exec_module(module)
                _allow(module)

            spec.loader.exec_module = exec_then_allow  # (a loader instance made for this one spec)
        return spec


def trust_in_lightning() -> None:
    """Let Lightning's load_from_checkpoint use INSTANTIATOR: at once if Lightning is loaded, else
    when it loads (`import intqat` needs no Lightning import, which takes seconds)."""
    saving = sys.modules.get(_SAVING)
    if saving is not None:
        _allow(saving)
    elif not any(isinstance(f, _AllowWhenLoaded) for f in sys.meta_path):
        sys.meta_path.insert(0, _AllowWhenLoaded())


trust_in_lightning()
