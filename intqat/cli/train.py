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

import os
import sys
import time
import warnings
from pathlib import Path

from intqat.compose import (  # noqa: F401  (re-exported: intqat.cli.train's names before intqat.compose existed)
    DEFAULT_RECIPE,
    RecipeError,
    available_recipes,
    check_command_line,
    conf_dir,
    find_recipe,
    recipe_location,
    recipes_dir,
)

EXIT_USAGE = 2  # a wrong command line, as argparse does


def _usage_error(message: str) -> None:
    print(f"intqat-train: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


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
    try:
        find_recipe(recipe)
    except RecipeError as e:
        _usage_error(f"{e} (recipe=path/to/my_recipe.yaml)")

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
