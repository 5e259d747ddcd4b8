"""intqat-export: a training checkpoint -> model.pt2 + report.json + report.md, and the deploy formats asked for.

    intqat-export runs/mlp_digits_w8a8/2025-01-01_12-00-00          # a run dir: its config, last.ckpt
    intqat-export path/to/last.ckpt recipe=mlp_digits_w8a8 --out export/
    intqat-export RUN_DIR --low-precision fp16 --data-max 256 model.hidden=[64,64]
    intqat-export RUN_DIR --format pt2,pte                          # + model.pte (ExecuTorch, XNNPACK)
    intqat-export RUN_DIR --format onnx,onnx-int                    # model.onnx (Q/DQ), model.int.onnx (integer ops)

Formats (--format, comma-separated; default: the config's export.formats, else pt2):
  pt2       model.pt2 + report.json / report.md: the torch.export program (intqat.export)
  pte       model.pte + model_report.json / .md: ExecuTorch lowered with XNNPACK (intqat.deploy.executorch)
  onnx      model.onnx + model_onnx_report.json / .md: QuantizeLinear / DequantizeLinear (intqat.deploy.onnx)
  onnx-int  model.int.onnx + model_int_onnx_report.json / .md: MatMulInteger / ConvInteger, equal to the
            integer model bit for bit in onnxruntime (intqat.deploy.onnx, form="int")
Each format's packages are checked before anything is loaded (pip install 'intqat[deploy]').

The model is rebuilt from the run's composed config (RUN_DIR/.hydra/config.yaml, or config.yaml)
or from recipe=NAME (plus key=value overrides, as intqat-train takes them), given the quantized layers the checkpoint records
(checkpoint["intqat"], intqat.callback's format) and loaded strictly; then
intqat.export_mixed_precision calibrates on the validation split and measures the error and
accuracy on the test split (--split).

Exit codes: 0 written; 1 the checkpoint, config or data cannot be used (the message names the
file and what is wrong; nothing is written); 2 a wrong command line.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXIT_ERROR, EXIT_USAGE = 1, 2
CONFIG_FILES = (".hydra/config.yaml", "config.yaml")  # where a run directory keeps its config
# intqat.deploy.formats.FORMATS, spelled out so that --help imports nothing heavy (a test keeps them equal)
FORMATS = ("pt2", "pte", "onnx", "onnx-int")


class ExportError(Exception):
    """What the user must fix, as one message; exit code `code`."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


@dataclass
class Source:
    checkpoint: Path
    run_dir: Path | None  # the intqat-train output directory, when there is one


# -- where things are ---------------------------------------------------------------------------------
def _run_config(run_dir: Path) -> Path | None:
    return next((run_dir / f for f in CONFIG_FILES if (run_dir / f).is_file()), None)


def find_source(path: Path) -> Source:
    """A .ckpt file, or a run directory (its checkpoints/last.ckpt, else its only checkpoint)."""
    if not path.exists():
        raise ExportError(f"{path} does not exist: give a checkpoint (.ckpt) or an intqat-train run directory", EXIT_USAGE)
    if path.is_file():
        # runs/<name>/<time>/checkpoints/last.ckpt: the run directory is two levels up
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return Source(path, run_dir if _run_config(run_dir) else None)
    ckpts = sorted((path / "checkpoints").glob("*.ckpt")) or sorted(path.glob("*.ckpt"))
    last = [c for c in ckpts if c.name == "last.ckpt"]
    if last:
        return Source(last[0], path)
    if len(ckpts) == 1:
        return Source(ckpts[0], path)
    if not ckpts:
        raise ExportError(f"run directory {path} holds no checkpoint (looked for checkpoints/*.ckpt and *.ckpt)")
    names = ", ".join(str(c) for c in ckpts)
    raise ExportError(f"run directory {path} holds several checkpoints and no last.ckpt ({names}): give one of them", EXIT_USAGE)


def load_config(source: Source, recipe: str | None, overrides: list[str]) -> tuple[Any, str]:
    """(config, where it came from): --recipe composed with overrides, else the run's config."""
    from omegaconf import OmegaConf

    if recipe is not None:
        from intqat.compose import RecipeError, compose

        try:
            cfg = compose(recipe, overrides)
        except RecipeError as e:
            raise ExportError(str(e), EXIT_USAGE) from None
        return cfg, f"recipe {recipe}" + (f" with {' '.join(overrides)}" if overrides else "")
    config_file = _run_config(source.run_dir) if source.run_dir else None
    if config_file is None:
        from intqat.compose import available_recipes

        raise ExportError(
            f"cannot tell which recipe {source.checkpoint} came from: no {' or '.join(CONFIG_FILES)} in its run "
            f"directory; give recipe=NAME (available: {', '.join(available_recipes())})", EXIT_USAGE)
    try:
        cfg = OmegaConf.load(config_file)
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except Exception as e:  # noqa: BLE001  (YAML and OmegaConf errors)
        raise ExportError(f"cannot read the run config {config_file}: {e}") from None
    return cfg, str(config_file)


def split_recipe(flag: str | None, args: list[str]) -> tuple[str | None, list[str]]:
    """recipe=NAME among the key=value arguments (as intqat-train and intqat-graphs take it; --recipe NAME too),
    and the overrides that remain."""
    named = [a.split("=", 1)[1] for a in args if a.startswith("recipe=")]
    rest = [a for a in args if not a.startswith("recipe=")]
    given = named + ([flag] if flag is not None else [])
    if len(given) > 1:
        raise ExportError(f"recipe given {len(given)} times ({', '.join(given)}); give it once", EXIT_USAGE)
    return (given[0] if given else None), rest


# -- the checkpoint ---------------------------------------------------------------------------------
def load_checkpoint(path: Path) -> dict:
    import torch

    if not path.is_file():
        raise ExportError(f"checkpoint {path} is not a file")
    if not zipfile.is_zipfile(path):
        raise ExportError(f"cannot read checkpoint {path}: not a PyTorch checkpoint (torch.save writes a zip "
                          "archive; this file is not one): corrupt, truncated or another kind of file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  (zip, pickle and tensor errors all mean "unreadable")
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        # torch's weights_only message ends with the actual reason
        raise ExportError(f"cannot read checkpoint {path}: {lines[-1] if lines else type(e).__name__}") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        keys = ", ".join(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ExportError(f"checkpoint {path} is not a Lightning checkpoint: no 'state_dict' (it holds {keys})")
    return ckpt


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: checkpoint {va!r}, config {vb!r}")
    return out


def _state_dict_problems(model, state: dict) -> list[str]:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
              for k, v in own.items() if k in state and hasattr(state[k], "shape") and state[k].shape != v.shape]
    out = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
        if keys:
            out.append(f"{what}: {', '.join(keys[:6])}" + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else ""))
    return out


def _stage(record: dict) -> str:
    kinds = {rec.get("kind") for rec in record.values()}
    return "integer" if "integer" in kinds else "fake-quant" if kinds else "fp32"


def rebuild_model(cfg, ckpt: dict, path: Path, config_desc: str):
    """(model of `cfg` with the checkpoint's quantized layers and weights, its stage)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from torch import nn

    from intqat.callback import CHECKPOINT_KEY, restore_quant_structure

    if cfg.get("model") is None:
        raise ExportError(f"the config ({config_desc}) has no 'model' section to rebuild the model from")
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    trained = (ckpt.get("hyper_parameters") or {}).get("model")
    if isinstance(trained, dict) and trained != model_cfg:
        differences = "; ".join(_diff(trained, model_cfg))
        raise ExportError(f"checkpoint {path} does not come from {config_desc}: its model differs ({differences})")
    record = (ckpt.get(CHECKPOINT_KEY) or {}).get("modules")
    if not isinstance(record, dict):
        raise ExportError(f"checkpoint {path} has no quantization record (checkpoint[{CHECKPOINT_KEY!r}]['modules']): "
                          "it was not saved by intqat-train (ClassificationModule or the IntQAT callback)")
    stage = _stage(record)
    if stage == "fp32":
        raise ExportError(f"checkpoint {path} holds a float model (no quantized layer): there is nothing integer to "
                          "export; use a checkpoint saved after QAT's integer stage (last.ckpt of a run with quant=w8a8)")
    # intqat-train's ClassificationModule holds the network as .model: checkpoint keys and the
    # record's layer names start with "model."
    root = nn.Module()
    try:
        root.add_module("model", instantiate(model_cfg))
        restore_quant_structure(root, ckpt)
    except Exception as e:  # noqa: BLE001  (a user's model class, a record for another architecture)
        raise ExportError(f"checkpoint {path} does not fit the model of {config_desc}: {type(e).__name__}: {e}") from None
    state = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    problems = _state_dict_problems(root, state)
    if problems:
        raise ExportError(f"checkpoint {path} does not fit the model of {config_desc}: " + "; ".join(problems))
    root.load_state_dict(state, strict=True)
    return root.model.eval(), stage


# -- the data -----------------------------------------------------------------------------------------
def data_batches(cfg, n_calibration: int, split: str) -> tuple[Any, list, list]:
    """(example input, calibration batches from val, validation batches from `split`)."""
    from hydra.utils import instantiate

    try:
        datamodule = instantiate(cfg.data)
        datamodule.setup("fit")
        datamodule.setup("test")
        calibration = []
        for batch in datamodule.val_dataloader():
            calibration.append(tuple(batch))
            if len(calibration) >= n_calibration:
                break
        loader = datamodule.test_dataloader() if split == "test" else datamodule.val_dataloader()
        validation = [tuple(b) for b in loader]
    except Exception as e:  # noqa: BLE001  (a missing data set, a user's datamodule)
        raise ExportError(f"cannot load the data of the config (needed to calibrate and to measure the error): "
                          f"{type(e).__name__}: {e}") from None
    if not calibration or not validation:
        raise ExportError(f"the data of the config yields no {'validation' if not calibration else split} batch")
    return calibration[0][0][:2], calibration, validation


# -- the command line -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="intqat-export",
        description="Export a QAT checkpoint as a portable mixed-precision torch.export program "
                    "(model.pt2) with report.json and report.md, and the deploy formats asked for "
                    "(--format: pte for ExecuTorch / XNNPACK, onnx, onnx-int).",
        epilog="Exit codes: 0 written, 1 unusable checkpoint/config/data (nothing written), 2 usage error.",
    )
    p.add_argument("source", type=Path, help="a checkpoint (.ckpt) or an intqat-train run directory")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="recipe=NAME (the recipe the checkpoint was trained with: a name of recipes/, or the path of "
                        "your own .yaml; default: the run's own config) and overrides of the config, e.g. "
                        "model.hidden=[64,64] (as intqat-train and intqat-graphs take them)")
    p.add_argument("--recipe", help=argparse.SUPPRESS)  # (the flag form of recipe=NAME, kept for earlier commands)
    p.add_argument("--out", type=Path, help="output directory (default: RUN_DIR/export for a run directory, CKPT_STEM-export next to a checkpoint given by its path; an existing CKPT_STEM-export is not replaced without --out)")
    p.add_argument("--low-precision", choices=("bf16", "fp16"), default="bf16", help="type of the float ops autocast lowers (default bf16)")
    p.add_argument("--data-max", type=float, default=512.0, help="ops whose |values| exceed this on the calibration data stay fp32 (default 512)")
    p.add_argument("--max-depth-of-reduction", type=int, help="reductions (matmul K, sums) deeper than this stay fp32")
    p.add_argument("--exclude-node", action="append", default=[], metavar="REGEX", help="keep matching node names fp32 (repeatable)")
    p.add_argument("--fp32-op", action="append", default=[], metavar="OP", help="keep this op fp32, on top of the defaults, e.g. aten.softmax (repeatable)")
    p.add_argument("--calibration-batches", type=int, default=4, help="validation batches for data_max calibration (default 4)")
    p.add_argument("--split", choices=("test", "val"), default="test", help="split the error and accuracy are measured on (default test)")
    p.add_argument("--no-compress", action="store_true", help="store model.pt2 uncompressed, laid out as torch.export.save writes it")
    p.add_argument("--format", dest="formats", metavar="LIST",
                   help=f"comma-separated formats to write, of {','.join(FORMATS)} (default: the config's "
                        "export.formats, else pt2)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="pte: the largest batch the .pte takes (ExecuTorch plans memory for it; default 64); "
                        "onnx: bounds the trace only (the file takes any batch)")
    p.add_argument("--aoti", action="store_true",
                   help="also write model.aoti.pt2: the program compiled by AOTInductor for this CPU (~15 s; "
                        "lowest latency; checked equal to model.pt2 before it is kept)")
    return p


def _autocast_options(args) -> dict[str, Any]:
    import torch

    from intqat.autocast import default_fp32_ops

    options: dict[str, Any] = {
        "low_precision_type": {"bf16": torch.bfloat16, "fp16": torch.float16}[args.low_precision],
        "data_max": args.data_max,
        "max_depth_of_reduction": args.max_depth_of_reduction,
        "nodes_to_exclude": list(args.exclude_node),
    }
    if args.fp32_op:
        options["fp32_ops"] = [*default_fp32_ops(), *args.fp32_op]
    return options


def parse_formats(text) -> list[str]:
    """--format's / export.formats' list, checked (ExportError, exit 2, on a wrong name)."""
    from intqat.deploy.formats import parse_formats as parse

    try:
        return parse(text)
    except ValueError as e:
        raise ExportError(f"--format: {e}", EXIT_USAGE) from None


def config_formats(cfg) -> list[str]:
    """The recipe's export.formats (a list, or a comma-separated string), else pt2."""
    export = cfg.get("export") if hasattr(cfg, "get") else None
    value = export.get("formats") if export is not None and hasattr(export, "get") else None
    return parse_formats(value if value is None or isinstance(value, str) else list(value))


def check_formats(formats: list[str]) -> None:
    """Every format's packages, and the ONNX exporter, before anything is loaded or written."""
    from intqat.deploy import MissingDeployPackage
    from intqat.deploy.formats import check_formats as check

    try:
        check(formats)
    except (MissingDeployPackage, ValueError) as e:
        raise ExportError(str(e)) from None


def run(args) -> Path:
    """Every check first, the exports, then the saves (each atomic); returns the output directory."""
    from intqat.export import export_mixed_precision

    from intqat.autocast import AutocastConfig

    formats = parse_formats(args.formats) if args.formats is not None else None
    if formats is not None:
        check_formats(formats)  # before any loading: a missing package costs nothing
    if args.max_batch < 1:
        raise ExportError(f"--max-batch must be >= 1, got {args.max_batch}", EXIT_USAGE)
    if args.calibration_batches < 1:
        raise ExportError(f"--calibration-batches must be >= 1, got {args.calibration_batches}", EXIT_USAGE)
    options = _autocast_options(args)
    try:
        AutocastConfig(**options)  # a bad regex or op name fails now, before any loading
    except (TypeError, ValueError) as e:
        raise ExportError(str(e), EXIT_USAGE) from None
    source = find_source(args.source)
    recipe, overrides = split_recipe(args.recipe, list(args.overrides))
    cfg, config_desc = load_config(source, recipe, overrides)
    if formats is None:
        formats = config_formats(cfg)
        check_formats(formats)
    ckpt = load_checkpoint(source.checkpoint)
    model, stage = rebuild_model(cfg, ckpt, source.checkpoint, config_desc)
    example, calibration, validation = data_batches(cfg, args.calibration_batches, args.split)
    described = (f"{source.checkpoint} (stage {stage!r}, epoch {ckpt.get('epoch')}, step {ckpt.get('global_step')}); "
                 f"config: {config_desc}")
    result = None
    if "pt2" in formats:
        result = export_mixed_precision(model, (example,), calibration_data=calibration,
                                        validation_data=validation, **options)
        result.info.update(source=described, validation_split=args.split)
    if args.out is not None:
        out = args.out
    else:
        # RUN_DIR/export for a run directory (what training wrote at its end, from the same last.ckpt); a
        # checkpoint named by its path gets its own directory, so the export of another checkpoint (a "best"
        # one from the fake-quant stage) never replaces the run's. An existing default is not overwritten.
        given_dir = Path(args.source).is_dir()
        out = (source.run_dir / "export" if given_dir and source.run_dir is not None
               else source.checkpoint.parent / f"{source.checkpoint.stem}-export")
        if out.exists() and not given_dir:
            raise ExportError(f"{out} exists (an earlier export of {source.checkpoint.name}): pass --out DIR to "
                              "write elsewhere, or --out that directory to replace it", EXIT_USAGE)
    deploy = [f for f in formats if f != "pt2"]
    try:  # every format exported before the first file is written; each file is written atomically
        results = export_deploy(model, example, out, deploy, calibration, validation, options, args.max_batch,
                                described, args.split) if deploy else {}
        paths = result.save(out, compress=not args.no_compress, aoti=args.aoti) if result is not None else {}
    except OSError as e:
        raise ExportError(f"cannot write the export into {out}: {e}") from None
    pte = results.get("pte")
    if pte is not None:
        paths.update({p.name: p for p in (pte.path, pte.path.with_name("model_report.md"))})
    for fmt in [f for f in deploy if f.startswith("onnx")]:
        paths.update({p.name: p for p in (results[fmt].path, _onnx_report(results[fmt].path))})

    print(f"intqat-export: wrote {out}")
    if result is not None:
        v = result.validation
        print(f"  model.pt2    {paths['model.pt2'].stat().st_size / 1024:.1f} KiB; nodes "
              + ", ".join(f"{n} {p}" for p, n in sorted(result.report.counts().items())))
        print(f"  error        max abs {v['max_abs_error']:.4g}, mean abs {v['mean_abs_error']:.4g} "
              f"(vs the fp32 program, {v['samples']} {args.split} samples)")
        if "accuracy" in v:
            print(f"  accuracy     {100 * v['accuracy']:.2f}% (fp32 program {100 * v['accuracy_reference']:.2f}%)")
        if "model.aoti.pt2" in paths:
            print(f"  model.aoti.pt2 {paths['model.aoti.pt2'].stat().st_size / 1024:.1f} KiB (AOTInductor, this CPU; "
                  "load with torch._inductor.aoti_load_package)")
        print(f"  report       {paths['report.md']}")
    if pte is not None:
        print_pte_summary(pte, paths, args.split)
    for fmt in [f for f in deploy if f.startswith("onnx")]:
        print_onnx_summary(results[fmt], paths)
    return out


def _onnx_report(path: Path) -> Path:
    return path.with_name(f"{path.name.replace('.', '_')}_report.md")  # (OnnxResult.save's name)


def print_onnx_summary(result, paths: dict) -> None:
    name = result.path.name
    print(f"  {name:<12} {paths[name].stat().st_size / 1024:.1f} KiB (ONNX, onnxruntime); " + result.lines()[0])
    for line in result.lines()[1:]:
        print(f"  {'':<12} {line}")
    print(f"  report       {paths[_onnx_report(result.path).name]}")


def export_deploy(model, example, out: Path, formats: list[str], calibration, validation, options: dict,
                  max_batch: int, described: str, split: str) -> dict:
    """The deploy formats (intqat.deploy.formats), their float regions under the same autocast options as
    model.pt2; a model a format cannot be made of is an ExportError naming why, and nothing is written."""
    from intqat.deploy.formats import export_deploy_formats

    try:
        return export_deploy_formats(model, (example,), out, formats, calibration_data=calibration,
                                     validation_data=validation, max_batch=max_batch,
                                     info={"source": described, "validation_split": split}, **options)
    except ValueError as e:
        raise ExportError(f"cannot export {', '.join(formats)}: {e}") from None


def print_pte_summary(pte, paths: dict, split: str) -> None:
    v = pte.validation
    where = {}
    for c in pte.census:
        where[c.where] = where.get(c.where, 0) + 1
    print(f"  model.pte    {paths['model.pte'].stat().st_size / 1024:.1f} KiB (ExecuTorch, XNNPACK); integer layers: "
          + ", ".join(f"{n} {w}" for w, n in where.items()))
    line = (f"  vs integer   top-1 agreement {100 * v['top1_agreement']:.2f}%, max |diff| {v['max_abs_diff']:.4g} "
            f"({v['max_diff_in_steps']:.3g} output steps) on {v['samples']} {split} samples")
    print(line)
    if "perplexity" in v:
        print(f"  perplexity   {v['perplexity']:.4f} (integer model {v['perplexity_integer']:.4f}, "
              f"{100 * v['perplexity_change']:+.3f}%)")
    if pte.size:
        print(f"  vs fp32 .pte size {pte.size['ratio']:.3f}x; latency "
              + ", ".join(f"batch {b}: {t['ratio']:.3f}x" for b, t in pte.latency.get("per_batch", {}).items()))
    print(f"  report       {paths['model_report.md']}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_intermixed_args(argv)
    try:
        run(args)
    except ExportError as e:
        print(f"intqat-export: error: {e}", file=sys.stderr)
        sys.exit(e.code)


if __name__ == "__main__":
    main()
