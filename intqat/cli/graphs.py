"""intqat-graphs: the forward/backward graphs of a recipe's training step, at every QAT stage.

    intqat-graphs                                     # the default recipe, mlp_digits_w8a8
    intqat-graphs recipe=cnn_digits_w8a8 out=outputs/graphs/cnn trials=10
    intqat-graphs recipe=mlp_digits_w8a8 model.hidden=[32,32,32] data.batch_size=16 trials=2
    intqat-graphs checkpoint=runs/mlp_digits_w8a8/<date>/checkpoints/last.ckpt
    intqat-graphs recipe=cifar10_cnn_w8a8             # no data.data_dir: a random batch of the right shape

For each stage of the recipe's model:
    float       the model as cfg.model builds it (seeded with cfg.seed)
    fake_quant  intqat.prepare_qat(model, <recipe's quant config>), calibrated on a few batches;
                observers and BatchNorm statistics live, as right after the recipe's prepare_at
    integer     observers / BN statistics frozen as the recipe does before integer_at, then
                intqat.to_integer: the int8 forward and the STE backward
the training step loss = cross_entropy(model(x), y) (per token for a language model's (B, T, V)
logits) on one batch of the recipe's datamodule is
captured as torch.compile sees it (intqat.graphs.extract, train mode), and so is every layer
(nn.Linear / nn.Conv2d / their fake-quant and integer versions) on its own input, taken from
that batch by a forward hook. All graphs are written to `out`, one directory per distinct graph
hash: identical layers (same op, shapes, dtypes) and identical stages share one directory.
Then the step is validated: eager against torch.compile (inductor), outputs, loss, every
gradient and buffer, `trials` times (intqat.graphs.validate). Tensors that fail are refereed
against eager in float64: eager fp32 is not exact (CPU BatchNorm's backward loses up to 5e-3
relative over a CIFAR batch), so a compiled value at least as close to float64 as eager's is
a false alarm and is cleared; a compiled value far from float64 stays a failure.

Written to out/ (default outputs/graphs/<recipe>):
    <hash16>/forward.py backward.py graph_hash.txt summary.json members.txt
    index.json   stage -> {model: hash dir, layers: {fqn: hash dir}, summary, graph breaks, validation}
    index.tsv    one line per captured graph: stage, layer (or "<model>"), module type, hash dir
    report.txt   what was printed

Arguments are key=value. intqat-graphs' own keys:
    recipe=NAME          a recipe of recipes/*.yaml (default mlp_digits_w8a8), or the path of your own .yaml
    checkpoint=PATH      a Lightning checkpoint of intqat-train (a bare *.ckpt path works too): the
                         model comes from it, and the stages from its own onwards (an integer
                         checkpoint has only the integer stage). Without recipe=, the run's
                         .hydra/config.yaml next to checkpoints/ supplies data and quant config.
    out=DIR              output directory (default outputs/graphs/<recipe or checkpoint run>)
    trials=N             compiled runs compared against eager per stage (default 10; 0: no validation)
    stages=a,b           a subset of float,fake_quant,integer (default all the recipe has)
    layers=BOOL          capture every layer on its own as well (default true)
    calib_batches=N      batches for calibrate() before the fake-quant stage (default 3)
    backend=NAME         torch.compile backend validated against eager (default inductor)
    rtol=F atol=F        validation tolerances (default 1e-5 each)
    verbose=BOOL         print every saved tensor and integer op of each stage (default false)
Any other key=value is a Hydra override of the recipe (model.hidden=[32,32], data.batch_size=16).

Exit status: 0 when every stage was captured and validated; 1 when an extraction failed, a
validation failed (after the float64 referee) or the integer stage's step has graph breaks
(reported as file:line; breaks in the fake-quant stage are reported, not fatal); 2 for a bad
command line (unknown recipe, unknown key, ...).

On a 2-core machine TORCHINDUCTOR_COMPILE_THREADS=1 makes cold compiles faster (no worker pool).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import shutil
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["main", "run", "GraphsOptions", "StageReport", "STAGES"]

PROG = "intqat-graphs"
STAGES = ("float", "fake_quant", "integer")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MODEL_KEY = "<model>"  # the whole model's entry among a stage's layers in index.tsv
INDEX_JSON, INDEX_TSV, REPORT = "index.json", "index.tsv", "report.txt"
DEFAULT_OUT_ROOT = Path("outputs") / "graphs"


# -- command line ------------------------------------------------------------------------------------
class UsageError(Exception):
    """A wrong command line: reported on stderr, exit status 2."""


@dataclass
class GraphsOptions:
    recipe: str | None = None
    checkpoint: Path | None = None
    out: Path | None = None
    trials: int = 10
    stages: tuple[str, ...] = STAGES
    layers: bool = True
    calib_batches: int = 3
    backend: str = "inductor"
    rtol: float = 1e-5
    atol: float = 1e-5
    verbose: bool = False
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of the recipe


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _parse_value(key: str, value: str, convert: Callable[[str], Any], what: str) -> Any:
    try:
        return convert(value)
    except (ValueError, KeyError):
        raise UsageError(f"{key}={value!r}: expected {what}") from None


def _parse_stages(value: str) -> tuple[str, ...]:
    stages = tuple(s.strip() for s in value.split(",") if s.strip())
    bad = [s for s in stages if s not in STAGES]
    if bad or not stages:
        raise ValueError
    return tuple(s for s in STAGES if s in stages)  # always in pipeline order


def parse_args(argv: list[str]) -> GraphsOptions:
    opts = GraphsOptions()
    seen: set[str] = set()
    for arg in argv:
        if "=" not in arg:
            if arg.startswith("-"):
                raise UsageError(f"unknown option {arg!r} (arguments are key=value; see --help)")
            if arg.endswith(".ckpt") or (Path(arg).is_file() and not arg.endswith((".yaml", ".yml"))):
                key, value = "checkpoint", arg
            else:
                key, value = "recipe", arg
        else:
            key, value = arg.split("=", 1)
        own = key in ("recipe", "checkpoint", "out", "trials", "stages", "layers", "calib_batches", "backend",
                      "rtol", "atol", "verbose")
        if not own:
            opts.overrides.append(arg)
            continue
        if key in seen:
            raise UsageError(f"{key}= given twice; give it once")
        seen.add(key)
        if key == "recipe":
            opts.recipe = value
        elif key == "checkpoint":
            opts.checkpoint = Path(value).expanduser()
        elif key == "out":
            opts.out = Path(value).expanduser()
        elif key in ("trials", "calib_batches"):
            n = _parse_value(key, value, int, "an integer >= 0")
            if n < 0:
                raise UsageError(f"{key}={value}: expected an integer >= 0")
            setattr(opts, key, n)
        elif key == "stages":
            opts.stages = _parse_value(key, value, _parse_stages, f"a comma-separated subset of {','.join(STAGES)}")
        elif key in ("layers", "verbose"):
            setattr(opts, key, _parse_value(key, value, lambda v: _BOOLS[v.lower()], "true or false"))
        elif key in ("rtol", "atol"):
            setattr(opts, key, _parse_value(key, value, float, "a number"))
        elif key == "backend":
            opts.backend = value
    return opts


def _help() -> str:
    from intqat.cli import train as train_cli

    recipes = ", ".join(train_cli.available_recipes())
    return __doc__.replace("intqat-graphs: ", f"usage: {PROG} [key=value ...]\n\n", 1) + f"\nRecipes: {recipes}\n"


# -- the recipe: config, model, data ----------------------------------------------------------------------
def compose_recipe(recipe: str, overrides: list[str]):
    """The recipe's config composed exactly as intqat-train composes it (recipes/ + pkg://intqat.conf)."""
    from intqat.cli import train as train_cli

    available = train_cli.available_recipes()
    if recipe.endswith((".yaml", ".yml")):  # your own recipe file (as intqat-train takes it)
        if not Path(recipe).expanduser().is_file():
            raise UsageError(f"recipe file {recipe} does not exist")
    elif recipe not in available:
        raise UsageError(f"unknown recipe {recipe!r}; available recipes: {', '.join(available)} "
                         f"(in {train_cli.recipes_dir()}), or the path of your own recipe file")
    compose = getattr(train_cli, "compose_recipe", None) or getattr(train_cli, "_compose", None) or _compose
    try:
        return compose(recipe, overrides)
    except Exception:  # noqa: BLE001  (Hydra / OmegaConf raise several types): explain, as intqat-train does
        problem = train_cli.check_command_line(recipe, overrides) or "the recipe does not compose"
        raise UsageError(problem) from None


def _compose(recipe: str, overrides: list[str]):
    """Hydra's compose API on recipes/ (each recipe puts pkg://intqat.conf on its own search path)."""
    from hydra import compose, initialize_config_dir

    from intqat.cli.train import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3", job_name=PROG.replace("-", "_")):
        return compose(config_name=recipe, overrides=overrides)


def _run_config_of(checkpoint: Path):
    """The composed config a run saved next to its checkpoints (<output_dir>/.hydra/config.yaml), or None."""
    from omegaconf import OmegaConf

    for parent in list(checkpoint.resolve().parents)[:3]:
        path = parent / ".hydra" / "config.yaml"
        if path.is_file():
            return OmegaConf.load(path), path
    return None, None


def _apply_overrides(cfg, overrides: list[str]):
    from omegaconf import OmegaConf

    for ov in overrides:
        key, _, value = ov.lstrip("+").partition("=")
        OmegaConf.update(cfg, key, _yaml_value(value), force_add=ov.startswith("+"))
    return cfg


def _yaml_value(value: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


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


# A failed tensor is cleared when the compiled value misses float64 by at most this many times eager's
# own miss: two fp32 evaluations in different orders are each ~one rounding budget from the truth, and
# neither is the reference (measured on the GPT recipe's quantized stages: ratios 1.05x-1.83x, where a
# rounding difference in a LayerNorm flips an activation code and both sides move by one step). A
# miscompile is off by orders of magnitude (tests: > 100x).
REFEREE_SLACK = 2.0


@dataclass
class RefereeRow:
    name: str
    compiled_vs_eager: float  # max |compiled - eager|
    eager_vs_fp64: float  # max |eager fp32 - eager float64|: eager's own rounding error
    compiled_vs_fp64: float
    verdict: str  # "eager less accurate", "compiled within tolerance of fp64", "as accurate as eager", "compiled wrong"

    @property
    def cleared(self) -> bool:
        return self.verdict != "compiled wrong"


@dataclass
class Referee:
    """Who is right when the compiled step and eager disagree: both against eager in float64.

    validate() takes eager fp32 as exact (its repeat runs are bit-identical, so the allowed
    fluctuation is 0). But eager fp32 has rounding error of its own: CPU BatchNorm's training
    backward accumulates over N*H*W elements per channel, 131k for a CIFAR batch of 128, and
    misses float64 by up to 5e-3 relative in the first block's gradients, where inductor's
    blocked reductions are within 1e-5. A tensor that failed is cleared when the compiled value
    is as close to float64 as eager's (within REFEREE_SLACK times eager's own miss), or within
    rtol/atol of it; it stays failed when the compiled value is the one far from float64 (a real
    miscompile). A quantized transformer stage needs the slack: inductor's LayerNorm / softmax round
    differently from eager's, an activation near a rounding boundary takes the neighbouring code, and
    both fp32 results land about equally far from float64.
    """

    rows: list[RefereeRow] = field(default_factory=list)
    error: str | None = None  # the float64 run or the extra compiled run failed: nothing cleared

    @property
    def cleared(self) -> bool:
        return self.error is None and bool(self.rows) and all(r.cleared for r in self.rows)

    def to_table(self) -> str:
        if self.error is not None:
            return f"float64 referee could not run: {self.error}"
        lines = [f"float64 referee of the failed tensors: {'every one CLEARED (false alarms)' if self.cleared else 'compiled result WRONG'}",
                 f"{'tensor':<44} {'|comp-eager|':>12} {'|eager-fp64|':>12} {'|comp-fp64|':>12}  verdict"]
        lines += [f"{r.name:<44} {r.compiled_vs_eager:>12.3e} {r.eager_vs_fp64:>12.3e} {r.compiled_vs_fp64:>12.3e}  {r.verdict}"
                  for r in self.rows]
        return "\n".join(lines)


def _step_parts(model, x, loss_fn, step, dtype=None) -> dict[str, Any]:
    """One training step on a fresh copy, named as validate() names them: output, loss, grad.*, buffer.*."""
    import torch

    from intqat.graphs.compare import leaves

    model = copy.deepcopy(model).train()
    if dtype is not None:
        model = model.to(dtype)  # floating parameters and buffers only; integer buffers stay
        x = x.to(dtype) if x.is_floating_point() else x  # a language model's token ids stay integers
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)  # validate's default seed: same dropout masks
    output, loss = step(model, loss_fn, x)
    loss.backward()
    parts = {**leaves(output, "output"), "loss": loss.detach()}
    parts.update({f"grad.{n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    parts.update({f"buffer.{n}": b for n, b in model.named_buffers()})
    return {k: v.detach().to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in parts.items()}


def referee(model, x, loss_fn, failed: list[str], opts: GraphsOptions) -> Referee:
    """Arbitrate the failed tensors of a validation against eager float64 (see Referee)."""
    import torch
    import torch._inductor.config as inductor_config

    from intqat.graphs.step import train_step

    ref = Referee()
    try:
        eager = _step_parts(model, x, loss_fn, train_step)
        fp64 = _step_parts(model, x, lambda out: loss_fn(out.double()), train_step, torch.float64)
        torch.compiler.reset()
        compiled_step = torch.compile(train_step, backend=opts.backend, dynamic=False)
        with inductor_config.patch(fallback_random=True):  # as validate(): eager's RNG, same dropout masks
            compiled = _step_parts(model, x, loss_fn, compiled_step)
    except Exception as e:  # noqa: BLE001  (a model that cannot run in float64: nothing is cleared)
        ref.error = _error_text(e)
        return ref
    finally:
        torch.compiler.reset()
    for name in failed:
        e, r, c = eager.get(name), fp64.get(name), compiled.get(name)
        if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (e, r, c)) or c.shape != e.shape:
            ref.rows.append(RefereeRow(name, math.inf, math.nan, math.nan, "compiled wrong"))
            continue
        ce, er, cr = ((a - b).abs().max().item() for a, b in ((c, e), (e, r), (c, r)))
        if cr <= opts.atol + opts.rtol * r.abs().max().item():
            verdict = "compiled within tolerance of fp64"
        elif cr <= er:
            verdict = "eager less accurate"
        elif cr <= REFEREE_SLACK * er:
            verdict = "as accurate as eager"
        else:
            verdict = "compiled wrong"
        ref.rows.append(RefereeRow(name, ce, er, cr, verdict))
    return ref


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


def _error_text(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:500]}"


def capture_stage(stage: str, model, batches: Batches, loss_fn, opts: GraphsOptions) -> StageReport:
    from intqat.graphs import extract, validate

    rep = StageReport(stage, type(model).__name__)
    with _faithful_extract():
        try:
            rep.capture = extract(model, (batches.x,), loss_fn, train=True)
        except Exception as e:  # noqa: BLE001  (reported, the run goes on and exits 1)
            rep.error = _error_text(e)
            rep.traceback = traceback.format_exc()
        if opts.layers:
            for fqn, x_layer in layer_inputs(model, batches.x).items():
                layer = model.get_submodule(fqn)
                rep.layer_types[fqn] = type(layer).__name__
                try:
                    rep.layers[fqn] = extract(layer, (x_layer,), None, train=True)
                except Exception as e:  # noqa: BLE001
                    rep.layer_errors[fqn] = _error_text(e)
    if rep.capture is not None and len(rep.capture.regions) > 1:
        try:
            rep.breaks = graph_breaks(model, loss_fn, batches.x)
        except Exception as e:  # noqa: BLE001
            rep.breaks = [f"(torch._dynamo.explain failed: {_error_text(e)})"]
    if opts.trials > 0:
        rep.validation = validate(model, (batches.x,), loss_fn, trials=opts.trials, rtol=opts.rtol, atol=opts.atol,
                                  backend=opts.backend, train=True)
        failed = [t.name for t in rep.validation.tensors if t.status == "fail"]
        if not rep.validation.passed and failed and not rep.validation.errors:
            rep.referee = referee(model, batches.x, loss_fn, failed, opts)
    return rep


# -- writing ----------------------------------------------------------------------------------------------
def _clear_previous(out: Path) -> None:
    """Remove the hash directories a previous run wrote here (listed in its index.json), nothing else."""
    index = out / INDEX_JSON
    if not index.is_file():
        return
    try:
        previous = json.loads(index.read_text()).get("graphs", {})
    except (json.JSONDecodeError, AttributeError):
        return
    for dirname in previous:
        d = out / dirname
        if d.is_dir() and (d / "graph_hash.txt").is_file():
            shutil.rmtree(d)


def write_graphs(reports: list[StageReport], out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Dedupe every capture by hash, save one directory per graph, write index.json / index.tsv."""
    from intqat.graphs import dedupe, save_groups

    captures: dict[str, Any] = {}
    for rep in reports:
        if rep.capture is not None:
            captures[f"{rep.stage}/{MODEL_KEY}"] = rep.capture
        for fqn, cap in rep.layers.items():
            captures[f"{rep.stage}/{fqn}"] = cap
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out)
    groups = dedupe(captures)
    save_groups(groups, out)
    dir_of = {name: g.dirname for g in groups for name in g.names}

    tsv = ["stage\tlayer\tmodule\thash_dir"]
    stages: dict[str, Any] = {}
    for rep in reports:
        entry: dict[str, Any] = {
            "model_type": rep.model_type,
            "model": dir_of.get(f"{rep.stage}/{MODEL_KEY}"),
            "layers": {fqn: dir_of[f"{rep.stage}/{fqn}"] for fqn in rep.layers},
            "layer_types": rep.layer_types,
            "error": rep.error,
            "layer_errors": rep.layer_errors,
            "graph_breaks": rep.breaks,
        }
        if rep.capture is not None:
            s = rep.capture.summary
            entry["summary"] = {
                "regions": s.regions, "forward_nodes": s.forward_nodes, "backward_nodes": s.backward_nodes,
                "integer_ops": len(s.integer_ops), "ste_kernels": len(s.ste_kernels),
                "integer_grads": s.integer_grads, "saved_bytes": s.saved_bytes, "activation_bytes": s.activation_bytes,
            }
            tsv.append(f"{rep.stage}\t{MODEL_KEY}\t{rep.model_type}\t{entry['model']}")
        for fqn in rep.layers:
            tsv.append(f"{rep.stage}\t{fqn}\t{rep.layer_types[fqn]}\t{entry['layers'][fqn]}")
        v = rep.validation
        if v is not None:
            entry["validation"] = {
                "passed": v.passed, "status": v.status, "backend": v.backend, "rtol": v.rtol, "atol": v.atol,
                "trial_status": v.trial_status, "errors": v.errors,
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "max_abs": t.max_abs,
                             "max_rel": t.max_rel, "eager_fluctuation": t.eager_fluctuation, "status": t.status}
                            for t in v.tensors],
                "referee": None if rep.referee is None else {
                    "cleared": rep.referee.cleared, "error": rep.referee.error,
                    "rows": [r.__dict__ for r in rep.referee.rows]},
                "stage_passed": rep.validated,
            }
        entry["ok"] = rep.ok
        entry["problems"] = rep.problems
        stages[rep.stage] = entry
    index = {
        **meta,
        "captured_graphs": len(captures),
        "distinct_graphs": len(groups),
        "stages": stages,
        "graphs": {g.dirname: g.names for g in groups},
    }
    (out / INDEX_JSON).write_text(json.dumps(index, indent=1, default=str) + "\n")
    (out / INDEX_TSV).write_text("\n".join(tsv) + "\n")
    return index


# -- printing ---------------------------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def stage_text(rep: StageReport, dir_of: dict[str, str], verbose: bool) -> str:
    lines = [f"== stage {rep.stage} ({rep.model_type}) " + "=" * max(0, 60 - len(rep.stage) - len(rep.model_type))]
    if rep.capture is None:
        lines.append(f"extraction FAILED: {rep.error}")
    else:
        s = rep.capture.summary
        text = s.to_text().splitlines()
        lines.append(f"graph {dir_of.get(f'{rep.stage}/{MODEL_KEY}')}  " + text[0])
        lines.append(f"integer ops: {len(s.integer_ops)} (forward {sum(o.graph == 'forward' for o in s.integer_ops)}, "
                     f"backward {sum(o.graph == 'backward' for o in s.integer_ops)}); "
                     f"STE kernels in backward: {len(s.ste_kernels)}; "
                     f"integer tensors requiring grad: {', '.join(s.integer_grads) or 'none'}")
        lines.append(f"saved for backward: {len(s.saved)} tensors, {_fmt_bytes(s.saved_bytes)} "
                     f"({_fmt_bytes(s.activation_bytes)} activations)")
        if verbose:
            lines += text[4:]
    if rep.breaks:
        lines.append(f"graph breaks ({len(rep.capture.regions) - 1}):")
        lines += [f"  {b}" for b in rep.breaks]
    if rep.layers or rep.layer_errors:
        rows = [("layer", "module", "graph", "int ops", "STE", "saved")]
        for fqn, cap in rep.layers.items():
            s = cap.summary
            regions = f" ({s.regions} regions)" if s.regions > 1 else ""
            rows.append((fqn, rep.layer_types[fqn], dir_of[f"{rep.stage}/{fqn}"] + regions, str(len(s.integer_ops)),
                         str(len(s.ste_kernels)), _fmt_bytes(s.saved_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip())
        lines += [f"  {fqn}: extraction FAILED: {err}" for fqn, err in rep.layer_errors.items()]
    if rep.validation is not None:
        v = rep.validation
        lines.append(f"validation: one train step, eager vs torch.compile ({v.backend}); output, loss, every grad "
                     "and buffer (a fresh copy of the model per run):")
        lines.append(validation_table(v, verbose))
        if rep.referee is not None:
            lines.append(rep.referee.to_table())
            lines.append(f"stage verdict: {'PASSED' if rep.validated else 'FAILED'} "
                         + ("(every failed tensor is fp32 rounding, as accurate as eager's: not the compiler)" if rep.validated
                            else "(the compiled step computes something else than eager)"))
    return "\n".join(lines)


def validation_table(v, verbose: bool = False) -> str:
    """ValidationResult.to_table(); unless verbose, buffers equal to eager's bit for bit in every
    trial are folded into one line (a fake-quant model has a dozen per layer, all exact)."""
    table = v.to_table().splitlines()
    if verbose:
        return "\n".join(table)
    exact = {t.name for t in v.tensors if t.name.startswith("buffer.") and t.status == "pass" and t.max_abs == 0.0}
    kept = [line for line in table if line.split(" ", 1)[0] not in exact]
    if exact:
        kept.append(f"{'buffer.* (' + str(len(exact)) + ' tensors)':<36} {'':<9} {'':<16} {0.0:>10.3e} {0.0:>10.3e} "
                    f"{'':>11}  pass (bit-identical; verbose=true lists them)")
    return "\n".join(kept)


# -- the run ----------------------------------------------------------------------------------------------
def run(opts: GraphsOptions, log: Callable[[str], None] = print) -> tuple[int, dict[str, Any]]:
    """Build, capture, validate, write; returns (exit status, index)."""
    import torch
    from hydra.utils import instantiate

    cfg, cfg_source = None, None
    if opts.recipe is None and opts.checkpoint is None:
        from intqat.cli.train import DEFAULT_RECIPE

        opts.recipe = DEFAULT_RECIPE
    if opts.checkpoint is not None and not opts.checkpoint.is_file():
        raise UsageError(f"checkpoint {str(opts.checkpoint)!r} does not exist")
    if opts.recipe is not None:
        cfg = compose_recipe(opts.recipe, opts.overrides)
        cfg_source = f"recipe {opts.recipe}"
    else:
        cfg, path = _run_config_of(opts.checkpoint)
        if cfg is None:
            raise UsageError(f"no .hydra/config.yaml next to {opts.checkpoint}: pass recipe=NAME too, for the data "
                             "and the quantization config")
        cfg = _apply_overrides(cfg, opts.overrides)
        cfg_source = f"run config {path}"
    seed = int(cfg.get("seed", 0) or 0)
    name = Path(opts.recipe).stem if opts.recipe else opts.checkpoint.resolve().parent.parent.name
    out = opts.out or DEFAULT_OUT_ROOT / name

    torch.manual_seed(seed)
    if opts.checkpoint is not None:
        model = load_checkpoint_model(opts.checkpoint)
        source = f"checkpoint {opts.checkpoint}"
    else:
        model = instantiate(cfg.model)
        source = f"{cfg.model._target_} from cfg.model (seed {seed})"
    start = stage_of(model)
    quant_config = quant_config_of(cfg)
    possible = STAGES[STAGES.index(start):]
    if quant_config is None and start == "float":
        possible = ("float",)
    wanted = tuple(s for s in opts.stages if s in possible)
    skipped = [s for s in opts.stages if s not in possible]
    batches = example_batches(cfg, opts.calib_batches, seed)
    y = batches.y

    def loss_fn(output):
        return step_loss(output, y)

    log(f"{PROG}: {cfg_source}; model {source}")
    log(f"  input: {batches.source}")
    log(f"  quant config: {quant_config if quant_config is not None else 'none (the recipe trains fp32)'}; "
        f"stages: {', '.join(wanted) or 'none'}" + (f" (not reachable: {', '.join(skipped)})" if skipped else ""))
    log(f"  step: cross_entropy(model(x), y), train mode; validation: {opts.trials} trial(s), eager vs torch.compile "
        f"({opts.backend}), rtol={opts.rtol:g} atol={opts.atol:g}")
    if not wanted:
        raise UsageError(f"no stage to capture: asked {', '.join(opts.stages)}, the model can do {', '.join(possible)}")

    models = build_stages(model, start, quant_config, cfg, batches, wanted)
    reports = []
    for stage, m in models.items():
        reports.append(capture_stage(stage, m, batches, loss_fn, opts))
    meta = {
        "tool": PROG, "recipe": opts.recipe, "checkpoint": str(opts.checkpoint) if opts.checkpoint else None,
        "config": cfg_source, "overrides": opts.overrides, "input": batches.source, "input_shape": list(batches.x.shape),
        "quant_config": quant_config, "trials": opts.trials, "backend": opts.backend, "rtol": opts.rtol,
        "atol": opts.atol, "torch": torch.__version__,
    }
    index = write_graphs(reports, out, meta)
    dir_of = {n: d for d, names in index["graphs"].items() for n in names}

    text = [stage_text(rep, dir_of, opts.verbose) for rep in reports]
    failed = [f"{rep.stage} ({', '.join(rep.problems)})" for rep in reports if not rep.ok]
    text.append(
        f"{PROG}: {index['captured_graphs']} graphs captured, {index['distinct_graphs']} distinct, written to {out}/ "
        f"(index: {out / INDEX_JSON}, {out / INDEX_TSV})"
    )
    text.append(f"{PROG}: FAILED stage(s): {', '.join(failed)}" if failed else f"{PROG}: every stage extracted and validated")
    report = "\n\n".join(text)
    log("\n" + report)
    header = [f"{k}: {v}" for k, v in meta.items()]
    tracebacks = [f"{rep.stage}: {rep.traceback}" for rep in reports if rep.traceback]
    (out / REPORT).write_text("\n".join(header) + "\n\n" + "\n\n".join([report, *tracebacks]) + "\n")
    return (EXIT_FAILED if failed else EXIT_OK), index


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(_help())
        return EXIT_OK
    try:
        opts = parse_args(argv)
        status, _ = run(opts)
    except UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return status


if __name__ == "__main__":
    sys.exit(main())
