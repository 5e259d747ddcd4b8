"""ClassificationModule: any classifier nn.Module + cross-entropy + Adam/SGD (fused), for Lightning.

    module = ClassificationModule({"_target_": "intqat.models.MLP", "hidden": [128, 128]}, lr=1e-3)
    trainer.fit(module, datamodule=DigitsDataModule())
    module = ClassificationModule.load_from_checkpoint("runs/.../checkpoints/last.ckpt")

Give `model` as a config (a dict / DictConfig with `_target_`, which is what the recipes do): it is
instantiated here and stored in the hyperparameters, so `load_from_checkpoint(path)` rebuilds the
model alone. An nn.Module works too, but then load_from_checkpoint needs `model=` again.

Checkpoints carry the quantized layout (checkpoint["intqat"], intqat.callback's format): loading a
fake-quant or integer checkpoint first swaps the fresh float model's layers to match, so the
state dict fits, with or without an IntQAT callback in the Trainer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from intqat.training.optimizers import OPTIMIZERS, build_optimizer

__all__ = ["ClassificationModule"]

SCHEDULERS = (None, "none", "cosine")


def _quantized_kinds(module: nn.Module) -> dict[str, str]:
    """fqn -> "fake" / "integer" for every trainable intqat layer (the record's vocabulary)."""
    from intqat.registry import FAKE_QUANT_TYPES, INTEGER_TYPES

    return {
        fqn: "integer" if isinstance(m, INTEGER_TYPES) else "fake"
        for fqn, m in module.named_modules()
        if isinstance(m, FAKE_QUANT_TYPES + INTEGER_TYPES)
    }


def _model_config(model: Any) -> dict[str, Any] | None:
    if isinstance(model, DictConfig):
        return OmegaConf.to_container(model, resolve=True)
    if isinstance(model, Mapping):
        return dict(model)
    return None


class ClassificationModule(L.LightningModule):
    """Cross-entropy classification; logs train/loss, train/acc, val/loss, val/acc, test/loss, test/acc."""

    def __init__(
        self,
        model: nn.Module | Mapping[str, Any],
        num_classes: int = 10,
        optimizer: str = "adam",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        scheduler: str | None = "cosine",
        fused_optimizer: bool = True,
    ):
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"ClassificationModule(optimizer={optimizer!r}): use one of {OPTIMIZERS}, e.g. optimizer='adam'")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"ClassificationModule(scheduler={scheduler!r}): use 'cosine' or None")
        if lr <= 0:
            raise ValueError(f"ClassificationModule(lr={lr}): must be positive, e.g. lr=1e-3")
        model_cfg = _model_config(model)
        self.save_hyperparameters(ignore=["model"])
        if model_cfg is not None:
            if "_target_" not in model_cfg:
                raise ValueError(
                    f"ClassificationModule(model={model_cfg!r}): a model config needs _target_, e.g. "
                    "{'_target_': 'intqat.models.MLP', 'hidden': [128, 128]}"
                )
            self.hparams["model"] = model_cfg  # saved in checkpoints: load_from_checkpoint rebuilds it
            model = instantiate(model_cfg)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"ClassificationModule(model=...): expected an nn.Module or a config with _target_, got {type(model).__name__}"
            )
        self.model = model
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        return self.model(x, **kwargs)

    # -- steps -------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("test/acc", self.test_acc, prog_bar=True)

    # -- optimization ------------------------------------------------------------------------
    def configure_optimizers(self):
        hp = self.hparams
        # fp16 AMP unscales inside a fused step, and Lightning then refuses gradient clipping: keep
        # torch's default implementation there (bf16 and fp32 need no scaler)
        fp16_amp = self._trainer is not None and str(self.trainer.precision).startswith("16")
        opt = build_optimizer(self.parameters(), hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay,
                              momentum=hp.momentum, fused=hp.get("fused_optimizer", True) and not fp16_amp)
        if hp.scheduler in (None, "none"):
            return opt
        # per step over the whole run: QAT's integer stage at the end trains at a small lr
        total = max(1, int(self.trainer.estimated_stepping_batches))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- self-describing checkpoints ---------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # IntQAT writes the same record when it is in the Trainer; this covers runs without it
        # (a model quantized by hand, ModelCheckpoint(save_weights_only=True))
        from intqat.callback import save_quant_structure  # lazy: intqat.callback imports intqat.training

        save_quant_structure(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from intqat.callback import CHECKPOINT_KEY, restore_quant_structure

        record = (checkpoint.get(CHECKPOINT_KEY) or {}).get("modules")
        if record is not None:
            wanted = {fqn: rec["kind"] for fqn, rec in record.items()}
            current = _quantized_kinds(self)
            # layers the checkpoint holds as float, or as fake-quant where ours are integer: swaps do not
            # go backwards, so start again from a fresh float model (e.g. testing the best, float,
            # checkpoint after the model went integer)
            backwards = [f for f, kind in current.items() if wanted.get(f) is None or (kind, wanted[f]) == ("integer", "fake")]
            if backwards:
                model_cfg = self.hparams.get("model")
                if model_cfg is None:
                    raise RuntimeError(
                        "the checkpoint has fewer quantized layers than the model already has; give "
                        "ClassificationModule its model as a config (with _target_) so that it can be rebuilt"
                    )
                self.model = instantiate(model_cfg).to(self.device)
        restore_quant_structure(self, checkpoint)
