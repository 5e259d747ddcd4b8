"""Language-model training pieces for the text recipes (recipes/gpt_text_*.yaml):

LanguageModelModule     next-token cross-entropy over (B, T, V) logits; logs loss, perplexity, accuracy.
evaluate_lm             mean loss / perplexity of any model (or exported program) over batches.
LMQuantReport           the comparison the recipes report: fp32, post-training quantization (PTQ) of
                        the fp32 model, and QAT, trained for the same steps on the same batches.
export_lm_for_callback  IntQAT's export hook for language models: the mixed-precision program, its
                        perplexity against the integer model's, and a check in a fresh process that
                        the program loads and runs without intqat.

How the comparison is fair: at `fork_at` optimizer steps (the step IntQAT prepares the model),
LMQuantReport copies the fp32 model and its optimizer state into a float twin. From then on the twin
takes one fp32 step on every batch the QAT model trains on, with the same learning rate. At the end:
fp32 = the twin, PTQ = the twin quantized without training (prepare_qat + to_integer, activation
ranges observed on a few training batches where the config has static ones), QAT = the trained
model (integer). recovered = (ppl_PTQ - ppl_QAT) / (ppl_PTQ - ppl_fp32).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from intqat.training.lit_module import ClassificationModule
from intqat.training.optimizers import build_optimizer

__all__ = ["LanguageModelModule", "evaluate_lm", "LMQuantReport", "export_lm_for_callback"]


def _token_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class LanguageModelModule(ClassificationModule):
    """A ClassificationModule whose model maps tokens (B, T) to logits (B, T, V) and is scored per token:
    `<split>/loss` (mean nats per token), `<split>/ppl` = exp(loss) over the whole split, `<split>/acc`.

    warmup_steps: with scheduler="cosine", the learning rate rises linearly from lr / warmup_steps to lr
    over the first warmup_steps optimizer steps, then follows the cosine to 0 at the last step (GPT's
    schedule: Adam's first steps at full lr can stall a transformer). 0: the plain cosine.
    """

    def __init__(self, model, num_classes: int = 256, *, warmup_steps: int = 0, **kwargs):
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"LanguageModelModule(warmup_steps={warmup_steps!r}): give an int >= 0")
        super().__init__(model, num_classes, **kwargs)

    def configure_optimizers(self):
        out = super().configure_optimizers()
        warmup = self.hparams.get("warmup_steps", 0)
        if not warmup or not isinstance(out, dict):  # no scheduler: a constant lr has nothing to warm up
            return out
        opt, total = out["optimizer"], out["lr_scheduler"]["scheduler"].T_max
        if warmup >= total:
            raise ValueError(f"LanguageModelModule(warmup_steps={warmup}): must be below the {total} optimizer steps")

        def factor(step: int) -> float:  # LambdaLR: lr = lr_0 * factor(step), step = optimizer steps taken
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / (total - warmup)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _step(self, batch, split: str, metric) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = _token_loss(logits, y)
        metric(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        n = y.numel()
        self.log(f"{split}/loss", loss, prog_bar=True, sync_dist=True, batch_size=n, on_step=split == "train",
                 on_epoch=True)
        self.log(f"{split}/acc", metric, on_step=False, on_epoch=True)
        if split != "train":
            sums = self.__dict__.setdefault("_sums", {})
            total, count = sums.get(split, (0.0, 0))
            sums[split] = (total + float(loss) * n, count + n)
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._step(batch, "train", self.train_acc)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val", self.val_acc)

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test", self.test_acc)

    def _log_ppl(self, split: str) -> None:
        total, count = self.__dict__.get("_sums", {}).pop(split, (0.0, 0))
        if count:
            self.log(f"{split}/ppl", math.exp(total / count), prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self._log_ppl("val")

    def on_test_epoch_end(self) -> None:
        self._log_ppl("test")


@torch.no_grad()
def evaluate_lm(model, batches) -> dict[str, float]:
    """{"loss": mean nats per token, "ppl": exp(loss), "tokens": n} of `model` (an nn.Module or any
    callable, e.g. ExportedProgram.module()) over (x, y) batches."""
    # an exported program's module() refuses train() / eval(): it has no mode
    module = isinstance(model, nn.Module) and not isinstance(model, torch.fx.GraphModule)
    was_training = module and model.training
    if module:
        model.eval()
    total, n = 0.0, 0
    for x, y in batches:
        logits = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                       reduction="sum"))
        n += y.numel()
    if was_training:
        model.train()
    if n == 0:
        raise ValueError("evaluate_lm: the batches hold no token")
    return {"loss": total / n, "ppl": math.exp(total / n), "tokens": n}


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class LMQuantReport(L.Callback):
    """fp32 vs post-training quantization vs QAT of a language model, trained alike (module docstring).

    .. code-block:: python

        trainer = Trainer(callbacks=[IntQAT("8da4w", unit="step", prepare_at=600, integer_at=620),
                                     LMQuantReport("8da4w", fork_at=600)])

    Args:
        config: the quantization config PTQ applies (the one IntQAT trains with).
        fork_at: optimizer steps after which the float twin forks off (IntQAT's prepare_at, in steps).
        calibration_batches: training batches that set PTQ's static activation ranges (unused when dynamic).
        out_dir: where lm_report.json / lm_report.md go (default: trainer.default_root_dir).
    """

    def __init__(self, config: Any = "8da4w", fork_at: int = 1, calibration_batches: int = 8,
                 out_dir: str | os.PathLike | None = None):
        from intqat.config import resolve_config

        self.config = resolve_config(config)
        if not isinstance(fork_at, int) or fork_at < 1:
            raise ValueError(f"LMQuantReport(fork_at={fork_at!r}): give the step IntQAT prepares at, an int >= 1")
        self.fork_at, self.calibration_batches, self.out_dir = fork_at, calibration_batches, out_dir
        self.twin: nn.Module | None = None
        self._twin_opt = None
        self._fork_model: nn.Module | None = None
        self._calibration: list = []
        self.results: dict[str, Any] = {}
        self.report_rows: dict[str, str] = {}  # intqat-train puts these into report.md

    # -- the float twin ------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.twin is None and step == self.fork_at:
            self._fork(trainer, pl_module)
        elif self.twin is not None and step > self.fork_at:
            self._twin_step(trainer, batch)
        if len(self._calibration) < self.calibration_batches:
            self._calibration.append(batch[0].detach().cpu())

    def _fork(self, trainer, pl_module) -> None:
        model = pl_module.model
        from intqat.registry import FAKE_QUANT_TYPES, INTEGER_TYPES

        if any(isinstance(m, FAKE_QUANT_TYPES + INTEGER_TYPES) for m in model.modules()):
            raise RuntimeError(f"LMQuantReport(fork_at={self.fork_at}): the model is already quantized at that step; "
                               "fork_at must be IntQAT's prepare_at (in steps)")
        from intqat.distributed.fsdp import is_sharded

        if is_sharded(model):  # (FSDP2 refuses deepcopy; a sharded twin would need its own mesh and optimizer shards)
            raise RuntimeError("LMQuantReport forks an fp32 twin by copying the model, which FSDP2 (fully_shard) does not "
                               "allow: run the report without sharding, or turn it off (callbacks.lm_report=null)")
        self._fork_model = copy.deepcopy(model)
        self.twin = copy.deepcopy(model)
        hp = pl_module.hparams
        main = trainer.optimizers[0]
        self._twin_opt = build_optimizer(self.twin.parameters(), hp.optimizer, lr=main.param_groups[0]["lr"],
                                         weight_decay=hp.weight_decay, momentum=hp.momentum,
                                         fused=hp.get("fused_optimizer", True))
        for p, q in zip(model.parameters(), self.twin.parameters()):  # Adam moments / momentum carried over
            state = main.state.get(p)
            if state:
                self._twin_opt.state[q] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}

    def _twin_step(self, trainer, batch) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]  # the schedule the QAT model follows
        for group in self._twin_opt.param_groups:
            group["lr"] = lr
        x, y = batch
        self.twin.train()
        with torch.enable_grad():
            loss = _token_loss(self.twin(x), y)
            self._twin_opt.zero_grad(set_to_none=True)
            loss.backward()
        self._twin_opt.step()

    # -- the comparison ---------------------------------------------------------------------------------
    def _ptq(self, model: nn.Module) -> nn.Module:
        import intqat

        ptq = copy.deepcopy(model).cpu()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the PTQ copy's float leftovers were named for the QAT model already
            intqat.to_integer(ptq, config=self.config, calibration_data=[(x,) for x in self._calibration])
        return ptq.eval()

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or self.twin is None:
            if self.twin is None:
                rank_zero_info(f"LMQuantReport: training ended before step {self.fork_at}: nothing to compare")
            return
        import intqat

        dm = trainer.datamodule
        dm.setup("test")
        cpu = lambda b: (b[0].cpu(), b[1].cpu())  # noqa: E731
        splits = {"val": [cpu(b) for b in dm.val_dataloader()], "test": [cpu(b) for b in dm.test_dataloader()]}
        qat = copy.deepcopy(pl_module.model).cpu()
        if not any(isinstance(m, intqat.registry.INTEGER_TYPES) for m in qat.modules()):
            intqat.to_integer(qat)  # a run that stopped at fake quant: score what it would deploy
        models = {
            "fp32": self.twin.cpu(),
            "ptq": self._ptq(self.twin),
            "qat": qat,
            "fp32_at_fork": self._fork_model.cpu(),
            "ptq_at_fork": self._ptq(self._fork_model),
        }
        res: dict[str, Any] = {"config": self.config.to_dict() if hasattr(self.config, "to_dict") else str(self.config),
                               "fork_at_step": self.fork_at, "steps": trainer.global_step}
        for split, batches in splits.items():
            for name, model in models.items():
                res[f"{split}/{name}"] = evaluate_lm(model, batches)
            ppl = {k: res[f"{split}/{k}"]["ppl"] for k in ("fp32", "ptq", "qat")}
            lost = ppl["ptq"] - ppl["fp32"]
            res[f"{split}/recovered"] = (ppl["ptq"] - ppl["qat"]) / lost if lost > 0 else float("nan")
        export = pl_module.__dict__.get("_intqat_lm_export")
        if export:
            res["export"] = export
        self.results = res
        self._write(trainer, res)

    def _write(self, trainer, res: dict[str, Any]) -> None:
        out = Path(self.out_dir or trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write(out / "lm_report.json", json.dumps(res, indent=2, default=str) + "\n")
        lines = ["# Language model: fp32 vs post-training quantization vs QAT", "",
                 f"Twin forked at step {res['fork_at_step']} of {res['steps']}; PTQ = the fp32 twin quantized without "
                 "training; QAT = the trained integer model.", "",
                 "| model | val loss | val ppl | test loss | test ppl |", "|---|---|---|---|---|"]
        for name in ("fp32", "ptq", "qat", "fp32_at_fork", "ptq_at_fork"):
            v, t = res[f"val/{name}"], res[f"test/{name}"]
            lines.append(f"| {name} | {v['loss']:.4f} | {v['ppl']:.4f} | {t['loss']:.4f} | {t['ppl']:.4f} |")
        lines += ["", f"Share of the PTQ perplexity degradation QAT recovers: val {_share(res, 'val')}, "
                      f"test {_share(res, 'test')}."]
        if "export" in res:
            e = res["export"]
            lines += ["", f"Exported program ({e['split']}): ppl {e['program_ppl']:.4f} vs integer model "
                          f"{e['integer_ppl']:.4f} ({e['ppl_rel_diff']:+.3%}); loads without intqat: "
                          f"{e['loads_without_intqat']}."]
        _atomic_write(out / "lm_report.md", "\n".join(lines) + "\n")
        v = lambda k: res[f"val/{k}"]["ppl"]  # noqa: E731
        self.report_rows = {
            "val ppl fp32 / PTQ / QAT": f"{v('fp32'):.4f} / {v('ptq'):.4f} / {v('qat'):.4f}",
            "PTQ degradation QAT recovers": f"val {_share(res, 'val')}, test {_share(res, 'test')}",
            "LM report": str(out / "lm_report.md"),
        }
        if "export" in res:
            self.report_rows["exported program ppl"] = (f"{res['export']['program_ppl']:.4f} "
                                                        f"({res['export']['ppl_rel_diff']:+.3%} vs integer model)")
        print("\n" + "\n".join(lines))


def _share(res: dict[str, Any], split: str) -> str:
    r = res[f"{split}/recovered"]
    if math.isnan(r):  # PTQ was no worse than fp32: the ratio has no meaning
        return "n/a (post-training quantization did not raise the perplexity)"
    return f"{r:.1%}"


_LOAD_CHECK = """
import sys, torch
ep = torch.export.load(sys.argv[1])
x, expected = torch.load(sys.argv[2])
out = ep.module()(x)
assert "intqat" not in sys.modules, "intqat was imported"
print("equal" if torch.equal(out, expected) else "different")
"""


def _loads_without_intqat(program_path: Path, x: Tensor, expected: Tensor) -> bool:
    """Run the saved program in a fresh Python that never imports intqat; True when it reproduces `expected`."""
    with tempfile.TemporaryDirectory() as d:
        sample = Path(d) / "sample.pt"
        torch.save((x, expected), sample)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([sys.executable, "-c", _LOAD_CHECK, str(program_path), str(sample)], cwd=d, env=env,
                              capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        warnings.warn(f"the exported program did not run without intqat: {proc.stderr.strip()[-500:]}")
    return proc.returncode == 0 and proc.stdout.strip() == "equal"


def export_lm_for_callback(pl_module, trainer, export_dir, *, calibration_batches: int = 4,
                           validation_split: str = "val", aoti: bool = False, **autocast_options):
    """IntQAT's export hook for language models: `intqat.export.export_fn_for_callback` (the program, its
    report), then the perplexity of the program and of the integer model on `validation_split`, and a
    fresh-process check that model.pt2 loads and runs without intqat. The figures go into
    export_dir/lm_export.json and to LMQuantReport (through the LightningModule)."""
    import intqat
    from intqat.export import MODEL_FILE, export_fn_for_callback

    result = export_fn_for_callback(pl_module, trainer, export_dir, calibration_batches=calibration_batches,
                                    validation_split=validation_split, aoti=aoti, **autocast_options)
    if result is None:
        return None
    dm = trainer.datamodule
    loader = dm.test_dataloader() if validation_split == "test" else dm.val_dataloader()
    batches = [(x.cpu(), y.cpu()) for x, y in loader]
    deployed = intqat.to_deployed(copy.deepcopy(pl_module.model).cpu())
    if any(isinstance(m, intqat.registry.FAKE_QUANT_TYPES) for m in deployed.modules()):
        deployed = intqat.to_deployed(intqat.to_integer(copy.deepcopy(pl_module.model).cpu()))
    program_eval = evaluate_lm(result.program.module(), batches)
    integer_eval = evaluate_lm(deployed, batches)
    x = batches[0][0][:2]
    with torch.no_grad():
        expected = result.program.module()(x)
    figures = {
        "split": validation_split,
        "program_ppl": program_eval["ppl"],
        "integer_ppl": integer_eval["ppl"],
        "ppl_rel_diff": program_eval["ppl"] / integer_eval["ppl"] - 1.0,
        "loads_without_intqat": _loads_without_intqat(Path(export_dir) / MODEL_FILE, x, expected),
        "low_precision_type": str(result.report.low_precision_type),
    }
    _atomic_write(Path(export_dir) / "lm_export.json", json.dumps(figures, indent=2) + "\n")
    pl_module.__dict__["_intqat_lm_export"] = figures
    return result
