"""intqat-graphs: the forward/backward graphs of a recipe's training step, at every QAT stage.

    intqat-graphs                                     # the default recipe, mlp_digits_w8a8
    intqat-graphs recipe=cnn_digits_w8a8 --out outputs/graphs/cnn --trials 10
    intqat-graphs recipe=mlp_digits_w8a8 model.hidden=[32,32,32] data.batch_size=16 --trials 2
    intqat-graphs runs/mlp_digits_w8a8/<date>/checkpoints/last.ckpt
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

Arguments: the recipe and its Hydra overrides as key=value, as intqat-train takes them; intqat-graphs'
own options as --flags (as intqat-export and intqat-bench take theirs):
    recipe=NAME          a recipe of recipes/*.yaml (default mlp_digits_w8a8), or the path of your own .yaml
    --checkpoint PATH    a Lightning checkpoint of intqat-train (a bare *.ckpt argument works too): the
                         model comes from it, and the stages from its own onwards (an integer
                         checkpoint has only the integer stage). Without recipe=, the run's
                         .hydra/config.yaml next to checkpoints/ supplies data and quant config.
    --out DIR            output directory (default outputs/graphs/<recipe or checkpoint run>)
    --trials N           compiled runs compared against eager per stage (default 10; 0: no validation)
    --stages a,b         a subset of float,fake_quant,integer (default all the recipe has)
    --no-layers          do not capture every layer on its own as well
    --calib-batches N    batches for calibrate() before the fake-quant stage (default 3)
    --backend NAME       torch.compile backend validated against eager (default inductor)
    --rtol F --atol F    validation tolerances (default 1e-5 each)
    --verbose            print every saved tensor and integer op of each stage
Any other key=value is a Hydra override of the recipe (model.hidden=[32,32], data.batch_size=16).

Exit status: 0 when every stage was captured and validated; 1 when an extraction failed, a
validation failed (after the float64 referee) or the integer stage's step has graph breaks
(reported as file:line; breaks in the fake-quant stage are reported, not fatal); 2 for a bad
command line (unknown recipe, unknown key, ...).

On a 2-core machine TORCHINDUCTOR_COMPILE_THREADS=1 makes cold compiles faster (no worker pool).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from intqat.compose import DEFAULT_RECIPE, RecipeError, apply_overrides, available_recipes, compose, run_config
from intqat.graphs.options import STAGES, GraphsOptions
from intqat.graphs.report import INDEX_JSON, INDEX_TSV, REPORT, stage_text, write_graphs
from intqat.graphs.stages import (
    StageReport,
    build_stages,
    capture_stage,
    example_batches,
    load_checkpoint_model,
    quant_config_of,
    stage_of,
    step_loss,
)

__all__ = ["main", "run", "parse_args", "GraphsOptions", "StageReport", "STAGES"]

PROG = "intqat-graphs"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_OUT_ROOT = Path("outputs") / "graphs"
_OWN_KEYS = ("checkpoint", "out", "trials", "stages", "layers", "calib_batches", "backend", "rtol", "atol", "verbose")


# -- command line ------------------------------------------------------------------------------------
class UsageError(Exception):
    """A wrong command line: reported on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse exits; intqat-graphs reports and returns 2
        raise UsageError(message)


def _count(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError
    return n


def _stages(value: str) -> tuple[str, ...]:
    stages = tuple(s.strip() for s in value.split(",") if s.strip())
    if not stages or any(s not in STAGES for s in stages):
        raise ValueError
    return tuple(s for s in STAGES if s in stages)  # always in pipeline order


_count.__name__ = "an integer >= 0"  # (argparse names the converter in its message)
_stages.__name__ = f"a comma-separated subset of {','.join(STAGES)}"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, add_help=False)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--trials", type=_count, default=10)
    p.add_argument("--stages", type=_stages, default=STAGES)
    p.add_argument("--no-layers", dest="layers", action="store_false")
    p.add_argument("--calib-batches", type=_count, default=3)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--verbose", action="store_true")
    return p


def parse_args(argv: list[str]) -> GraphsOptions:
    """--flags for intqat-graphs' own options; recipe=NAME and Hydra key=value overrides; a bare *.ckpt is the
    checkpoint, a bare name or .yaml the recipe."""
    ns, rest = _parser().parse_known_args(argv)
    opts = GraphsOptions(checkpoint=ns.checkpoint and ns.checkpoint.expanduser(), out=ns.out and ns.out.expanduser(),
                         trials=ns.trials, stages=ns.stages, layers=ns.layers, calib_batches=ns.calib_batches,
                         backend=ns.backend, rtol=ns.rtol, atol=ns.atol, verbose=ns.verbose)
    recipes = []
    for arg in rest:
        if arg.startswith("-"):
            raise UsageError(f"unknown option {arg!r} (see --help)")
        key, eq, value = arg.partition("=")
        if not eq:
            if arg.endswith(".ckpt") or (Path(arg).is_file() and not arg.endswith((".yaml", ".yml"))):
                if opts.checkpoint is not None:
                    raise UsageError("a checkpoint given twice; give it once")
                opts.checkpoint = Path(arg).expanduser()
            else:
                recipes.append(arg)
        elif key == "recipe":
            recipes.append(value)
        elif key in _OWN_KEYS:
            flag = "--no-layers" if key == "layers" else f"--{key.replace('_', '-')}"
            raise UsageError(f"{arg!r}: intqat-graphs takes its own options as flags ({flag} ...); key=value arguments "
                             "are the recipe and its Hydra overrides")
        else:
            opts.overrides.append(arg)
    if len(recipes) > 1:
        raise UsageError(f"recipe given {len(recipes)} times ({', '.join(recipes)}); give it once")
    opts.recipe = recipes[0] if recipes else None
    return opts


def _help() -> str:
    recipes = ", ".join(available_recipes())
    return __doc__.replace("intqat-graphs: ", f"usage: {PROG} [recipe=NAME] [--flags] [key=value ...]\n\n", 1) + f"\nRecipes: {recipes}\n"


# -- the recipe ---------------------------------------------------------------------------------------------
def compose_recipe(recipe: str, overrides: list[str]):
    """The recipe's config composed exactly as intqat-train composes it (intqat.compose)."""
    try:
        return compose(recipe, overrides)
    except RecipeError as e:
        raise UsageError(str(e)) from None


def run(opts: GraphsOptions, log: Callable[[str], None] = print) -> tuple[int, dict[str, Any]]:
    """Build, capture, validate, write; returns (exit status, index)."""
    import torch
    from hydra.utils import instantiate

    cfg, cfg_source = None, None
    if opts.recipe is None and opts.checkpoint is None:
        opts.recipe = DEFAULT_RECIPE
    if opts.checkpoint is not None and not opts.checkpoint.is_file():
        raise UsageError(f"checkpoint {str(opts.checkpoint)!r} does not exist")
    if opts.recipe is not None:
        cfg = compose_recipe(opts.recipe, opts.overrides)
        cfg_source = f"recipe {opts.recipe}"
    else:
        cfg, path = run_config(opts.checkpoint)
        if cfg is None:
            raise UsageError(f"no .hydra/config.yaml next to {opts.checkpoint}: pass recipe=NAME too, for the data "
                             "and the quantization config")
        cfg = apply_overrides(cfg, opts.overrides)
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
