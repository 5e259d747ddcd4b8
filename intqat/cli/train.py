"""intqat-train: train a recipe (recipes/*.yaml) and write everything under one output directory.

    intqat-train                                        # the default recipe, mlp_digits_w8a8
    intqat-train recipe=cnn_digits_w8a8 trainer.max_epochs=5 quant=none output_dir=runs/cnn-fp32
    intqat-train recipe=cifar10_cnn_w8a8 data.data_dir=$HOME/data/cifar-10-batches-py
    intqat-train recipe=my_recipes/mlp_wide.yaml           # your own recipe file, anywhere

Other arguments are Hydra overrides of the recipe (`key=value`, `group=option`, `+new_key=value`).
The run: seed, build datamodule, module (with its model), callbacks (conf/callbacks/ and, when
`quant` has a _target_, the IntQAT callback), CSVLogger and Trainer; fit; test the held-out split
on the best or last checkpoint (`test_ckpt`); write report.md and curves.png next to metrics.csv.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
from pathlib import Path

DEFAULT_RECIPE = "mlp_digits_w8a8"
EXIT_USAGE = 2  # a wrong command line, as argparse does


def recipes_dir() -> Path:
    # recipes/ is installed as the package intqat.recipes (editable or not): ask the import system
    return Path(importlib.import_module("intqat.recipes").__path__[0])


def conf_dir() -> Path:
    return Path(importlib.import_module("intqat.conf").__path__[0])


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def recipe_location(recipe: str) -> tuple[Path, str]:
    """(directory, config name) of a recipe: a name of intqat's recipes, or the path of your own .yaml file
    (anywhere; it pulls conf/ as intqat's do, with `hydra: searchpath: [pkg://intqat.conf]`)."""
    if recipe.endswith((".yaml", ".yml")):
        path = Path(recipe).expanduser().resolve()
        return path.parent, path.stem
    return recipes_dir(), recipe


def _usage_error(message: str) -> None:
    print(f"intqat-train: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


# -- checking the command line before Hydra runs --------------------------------------------------
def _compose(recipe: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    where, name = recipe_location(recipe)
    with initialize_config_dir(config_dir=str(where), version_base="1.3", job_name="intqat_check"):
        return compose(config_name=name, overrides=overrides)


def _try_compose(recipe: str, overrides: list[str]):
    try:
        return _compose(recipe, overrides)
    except Exception:  # noqa: BLE001  (any failure means "this set of overrides does not compose")
        return None


def _group_options(group: str) -> list[str] | None:
    d = conf_dir() / group
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else None


def _explain_key(cfg, key: str) -> str | None:
    """'a.b.c' not in cfg: name the deepest node that exists and list its keys (nothing resolved)."""
    from omegaconf import DictConfig, OmegaConf

    node, path = cfg, []
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return f"'{'.'.join(path)}' is a value, not a config node: it has no key '{part}'"
        if part not in node.keys():
            where = f"'{'.'.join(path)}'" if path else "the top level"
            return f"no key '{part}' at {where}; valid keys there: {', '.join(str(k) for k in node.keys())}"
        if OmegaConf.is_interpolation(node, part):
            return None  # ${...}: what it points to decides
        node, path = node._get_node(part), [*path, part]
    return None


def _explain(recipe: str, overrides: list[str], error: Exception) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    detail = str(error).strip().replace("\n", "\n    ")
    lines = [f"cannot compose recipe {recipe!r} with {' '.join(overrides)}", f"  {type(error).__name__}: {detail}"]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001  (the syntax error itself is in `error`)
        return "\n".join(lines)
    for i, ov in enumerate(parsed):
        if ov.is_hydra_override():
            continue
        others = overrides[:i] + overrides[i + 1 :]
        cfg = _try_compose(recipe, others)
        if cfg is None:  # more than one bad override: judge this one against the recipe alone
            cfg = _try_compose(recipe, [])
            if cfg is None or _try_compose(recipe, [overrides[i]]) is not None:
                continue
        key = ov.key_or_group
        options = _group_options(key)
        if options is not None and not ov.is_delete():
            lines.append(f"  '{overrides[i]}': '{key}' is a config group; its options are: {', '.join(options)}")
            continue
        hint = _explain_key(cfg, key)
        if hint is not None:
            lines.append(f"  '{overrides[i]}': {hint}")
            if not (ov.is_add() or ov.is_delete()):
                lines.append("  (to add a new key on purpose, write +key=value)")
    return "\n".join(lines)


def _missing_values(cfg, prefix: str = "") -> list[str]:
    """Keys still set to ??? (without resolving interpolations such as ${hydra:...})."""
    from omegaconf import DictConfig, OmegaConf

    out = []
    for k in cfg.keys():
        if OmegaConf.is_missing(cfg, k):
            out.append(f"{prefix}{k}")
        elif not OmegaConf.is_interpolation(cfg, k) and isinstance(cfg._get_node(k), DictConfig):
            out += _missing_values(cfg._get_node(k), f"{prefix}{k}.")
    return out


def check_command_line(recipe: str, overrides: list[str]) -> str | None:
    """None if the recipe composes with these overrides, else a message saying what to fix."""
    try:
        cfg = _compose(recipe, overrides)
    except Exception as e:  # noqa: BLE001  (Hydra / OmegaConf raise several types: all are reported)
        return _explain(recipe, overrides, e)
    missing = _missing_values(cfg)
    if missing:
        return (
            f"recipe {recipe!r} needs " + ", ".join(f"{k}=..." for k in missing) + " on the command line "
            f"(see the comments in {Path(recipe_location(recipe)[0]) / (recipe_location(recipe)[1] + '.yaml')})"
        )
    resume = cfg.get("ckpt_path")
    if resume is not None and not Path(str(resume)).expanduser().is_file():
        return f"ckpt_path={resume}: no such checkpoint file (resume from e.g. runs/<recipe>/<time>/checkpoints/last.ckpt)"
    return None


# -- the run ------------------------------------------------------------------------------------------
def _qat_enabled(quant_cfg) -> bool:
    return quant_cfg is not None and "_target_" in quant_cfg


def _schedule(quant_cfg) -> str:
    stages = ", ".join(f"{k[:-3]} at {quant_cfg[k]}" for k in quant_cfg if k.endswith("_at") and quant_cfg[k] is not None)
    return f"{quant_cfg.get('config')}; {quant_cfg.get('unit')}s: {stages}"


def _checkpoints(trainer) -> tuple[str | None, str | None]:
    """(best, last) checkpoint paths: of the ModelCheckpoint with a monitor, of the one without."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    cbs = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    best = next((cb.best_model_path for cb in cbs if cb.monitor is not None and cb.best_model_path), None)
    # without a monitor, a ModelCheckpoint's "best" is the newest checkpoint it wrote
    last = next((cb.best_model_path for cb in cbs if cb.monitor is None and cb.best_model_path), None)
    return best, last or next((cb.last_model_path for cb in cbs if cb.last_model_path), None)


def _test_checkpoint(trainer, choice: str, qat: bool) -> tuple[str | None, str]:
    """(ckpt_path for trainer.test, what it is)."""
    if choice not in ("auto", "best", "last"):
        raise ValueError(f"test_ckpt={choice!r}: use best, last or auto")
    if choice == "auto":
        choice = "last" if qat else "best"
    best, last = _checkpoints(trainer)
    if choice == "best" and best:
        return best, "best checkpoint"
    if last:
        return last, "last checkpoint" + ("" if choice == "last" else " (no monitored checkpoint)")
    return None, "the weights at the end of training (no checkpoint saved)"


def train(cfg, recipe: str, argv: list[str]) -> dict:
    """Run one composed recipe (inside Hydra); returns the paths and numbers it produced."""
    import lightning as L
    import torch
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities import rank_zero_info
    from omegaconf import OmegaConf

    from intqat.training.report import write_report

    out = Path(HydraConfig.get().runtime.output_dir).resolve()
    cfg.output_dir = str(out)  # pin ${now:...}: every ${output_dir} is this directory from here on
    # DDP: Lightning relaunches this very command line for the other ranks; same recipe, same directory
    sys.argv = [sys.argv[0], f"recipe={recipe}", *(a for a in argv if not a.startswith("output_dir=")), f"output_dir={out}"]

    if cfg.get("num_threads"):
        torch.set_num_threads(cfg.num_threads)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.module)
    callbacks = []
    qat = _qat_enabled(cfg.get("quant"))
    qat_callback = instantiate(cfg.quant) if qat else None
    if qat_callback is not None:
        callbacks.append(qat_callback)
    elif cfg.get("export") and cfg.export.get("enabled"):
        rank_zero_info("intqat-train: export is enabled but quant has no IntQAT callback: nothing will be exported")
    for name, cb_cfg in (cfg.get("callbacks") or {}).items():
        if cb_cfg is not None:  # callbacks.<name>=null drops one
            callbacks.append(instantiate(cb_cfg))
    # metrics.csv and hparams.yaml directly in out; the logger only ever replaces its own files there
    warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
    logger = CSVLogger(save_dir=out, name="", version="")
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger)

    resume = None if cfg.get("ckpt_path") is None else str(Path(str(cfg.ckpt_path)).expanduser())
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    fit_seconds = time.perf_counter() - start
    ckpt_path, tested = _test_checkpoint(trainer, cfg.test_ckpt, qat)
    results = trainer.test(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
    wall = time.perf_counter() - start

    summary = {"output_dir": out, "wall_seconds": wall, "test_ckpt": ckpt_path, "test": results[0] if results else {}}
    if not trainer.is_global_zero:
        return summary
    best, last = _checkpoints(trainer)
    export = cfg.get("export") or {}
    export_dir = Path(export["dir"]) if qat and export.get("enabled") and export.get("dir") else None
    rows = {
        "recipe": recipe,
        "command": "intqat-train " + " ".join([f"recipe={recipe}", *argv]),
        "output dir": str(out),
        "tested on": f"{tested}: {ckpt_path}" if ckpt_path else tested,
        "quantization": _schedule(cfg.quant) if qat else "none (fp32)",
        "wall time": f"{wall:.1f} s (fit {fit_seconds:.1f} s)",
        "devices": f"{trainer.num_devices} x {trainer.strategy.root_device.type} ({type(trainer.strategy).__name__})",
    }
    for cb in callbacks:  # figures a callback computed (e.g. LMQuantReport's perplexities)
        rows.update(getattr(cb, "report_rows", None) or {})
    if best:
        rows["best checkpoint"] = best
    if last:
        rows["last checkpoint"] = last
    if export_dir is not None:
        written = sorted(p.name for p in export_dir.iterdir()) if export_dir.is_dir() else []
        rows["export"] = f"{export_dir} ({', '.join(written)})" if written else f"{export_dir} (not written)"
    paths = write_report(out, metrics_csv=Path(logger.log_dir) / "metrics.csv", title=f"intqat run: {recipe}",
                         summary=rows, config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
                         boundaries=getattr(qat_callback, "boundaries", None))
    summary.update(paths)

    acc = summary["test"].get("test/acc")
    print(f"\nintqat-train: {recipe} finished in {wall:.1f} s" + (f", test accuracy {acc:.4f}" if acc is not None else ""))
    print(f"  output dir   {out}")
    print(f"  report       {paths['report']}")
    print(f"  curves       {paths['curves']}")
    print(f"  metrics      {Path(logger.log_dir) / 'metrics.csv'}")
    if best or last:
        print(f"  checkpoints  {Path(last or best).parent}")
    if export_dir is not None:
        print(f"  export       {export_dir}")
    return summary


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipes = [a.split("=", 1)[1] for a in argv if a.startswith("recipe=")]
    argv = [a for a in argv if not a.startswith("recipe=")]
    if len(recipes) > 1:
        _usage_error(f"recipe= given {len(recipes)} times ({', '.join(recipes)}); give it once")
    recipe = recipes[0] if recipes else DEFAULT_RECIPE
    available = available_recipes()
    if recipe.endswith((".yaml", ".yml")):
        if not Path(recipe).expanduser().is_file():
            _usage_error(f"recipe file {recipe} does not exist")
    elif recipe not in available:
        _usage_error(f"unknown recipe {recipe!r}; available recipes: {', '.join(available)} (in {recipes_dir()}), "
                     "or the path of your own recipe file (recipe=path/to/my_recipe.yaml)")

    # Hydra's flags (--help, --cfg job, ...) go straight to Hydra; plain overrides are checked here,
    # where the message can say which keys exist.
    if not any(a.startswith("-") for a in argv) and os.environ.get("LOCAL_RANK", "0") == "0":
        problem = check_command_line(recipe, argv)
        if problem:
            _usage_error(problem)

    import hydra

    def task(cfg) -> None:
        train(cfg, recipe, argv)

    sys.argv = [sys.argv[0], *argv]  # what hydra.main parses
    where, name = recipe_location(recipe)
    hydra.main(version_base="1.3", config_path=str(where), config_name=name)(task)()


if __name__ == "__main__":
    main()
