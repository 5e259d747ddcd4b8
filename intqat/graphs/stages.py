"""A recipe's model at each QAT stage, the batches it runs on, and capturing one stage's graphs."""

from __future__ import annotations

import contextlib
import copy
import functools
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from intqat.graphs.options import STAGES, GraphsOptions
from intqat.graphs.referee import Referee, error_text, referee

__all__ = ["Batches", "StageReport", "quant_config_of", "example_batches", "load_checkpoint_model", "stage_of",
           "build_stages", "is_layer", "layer_inputs", "graph_breaks", "step_loss", "capture_stage"]


def quant_config_of(cfg) -> Any | None:
    """The recipe's intqat quant config (preset name or dict), or None when it trains fp32 (quant=none)."""
    from omegaconf import DictConfig, OmegaConf

    q = cfg.get("quant")
    if q is None or "_target_" not in q or q.get("config") is None:
        return None
    c = q.config
    return OmegaConf.to_container(c, resolve=True) if isinstance(c, DictConfig) else c


@dataclass
class Batches:
    x: Any  # the example batch (inputs)
    y: Any  # its labels
    calibration: list[Any]  # further input batches for calibrate()
    source: str  # where they came from, for the report


def example_batches(cfg, n_calib: int, seed: int) -> Batches:
    """One training batch and `n_calib` more from the recipe's datamodule; a random batch of the
    datamodule's shape (class attribute `dims`) when the data cannot be loaded (CIFAR-10 not on disk)."""
    import torch
    from hydra.utils import get_class, instantiate
    from omegaconf import OmegaConf

    data_cfg = cfg.data
    try:
        dm = instantiate(data_cfg)
        dm.setup("fit")
        it = iter(dm.train_dataloader())
        x, y = next(it)
        calib = []
        for _ in range(n_calib):
            try:
                calib.append(next(it)[0])
            except StopIteration:
                break
        return Batches(x, y, calib or [x], f"{data_cfg._target_} training batches")
    except Exception as e:  # noqa: BLE001  (missing files, ??? values: fall back to random data)
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    try:
        dims = tuple(get_class(data_cfg._target_).dims)
    except Exception:  # noqa: BLE001
        raise RuntimeError(f"cannot load the recipe's data ({reason}) nor find its input shape "
                           f"({data_cfg.get('_target_')} has no `dims`)") from None
    batch = int(OmegaConf.select(data_cfg, "batch_size", default=8) or 8)
    num_classes = int(OmegaConf.select(cfg, "model.num_classes", default=10) or 10)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *dims, generator=g)
    y = torch.randint(0, num_classes, (batch,), generator=g)
    calib = [torch.randn(batch, *dims, generator=g) for _ in range(max(n_calib, 1))]
    return Batches(x, y, calib, f"random N(0, 1) batches of shape {list(x.shape)} (data not loaded: {reason})")


def load_checkpoint_model(path: Path):
    """The nn.Module inside an intqat-train checkpoint, with its quantized layout restored."""
    from intqat.training import ClassificationModule

    module = ClassificationModule.load_from_checkpoint(str(path), map_location="cpu")
    return module.model


def stage_of(model) -> str:
    """float / fake_quant / integer: the most advanced kind of layer the model holds."""
    from intqat.registry import FAKE_QUANT_TYPES, INTEGER_TYPES

    kinds = {type(m) for m in model.modules()}
    if any(issubclass(k, INTEGER_TYPES) for k in kinds):
        return "integer"
    if any(issubclass(k, FAKE_QUANT_TYPES) for k in kinds):
        return "fake_quant"
    return "float"


def build_stages(float_or_ckpt_model, start: str, quant_config, cfg, batches: Batches, wanted: tuple[str, ...]):
    """{stage: model} from `start` onwards, each a separate copy (the caller's model is not touched)."""
    import intqat

    models: dict[str, Any] = {}
    model = copy.deepcopy(float_or_ckpt_model)
    order = STAGES[STAGES.index(start):]
    for stage in order:
        if stage == "fake_quant" and start == "float":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # prepare_qat names modules it keeps float; irrelevant here
                intqat.prepare_qat(model, quant_config)
            intqat.calibrate(model, batches.calibration)
        elif stage == "integer" and start != "integer":
            # as the recipe's schedule does before integer_at: BN statistics and observers freeze first
            q = cfg.get("quant") if cfg is not None else None
            if q is None or q.get("freeze_bn_at", 0) is not None:
                intqat.freeze_bn_stats(model)
            if q is None or q.get("freeze_observers_at", 0) is not None:
                intqat.freeze_observers(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                intqat.to_integer(model)
        if stage in wanted:
            models[stage] = copy.deepcopy(model).train()
        if len(models) == len(wanted):
            break
    return models


# -- capturing --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _faithful_extract() -> Iterator[None]:
    """Make extract's aot_autograd keep input mutations in the graph, as inductor (and aot_eager) do.

    Without keep_inference_input_mutations=True the graphs differ from inductor's, and a step that
    reads a buffer it then updates in place (fake-quant Conv+BN with live BatchNorm statistics:
    running_var feeds the fold, BN updates it) fails at backward with "one of the variables
    needed for gradient computation has been modified by an inplace operation": the min-cut
    partition recomputes the read in the backward from the buffer (torch 2.13; upstream
    pytorch/pytorch#197039). With the flag, extract records what inductor really runs, that
    recomputation included. Harmless once intqat.graphs.capture passes the flag itself (an
    explicit keyword overrides the partial's).
    """
    from unittest import mock

    import intqat.graphs.capture as capture_mod

    patched = functools.partial(capture_mod.aot_autograd, keep_inference_input_mutations=True)
    with mock.patch.object(capture_mod, "aot_autograd", patched):
        yield


def is_layer(module) -> bool:
    """A layer captured on its own: nn.Linear / nn.Conv2d and intqat's quantized versions of them."""
    from torch import nn

    from intqat.registry import QUANT_TYPES

    return isinstance(module, QUANT_TYPES) or type(module) in (nn.Linear, nn.Conv2d)


def layer_inputs(model, x) -> dict[str, Any]:
    """fqn -> the input each layer gets in a training forward of `model` on x (detached clones that
    require grad exactly when the original did, so the layer's own backward has the same shape)."""
    import torch

    model = copy.deepcopy(model).train()  # the forward updates BN statistics and observers: a copy
    seen: dict[str, Any] = {}
    handles = []
    for fqn, m in model.named_modules():
        if fqn and is_layer(m):
            def hook(mod, args, fqn=fqn):
                if fqn not in seen and args and isinstance(args[0], torch.Tensor):
                    seen[fqn] = args[0].detach().clone().requires_grad_(args[0].requires_grad)
            handles.append(m.register_forward_pre_hook(hook))
    try:
        with torch.enable_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def graph_breaks(model, loss_fn, x) -> list[str]:
    """Where dynamo breaks the training step's graph: 'file:line: reason' per break."""
    import torch

    from intqat.graphs.step import train_step

    torch.compiler.reset()
    try:
        explanation = torch._dynamo.explain(train_step)(copy.deepcopy(model).train(), loss_fn, x)
    finally:
        torch.compiler.reset()
    out = []
    for br in explanation.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = f"{_short_path(frame.filename)}:{frame.lineno}" if frame else "?"
        line = f"  `{frame.line.strip()}`" if frame is not None and frame.line else ""
        reason = " ".join(str(br.reason).split())
        out.append(f"{where}: {reason[:160]}{line}")
    return list(dict.fromkeys(out))  # the same break hit by several layers: once


def _short_path(filename: str) -> str:
    """intqat/nn/conv.py rather than /abs/path/to/repo/intqat/nn/conv.py."""
    parts = Path(filename).parts
    for anchor in ("intqat", "site-packages"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return str(Path(*parts[i + (anchor == "site-packages"):]))
    return filename


def step_loss(output, y):
    """The recipes' training loss: cross-entropy of a classifier's (B, C) logits against (B,) labels, or
    per token of a language model's (B, T, V) logits against (B, T) next tokens (LanguageModelModule)."""
    import torch.nn.functional as F

    if output.dim() > 2 and y.dim() == output.dim() - 1:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), y.reshape(-1))
    return F.cross_entropy(output, y)


@dataclass
class StageReport:
    stage: str
    model_type: str
    capture: Any = None  # GraphCapture of the whole step, or None when extraction failed
    error: str | None = None
    layers: dict[str, Any] = field(default_factory=dict)  # fqn -> GraphCapture
    layer_types: dict[str, str] = field(default_factory=dict)
    layer_errors: dict[str, str] = field(default_factory=dict)
    breaks: list[str] = field(default_factory=list)
    validation: Any = None  # ValidationResult, or None when not run
    referee: Referee | None = None  # float64 arbitration of the tensors validation failed
    traceback: str | None = None  # of a failed whole-model extraction, for report.txt

    @property
    def validated(self) -> bool:
        if self.validation is None or self.validation.passed:
            return True
        return self.referee is not None and self.referee.cleared

    @property
    def problems(self) -> list[str]:
        """Why the stage fails; empty when it passes."""
        out = []
        if self.capture is None:
            out.append("extraction failed")
        if self.layer_errors:
            out.append(f"extraction failed for {len(self.layer_errors)} layer(s)")
        if not self.validated:
            out.append("validation failed")
        if self.stage == "integer" and self.capture is not None and len(self.capture.regions) > 1:
            out.append(f"{len(self.capture.regions) - 1} graph break(s) in the integer step")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems


def capture_stage(stage: str, model, batches: Batches, loss_fn, opts: GraphsOptions) -> StageReport:
    from intqat.graphs import extract, validate

    rep = StageReport(stage, type(model).__name__)
    with _faithful_extract():
        try:
            rep.capture = extract(model, (batches.x,), loss_fn, train=True)
        except Exception as e:  # noqa: BLE001  (reported, the run goes on and exits 1)
            rep.error = error_text(e)
            rep.traceback = traceback.format_exc()
        if opts.layers:
            for fqn, x_layer in layer_inputs(model, batches.x).items():
                layer = model.get_submodule(fqn)
                rep.layer_types[fqn] = type(layer).__name__
                try:
                    rep.layers[fqn] = extract(layer, (x_layer,), None, train=True)
                except Exception as e:  # noqa: BLE001
                    rep.layer_errors[fqn] = error_text(e)
    if rep.capture is not None and len(rep.capture.regions) > 1:
        try:
            rep.breaks = graph_breaks(model, loss_fn, batches.x)
        except Exception as e:  # noqa: BLE001
            rep.breaks = [f"(torch._dynamo.explain failed: {error_text(e)})"]
    if opts.trials > 0:
        rep.validation = validate(model, (batches.x,), loss_fn, trials=opts.trials, rtol=opts.rtol, atol=opts.atol,
                                  backend=opts.backend, train=True)
        failed = [t.name for t in rep.validation.tensors if t.status == "fail"]
        if not rep.validation.passed and failed and not rep.validation.errors:
            rep.referee = referee(model, batches.x, loss_fn, failed, opts)
    return rep
