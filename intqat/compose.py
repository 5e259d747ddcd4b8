"""Recipes: where they are and how their config is composed, the one way intqat-train, intqat-export,
intqat-graphs and intqat-bench do it.

    from intqat.compose import compose
    cfg = compose("mlp_digits_w8a8", ["trainer.max_epochs=2"])   # or compose("path/to/my_recipe.yaml", [...])

A recipe is a name of recipes/*.yaml (installed as intqat.recipes) or the path of your own .yaml file,
which finds conf/'s groups through `hydra: searchpath: [pkg://intqat.conf]`. Bad input raises RecipeError
whose message names the unknown recipe, key or group option and lists what exists.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__all__ = ["RecipeError", "recipes_dir", "conf_dir", "available_recipes", "recipe_location", "find_recipe", "compose",
           "check_command_line", "run_config", "apply_overrides", "DEFAULT_RECIPE"]

DEFAULT_RECIPE = "mlp_digits_w8a8"


class RecipeError(ValueError):
    """A recipe that cannot be found or composed; the message says what to fix."""


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


# -- composing ---------------------------------------------------------------------------------------
def _compose(recipe: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    where, name = recipe_location(recipe)
    with initialize_config_dir(config_dir=str(where), version_base="1.3", job_name="intqat"):
        return hydra_compose(config_name=name, overrides=overrides)


def find_recipe(recipe: str) -> None:
    """Raise RecipeError unless `recipe` names one of intqat's recipes or an existing .yaml file."""
    if recipe.endswith((".yaml", ".yml")):
        if not Path(recipe).expanduser().is_file():
            raise RecipeError(f"recipe file {recipe} does not exist")
        return
    available = available_recipes()
    if recipe not in available:
        raise RecipeError(f"unknown recipe {recipe!r}; available recipes: {', '.join(available)} (in {recipes_dir()}), "
                          "or the path of your own recipe file")


def compose(recipe: str, overrides: list[str] = ()):
    """The recipe's config composed with Hydra overrides (`key=value`, `group=option`, `+new=value`), as
    intqat-train runs it; RecipeError with what to fix (an unknown recipe, key or group option) otherwise."""
    overrides = list(overrides)
    find_recipe(recipe)
    try:
        return _compose(recipe, overrides)
    except Exception as e:  # noqa: BLE001  (Hydra / OmegaConf raise several types: all are explained)
        raise RecipeError(_explain(recipe, overrides, e)) from None


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
    """None if the recipe composes with these overrides and needs nothing more to run, else what to fix."""
    try:
        cfg = compose(recipe, overrides)
    except RecipeError as e:
        return str(e)
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


# -- a run's own config ------------------------------------------------------------------------------
def run_config(path: Path):
    """(config, its file) a run saved next to its checkpoints (<output_dir>/.hydra/config.yaml), for a
    checkpoint or a run directory; (None, None) when there is none."""
    from omegaconf import OmegaConf

    path = Path(path).resolve()
    for parent in [path, *list(path.parents)[:3]]:
        candidate = parent / ".hydra" / "config.yaml"
        if candidate.is_file():
            return OmegaConf.load(candidate), candidate
    return None, None


def apply_overrides(cfg, overrides: list[str]):
    """Dotted `key=value` (`+key=value` adds a key) applied to an already composed config (a run's saved one)."""
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
