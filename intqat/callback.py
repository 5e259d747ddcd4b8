"""IntQAT: a Lightning callback that takes a model from float through fake quantization to integer
training on a schedule, keeps the optimizer's state across the swaps, checkpoints the module
structure, logs per-layer quantization error and stops on a non-finite loss or scale.

Checkpoints describe themselves (intqat.checkpoint): each records its quantized layers with their
QuantConfig, so `MyModule.load_from_checkpoint(path)` rebuilds them on a plain LightningModule with
no intqat code in it, and Trainer.fit / validate / test(ckpt_path=...) rebuild them while an IntQAT
is in the Trainer (a load_state_dict pre-hook quantizes the layers the state_dict holds quantized,
then on_load_checkpoint swaps those recorded as integer). Only ModelCheckpoint(save_weights_only=True),
which skips callbacks' on_save_checkpoint, needs the module to write the record itself:

    def on_save_checkpoint(self, checkpoint):
        intqat.callback.save_quant_structure(self, checkpoint)

Code outside Lightning calls `intqat.callback.restore_quant_structure(model, checkpoint)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Union

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelPruning
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.nn.utils import prune
from typing_extensions import override

from intqat.checkpoint import (
    CHECKPOINT_KEY,
    _find,
    _quantized_fqns,
    restore_quant_structure,
    save_quant_structure,
)
from intqat.config import QuantConfig, resolve_config
from intqat.convert import freeze_bn_stats, freeze_observers, prepare_qat, to_integer
from intqat.distributed.fsdp import is_sharded
from intqat.distributed.shards import broadcast_batchnorm_stats
from intqat.nn import ActivationQuantizer, FakeQuantMultiheadAttention
from intqat.registry import ATTENTION_TYPES, FAKE_QUANT_TYPES, INTEGER_TYPES
from intqat.training.quant_metrics import LayerMonitor, non_finite_scales

__all__ = ["IntQAT", "NonFiniteError", "restore_quant_structure", "save_quant_structure", "CHECKPOINT_KEY"]

STAGES = ("prepare", "freeze_bn", "freeze_observers", "integer")
_QUANT = FAKE_QUANT_TYPES + INTEGER_TYPES
When = Union[int, None, Callable[[Trainer, LightningModule], bool]]


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or quantization scale; IntQAT stopped it."""


# -- torch.nn.utils.prune across swaps --------------------------------------------------------


def _move_pruning(old: nn.Module, new: nn.Module) -> None:
    """Carry prune's re-parametrisation (<name>_orig Parameter, <name>_mask buffer, forward pre-hook)
    over to the replacement. The swap built `new` from `old.<name>`: the masked product of the last
    forward, a plain tensor no optimizer updates and whose graph is gone."""
    for hook in list(old._forward_pre_hooks.values()):
        if not isinstance(hook, prune.BasePruningMethod):
            continue
        name = hook._tensor_name
        if hasattr(new, name):
            delattr(new, name)
        new.register_parameter(name + "_orig", getattr(old, name + "_orig"))
        new.register_buffer(name + "_mask", getattr(old, name + "_mask"))
        new.register_forward_pre_hook(hook)
        setattr(new, name, hook.apply_mask(new))


def _retarget_pruning_callbacks(trainer: Trainer, replaced: dict[int, nn.Module]) -> None:
    # ModelPruning keeps the (module, name) pairs of its setup(): point them at the replacements
    for cb in trainer.callbacks:
        pairs = getattr(cb, "_parameters_to_prune", None) if isinstance(cb, ModelPruning) else None
        if isinstance(pairs, (list, tuple)):
            cb._parameters_to_prune = [(replaced.get(id(m), m), n) for m, n in pairs]


def _sharded_checkpoint(trainer: Trainer) -> bool:
    """Is the Trainer restoring a distributed checkpoint (ModelParallelStrategy's directory of shards)?"""
    if trainer.ckpt_path is None or not isinstance(trainer.strategy, ModelParallelStrategy):
        return False
    from intqat.distributed.lightning import is_sharded_checkpoint

    return is_sharded_checkpoint(trainer.ckpt_path)


# -- argument checks --------------------------------------------------------------------------


def _check_when(name: str, when: Any) -> When:
    if when is None or callable(when):
        return when
    if isinstance(when, bool) or not isinstance(when, int):
        raise TypeError(
            f"IntQAT({name}={when!r}): give an int (epoch or step index), None (never) or a callable "
            f"(trainer, pl_module) -> bool, e.g. IntQAT({name}=2)"
        )
    if when < 0:
        raise ValueError(f"IntQAT({name}={when}): must be >= 0, e.g. IntQAT({name}=0)")
    return when


def _describe(x: Any) -> Any:
    # state_key must be the same in every process and every run: no memory addresses
    return x if x is None or isinstance(x, int) else getattr(x, "__qualname__", type(x).__name__)


class IntQAT(Callback):
    r"""Quantization-aware training through integer arithmetic, on a schedule.

    Each stage starts at an epoch (``unit="epoch"``) or optimizer step (``unit="step"``, counted in
    ``trainer.global_step``), never (``None``), or when a callable ``(trainer, pl_module) -> bool``
    first returns True on rank 0:

    1. ``prepare_at``: nn.Linear / nn.Conv2d -> fake quant (:func:`intqat.prepare_qat`). At 0 it runs in
       ``setup``, before ``configure_optimizers``, so learned (LSQ) scales are in the optimizer; later,
       new Parameters join ``trainer.optimizers[0]`` as a new param group (the first group's lr, no
       weight decay; LR schedulers built before do not schedule it).
    2. ``freeze_bn_at``: folded BatchNorm uses its running statistics from then on.
    3. ``freeze_observers_at``: activation ranges stop following the data.
    4. ``integer_at``: fake quant -> integer modules (:func:`intqat.to_integer`).

    The swaps keep the Parameter objects, so the optimizer keeps its state. Each training step logs
    ``quant/stage`` (0 float, 1 fake quant, 2 integer). Every ``quant_metrics_every_n_steps`` steps,
    and over each validation / test epoch, it logs per quantized layer ``<prefix>/<fqn>/sqnr_db``
    and ``<prefix>/<fqn>/saturation``, and the mean ``<prefix>/sqnr_db`` (progress bar), with prefix
    ``quant``, ``quant_val`` or ``quant_test``. A non-finite loss or scale raises
    :class:`NonFiniteError` before any checkpoint of that step is written.

    .. code-block:: python

        from lightning.pytorch import Trainer
        from intqat import IntQAT

        qat = IntQAT("w8a8", prepare_at=0, freeze_bn_at=3, freeze_observers_at=5, integer_at=6)
        trainer = Trainer(max_epochs=10, callbacks=[qat])
        trainer.fit(model)

    Args:
        config: a :class:`~intqat.QuantConfig`, a preset name ("w8a8", "w8a8_lsq", ...) or a dict.
        prepare_at, freeze_bn_at, freeze_observers_at, integer_at: when each stage starts.
        unit: ``"epoch"`` (stages start in ``on_train_epoch_start``) or ``"step"`` (``on_train_batch_start``).
        filter_fn: ``(module, fqn) -> bool``; False keeps a layer float. fqn is relative to the LightningModule.
        export_on_fit_end, export_dir, export_fn: when True, call ``export_fn(pl_module, trainer, export_dir)``
            on rank 0 as fit ends (``export_dir`` defaults to ``<default_root_dir>/export``); when False
            the other two are ignored (a config can keep them and switch export off).
        log_quant_metrics: measure and log the per-layer SQNR and saturation.
        quant_metrics_every_n_steps: measure one training step out of that many.
    """

    def __init__(
        self,
        config: QuantConfig | str | dict = "w8a8",
        prepare_at: When = 0,
        freeze_bn_at: When = None,
        freeze_observers_at: When = None,
        integer_at: When = None,
        unit: str = "epoch",
        filter_fn: Callable[[nn.Module, str], bool] | None = None,
        export_on_fit_end: bool = False,
        export_dir: str | os.PathLike | None = None,
        export_fn: Callable[[LightningModule, Trainer, str], Any] | None = None,
        log_quant_metrics: bool = True,
        quant_metrics_every_n_steps: int = 50,
    ):
        try:
            self.config = resolve_config(config)
        except (ValueError, TypeError) as e:
            raise type(e)(f"IntQAT(config={config!r}): {e}") from e
        self._schedule = {
            "prepare": _check_when("prepare_at", prepare_at),
            "freeze_bn": _check_when("freeze_bn_at", freeze_bn_at),
            "freeze_observers": _check_when("freeze_observers_at", freeze_observers_at),
            "integer": _check_when("integer_at", integer_at),
        }
        for a, b in [("prepare", "freeze_bn"), ("prepare", "freeze_observers"), ("prepare", "integer"),
                     ("freeze_bn", "integer"), ("freeze_observers", "integer")]:  # fmt: skip
            wa, wb = self._schedule[a], self._schedule[b]
            if isinstance(wa, int) and isinstance(wb, int) and wa > wb:
                raise ValueError(
                    f"IntQAT({a}_at={wa}, {b}_at={wb}): stages run prepare -> freeze_bn / freeze_observers -> "
                    f"integer, so {a} cannot start after {b}; e.g. IntQAT({a}_at={wb}, {b}_at={wb})"
                )
        if unit not in ("epoch", "step"):
            raise ValueError(
                f"IntQAT(unit={unit!r}): use unit='epoch' (stages start at epoch boundaries) or unit='step' "
                "(at optimizer steps, trainer.global_step)"
            )
        if filter_fn is not None and not callable(filter_fn):
            raise TypeError(f"IntQAT(filter_fn={filter_fn!r}): give a callable (module, fqn) -> bool or None")
        if export_fn is not None and not callable(export_fn):
            raise TypeError(f"IntQAT(export_fn={export_fn!r}): give a callable (pl_module, trainer, export_dir)")
        if export_on_fit_end and export_fn is None:
            raise ValueError(
                "IntQAT(export_on_fit_end=True) needs the exporter: IntQAT(export_on_fit_end=True, "
                "export_fn=my_export) with my_export(pl_module, trainer, export_dir)"
            )
        if not isinstance(log_quant_metrics, bool):
            raise TypeError(f"IntQAT(log_quant_metrics={log_quant_metrics!r}): give True or False")
        n = quant_metrics_every_n_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"IntQAT(quant_metrics_every_n_steps={n!r}): give an int >= 1, e.g. 50")
        if self.config.activation.learnable and self._schedule["freeze_observers"] is None:
            rank_zero_warn(
                "IntQAT: the observers overwrite learned activation scales at every training step until they "
                "are frozen; set freeze_observers_at, e.g. IntQAT('w8a8_lsq', freeze_observers_at=1)"
            )
        self.unit, self.filter_fn = unit, filter_fn
        self.export_on_fit_end, self.export_dir, self.export_fn = export_on_fit_end, export_dir, export_fn
        self.log_quant_metrics, self.quant_metrics_every_n_steps = log_quant_metrics, n
        # checkpointed (state_dict / load_state_dict)
        self._reached = dict.fromkeys(STAGES, False)
        self.boundaries: dict[str, dict[str, int]] = {}  # stage -> {"epoch": e, "step": s} where it started
        self._owned: set[str] | None = None  # layers this instance prepared (None: every intqat layer)
        self._added_param_group = False
        # per run, rebuilt from the model
        self._monitor = LayerMonitor()
        self._sharded = False  # does FSDP2 shard the model (known once the strategy set it up)
        self._load_hook = None
        self._sanity_snapshot: list | None = None
        self._batch_step = self._log_step = 0

    # -- state -----------------------------------------------------------------------------------
    @property
    @override
    def state_key(self) -> str:
        schedule = {f"{s}_at": _describe(w) for s, w in self._schedule.items()}
        return self._generate_state_key(unit=self.unit, filter_fn=_describe(self.filter_fn), **schedule)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "reached": dict(self._reached),
            "boundaries": {k: dict(v) for k, v in self.boundaries.items()},
            "owned": None if self._owned is None else sorted(self._owned),
            "added_param_group": self._added_param_group,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["config"] != self.config.to_dict():
            raise ValueError(
                f"the checkpoint was trained with IntQAT(config={state_dict['config']}) but this IntQAT has "
                f"config={self.config.to_dict()}: pass the checkpoint's config"
            )
        self._reached = {**dict.fromkeys(STAGES, False), **state_dict["reached"]}
        self.boundaries = {k: dict(v) for k, v in state_dict["boundaries"].items()}
        self._owned = None if state_dict["owned"] is None else set(state_dict["owned"])
        self._added_param_group = state_dict["added_param_group"]

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        save_quant_structure(pl_module, checkpoint)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # The weights are in already (Lightning restores the model before the callbacks): swap the
        # layers recorded as integer, check every layer's spec against the record.
        restore_quant_structure(pl_module, checkpoint)
        if _sharded_checkpoint(trainer):
            # ModelParallelStrategy loaded the distributed checkpoint into the keys the model had before
            # the swaps (a float model's has no quantizer state): load it again into the quantized layers
            from intqat.distributed.lightning import reload_sharded_state

            reload_sharded_state(trainer, trainer.ckpt_path)
        self._refresh(pl_module)

    def _load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
        """Before a state_dict loads into the LightningModule: quantize the layers it holds quantized."""
        in_state = set(_quantized_fqns(state_dict, prefix))
        float_in_state = [
            f for f, m in module.named_modules()
            if isinstance(m, _QUANT) and f not in in_state and f"{prefix}{f}.weight" in state_dict
        ]  # fmt: skip
        if float_in_state:
            raise ValueError(
                f"the state_dict holds layers {float_in_state} in float but the model has them quantized, and "
                "swaps do not go back: load it into a fresh float model (e.g. MyModule.load_from_checkpoint(path)); "
                "to start QAT from float weights with prepare_at=0 (which prepares in setup), load them into the "
                "model before trainer.fit(model), without ckpt_path"
            )
        targets = {f for f in in_state if type(_find(module, f)) in (nn.Linear, nn.Conv2d)}
        if not targets:
            return
        learned = any(f"{prefix}{f}.weight_quantizer.scale" in state_dict for f in targets)
        if learned != self.config.weight.learnable:
            raise ValueError(
                f"the checkpoint's weight scales are {'' if learned else 'not '}learned but this IntQAT's config has "
                f"weight.learnable={self.config.weight.learnable}: pass the config the checkpoint was trained with"
            )
        prepare_qat(module, self.config, filter_fn=lambda m, n: n in targets)

    # -- set-up and tear-down ------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._load_hook is None:
            self._load_hook = pl_module.register_load_state_dict_pre_hook(self._load_pre_hook)
        if stage == "fit":
            learned = self.config.weight.learnable or self.config.activation.learnable
            # (under FSDP2 the scales a later prepare makes stay whole, their gradients averaged over the ranks:
            # intqat.distributed.shards.average_gradients_of)
            fsdp = isinstance(trainer.strategy, ModelParallelStrategy)
            if learned and trainer.world_size > 1 and self._schedule["prepare"] != 0 and not fsdp:
                raise ValueError(
                    f"IntQAT(prepare_at={self._schedule['prepare']!r}) with learned scales under "
                    f"{type(trainer.strategy).__name__}: DDP only synchronises the Parameters that exist when it "
                    "wraps the model; use IntQAT(prepare_at=0)"
                )
            if self._schedule["prepare"] == 0 and not self._reached["prepare"]:
                self._apply(trainer, pl_module, "prepare", in_setup=True)  # before configure_optimizers
        self._refresh(pl_module)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A resumed run whose learned scales were added as their own param group: the optimizer just
        # built holds them in its groups. Mirror the saved layout so the optimizer state (restored
        # right after this hook) fits.
        if self._added_param_group and trainer.optimizers:
            opt = trainer.optimizers[0]
            scales = self._quantizer_params(pl_module)
            ids = {id(p) for p in scales}
            if scales and not any(g["params"] and all(id(p) in ids for p in g["params"]) for g in opt.param_groups):
                for g in opt.param_groups:
                    g["params"] = [p for p in g["params"] if id(p) not in ids]
                self._add_param_group(trainer, scales)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove_hooks()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        self._monitor.remove()
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None

    # -- the schedule ------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refresh(pl_module)
        if self._sharded:  # (before a swap folds them)
            broadcast_batchnorm_stats(pl_module)
        if self.unit == "epoch":
            self._advance(trainer, pl_module, trainer.current_epoch)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_step = trainer.global_step
        self._log_step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        if self._sharded:  # FSDP2 leaves buffers alone: rank 0's BatchNorm statistics for all, as DDP keeps them
            broadcast_batchnorm_stats(pl_module)
        if self.unit == "step":
            self._advance(trainer, pl_module, trainer.global_step)
        if self.log_quant_metrics and trainer.global_step % self.quant_metrics_every_n_steps == 0:
            self._monitor.phase = "train"

    def _advance(self, trainer: Trainer, pl_module: LightningModule, counter: int) -> None:
        for stage in STAGES:
            when = self._schedule[stage]
            if self._reached[stage] or when is None:
                continue
            if stage != "prepare" and not self._reached["prepare"] and self._schedule["prepare"] is not None:
                break  # later stages wait for the layers to exist
            if callable(when):
                # (epoch, step) are the same on every rank, a callable's answer may not be: rank 0 decides
                due = bool(trainer.strategy.broadcast(bool(when(trainer, pl_module)), src=0))
            else:
                due = counter >= when
            if due:
                self._apply(trainer, pl_module, stage)

    def _apply(self, trainer: Trainer, pl_module: LightningModule, stage: str, in_setup: bool = False) -> None:
        if stage == "prepare":
            before_params = {id(p) for p in pl_module.parameters()}
            before = set(self._quant_layers(pl_module)) | set(self._attention(pl_module))
            self._swap(trainer, pl_module, lambda: prepare_qat(pl_module, self.config, self.filter_fn))
            if self.filter_fn is not None:
                now = set(self._quant_layers(pl_module)) | set(self._attention(pl_module))
                self._owned = (self._owned or set()) | (now - before)
            new = [p for p in pl_module.parameters() if id(p) not in before_params and p.requires_grad]
            if new and not in_setup and trainer.optimizers:
                self._add_param_group(trainer, new)
        else:
            layers = self._owned_layers(pl_module)
            if stage == "integer":
                if not layers:
                    raise RuntimeError(
                        "IntQAT(integer_at=...) found no fake-quant layer to convert: set prepare_at, or call "
                        "intqat.prepare_qat on the model before training"
                    )
                fake = {f for f, m in layers.items() if isinstance(m, FAKE_QUANT_TYPES)}
                fake |= {f for f, m in self._attention(pl_module, owned=True).items()
                         if isinstance(m, FakeQuantMultiheadAttention)}
                if fake:  # (to_integer would prepare a model that has no fake-quant layer at all)
                    self._swap(trainer, pl_module, lambda: to_integer(pl_module, filter_fn=lambda m, n: n in fake))
            for m in [*layers.values(), *self._attention(pl_module, owned=True).values()]:
                if stage == "freeze_bn":
                    freeze_bn_stats(m)
                elif stage == "freeze_observers":
                    freeze_observers(m)
        self._reached[stage] = True
        self.boundaries[stage] = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        rank_zero_info(f"IntQAT: {stage} at epoch {trainer.current_epoch}, global step {trainer.global_step}")
        self._refresh(pl_module)
        if not in_setup:  # (in setup a resumed run has not restored its real boundaries yet)
            step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
            for logger in trainer.loggers:  # the exact boundary, whatever log_every_n_steps is
                logger.log_metrics({"quant/stage": self._stage_value(), "epoch": trainer.current_epoch}, step=step)

    def _swap(self, trainer: Trainer, pl_module: LightningModule, fn: Callable[[], Any]) -> None:
        before = dict(pl_module.named_modules())
        fn()
        replaced = {}
        for fqn, new in pl_module.named_modules():
            old = before.get(fqn)
            if old is not None and old is not new and isinstance(new, _QUANT):
                _move_pruning(old, new)
                replaced[id(old)] = new
        _retarget_pruning_callbacks(trainer, replaced)

    def _add_param_group(self, trainer: Trainer, params: list[nn.Parameter]) -> None:
        if trainer.world_size > 1 and not isinstance(trainer.strategy, ModelParallelStrategy):
            raise RuntimeError(
                "IntQAT: preparing created Parameters (learned scales) after DDP wrapped the model; "
                "use IntQAT(prepare_at=0)"
            )
        opt = trainer.optimizers[0]
        first = opt.param_groups[0]
        group: dict[str, Any] = {"params": params, **{k: first[k] for k in ("lr", "initial_lr") if k in first}}
        if "weight_decay" in first:
            group["weight_decay"] = 0.0  # decaying a scale would shrink the quantization range
        opt.add_param_group(group)
        self._added_param_group = True
        if len(trainer.optimizers) > 1 or trainer.lr_scheduler_configs:
            rank_zero_warn(
                f"IntQAT: {len(params)} learned scales joined trainer.optimizers[0] as a new param group; other "
                "optimizers and the LR schedulers built before do not know them. With prepare_at=0 they exist "
                "before configure_optimizers"
            )

    def _quant_layers(self, pl_module: LightningModule) -> dict[str, nn.Module]:
        return {f: m for f, m in pl_module.named_modules() if isinstance(m, _QUANT)}

    def _attention(self, pl_module: LightningModule, owned: bool = False) -> dict[str, nn.Module]:
        """Quantized attention modules (several projections each: kept apart from the per-layer metrics)."""
        return {f: m for f, m in pl_module.named_modules() if isinstance(m, ATTENTION_TYPES)
                and (not owned or self._owned is None or f in self._owned)}

    def _owned_layers(self, pl_module: LightningModule) -> dict[str, nn.Module]:
        layers = self._quant_layers(pl_module)
        return layers if self._owned is None else {f: m for f, m in layers.items() if f in self._owned}

    def _quantizer_params(self, pl_module: LightningModule) -> list[nn.Parameter]:
        layers = self._owned_layers(pl_module).values()
        ids = {id(p) for m in layers for q in (getattr(m, "input_quantizer", None), m.weight_quantizer) if q is not None
               for p in q.parameters()}
        return [p for p in pl_module.parameters() if id(p) in ids and p.requires_grad]  # the model's order

    def _stage_value(self) -> float:
        layers = self._monitor.layers.values()
        return 2.0 if any(isinstance(m, INTEGER_TYPES) for m in layers) else 1.0 if layers else 0.0

    def _refresh(self, pl_module: LightningModule) -> None:
        """Follow the model's current layers (hooks, metrics) after a swap or a checkpoint restore."""
        if not self._sharded:
            self._sharded = is_sharded(pl_module)  # (False in setup: ModelParallelStrategy shards after it)
            if self._sharded:  # FSDP2: measure with the whole fp32 weights (intqat.distributed.metrics)
                from intqat.distributed.metrics import ShardedLayerMonitor

                self._monitor.remove()
                self._monitor = ShardedLayerMonitor()
        self._monitor.track(self._owned_layers(pl_module), pl_module.device, hooks=self.log_quant_metrics)

    # -- training steps ------------------------------------------------------------------------
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check_finite(trainer, outputs, batch_idx)
        pl_module.log("quant/stage", self._stage_value(), on_step=True, on_epoch=False)
        if self._monitor.phase == "train":
            self._monitor.phase = None
            self._log_quant_metrics(trainer, pl_module, "train")

    def _check_finite(self, trainer: Trainer, outputs: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        layers = self._monitor.layers
        if self._sharded:  # each rank checks its own shards; the verdict is reduced over the ranks below
            from intqat.distributed.metrics import local_layers

            layers = local_layers(layers)
        what, bad = non_finite_scales(layers, loss if isinstance(loss, Tensor) else None)
        if trainer.world_size > 1:  # every rank stops, whichever saw it
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            return
        trainer.should_stop = True
        # Raising, not only should_stop: ModelCheckpoint would save these weights at the end of the
        # epoch or of the next validation. The last checkpoint on disk stays the last good one.
        raise NonFiniteError(
            f"IntQAT: {', '.join(what or [f'a value on a rank other than {trainer.global_rank}'])} became non-finite "
            f"(nan/inf) at epoch {trainer.current_epoch}, batch {batch_idx} (global step {self._batch_step}); "
            "training stopped before any checkpoint of this step was saved. Lower the learning rate, clip "
            "gradients, or resume from the last checkpoint"
        )

    def _log_quant_metrics(self, trainer: Trainer, pl_module: LightningModule, phase: str) -> None:
        prefix = {"train": "quant", "val": "quant_val", "test": "quant_test"}[phase]
        values = {f"{prefix}/{k}": v for k, v in self._monitor.compute(phase).items()}
        # The values are pooled across ranks by torchmetrics already, equal on every rank.
        if phase == "train":
            # Lightning writes an on_step value again at every later logging step of the epoch; a
            # measurement belongs to its own step, so the loggers get it directly (as
            # LearningRateMonitor does) and self.log only feeds callback_metrics and the progress bar.
            row = {**{k: float(v) for k, v in values.items()}, "epoch": trainer.current_epoch}
            for logger in trainer.loggers:
                logger.log_metrics(row, step=self._log_step)
            opts = dict(on_step=True, on_epoch=False, logger=False, sync_dist=False)
        else:  # (sync_dist averages equal numbers, and keeps Lightning from warning under DDP)
            opts = dict(on_step=False, on_epoch=True, sync_dist=True)
        for name, value in values.items():
            pl_module.log(name, value, prog_bar=name == f"{prefix}/sqnr_db", **opts)

    # -- validation and test -------------------------------------------------------------------
    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refresh(pl_module)
        if self._sharded:  # every rank evaluates one model
            broadcast_batchnorm_stats(pl_module)
        if trainer.sanity_checking:
            # Layers prepared in setup have no activation range yet and cannot evaluate: let them
            # observe the sanity batches, and forget what they saw once the check is over.
            quantizers = [
                q for q in pl_module.modules()
                if isinstance(q, ActivationQuantizer) and not q.dynamic and not bool(q.initialized)
            ]  # fmt: skip
            self._sanity_snapshot = [(q, {k: v.clone() for k, v in q.state_dict().items()}) for q in quantizers]
            for q in quantizers:
                q.train()

    @override
    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for q, state in self._sanity_snapshot or []:
            q.load_state_dict(state)
        self._sanity_snapshot = None

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.log_quant_metrics and not trainer.sanity_checking:
            self._monitor.phase = "val"

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._monitor.phase = None
        if not trainer.sanity_checking:
            self._log_quant_metrics(trainer, pl_module, "val")

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refresh(pl_module)

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.log_quant_metrics:
            self._monitor.phase = "test"

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._monitor.phase = None
        self._log_quant_metrics(trainer, pl_module, "test")

    # -- export --------------------------------------------------------------------------------
    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        missed = [f"{stage} (at {self._schedule[stage]!r})" for stage in STAGES
                  if self._schedule[stage] is not None and not self._reached[stage]]
        if missed and not trainer.interrupted:
            rank_zero_warn(f"IntQAT: training ended (epoch {trainer.current_epoch}, step {trainer.global_step}) before "
                           f"these stages started: {', '.join(missed)} ({self.unit}s): the model was trained without "
                           "them. Train longer or move the stages earlier")
        if not self.export_on_fit_end:
            return
        if not any(isinstance(m, _QUANT) for m in pl_module.modules()):
            rank_zero_warn("IntQAT: no export at the end of training: the model holds no quantized layer (the "
                           f"prepare stage never ran: prepare_at={self._schedule['prepare']!r}), so the program "
                           "would be the float model")
            return
        module = pl_module
        if self._sharded:  # FSDP2: the exporter gets an unsharded copy (all ranks all-gather; rank 0 holds it)
            from intqat.distributed.lightning import unsharded_copy

            try:
                module = unsharded_copy(pl_module, trainer.global_rank)
            except TypeError as e:
                rank_zero_warn(f"IntQAT: no export at the end of training: under FSDP2 the exporter needs an "
                               f"unsharded copy of the module, and {e}. Export the last checkpoint instead")
                return
        if trainer.is_global_zero:
            export_dir = os.fspath(self.export_dir or os.path.join(trainer.default_root_dir, "export"))
            self.export_fn(module, trainer, export_dir)
