"""Configs, recipes, data modules and the intqat-train command line.

Every option of every config group and every recipe is composed and instantiated; the CLI is run
as a subprocess for its runs (one short fp32 run, one short QAT run and its resumption, a recipe file of your
own); its usage errors (exit status 2) are checked in this process.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from sklearn.datasets import load_digits
from torch import nn

import intqat
from intqat.cli import train as train_cli
from intqat.cli.train import available_recipes, conf_dir, recipes_dir
from intqat.data import Cifar10DataModule, DigitsDataModule
from intqat.data.cifar10 import CIFAR10_MEAN, CIFAR10_STD
from intqat.data.digits import split_indices
from intqat.models import MLP, Cifar10CNN, SmallCNN
from intqat.registry import FAKE_QUANT_TYPES, INTEGER_TYPES
from intqat.training import ClassificationModule

GROUPS = ("model", "data", "quant", "trainer", "callbacks", "export")
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((conf_dir() / g).glob("*.yaml"))]
RECIPES = available_recipes()


def _kinds(module: nn.Module) -> set[str]:
    quantized = [m for m in module.modules() if isinstance(m, FAKE_QUANT_TYPES + INTEGER_TYPES)]
    return {"integer" if isinstance(m, INTEGER_TYPES) else "fake" for m in quantized}


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    """Six CIFAR-10 batch files in the standard pickle format, 20 images each, 2 per class."""
    root = tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (20, 3072), dtype=np.uint8), b"labels": [i % 10 for i in range(20)]}
        with open(root / name, "wb") as f:
            pickle.dump(batch, f)
    return root


def _compose_train(overrides: list[str]):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _compose_recipe(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _input_for(model_cfg) -> torch.Tensor:
    return torch.rand(2, 3, 32, 32) if "Cifar10" in model_cfg._target_ else torch.rand(2, 1, 8, 8)


# -- config groups and recipes -------------------------------------------------------------------
def test_every_group_has_options():
    assert {g for g, _ in OPTIONS} == set(GROUPS)
    assert {"mlp_digits_w8a8", "cnn_digits_w8a8", "mlp_digits_w4a8", "cifar10_cnn_w8a8"} <= set(RECIPES)


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_group_option_instantiates(group, option, tmp_path, cifar_dir):
    overrides = [f"{group}={option}", f"output_dir={tmp_path}"]
    if (group, option) == ("data", "cifar10"):
        overrides.append(f"data.data_dir={cifar_dir}")
    cfg = _compose_train(overrides)
    node = cfg[group]
    if group == "model" and node._target_ == "intqat.models.GPT":  # tokens in, per-token logits out
        logits = instantiate(node)(torch.randint(0, node.vocab_size, (2, 16)))
        assert logits.shape == (2, 16, node.vocab_size)
    elif group == "model":
        model = instantiate(node)
        logits, features = model(x=_input_for(node), return_features=True)  # keyword forward
        assert logits.shape == (2, node.num_classes) and features.shape[0] == 2
    elif group == "data":
        dm = instantiate(node)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))
        if hasattr(dm, "vocab_size"):  # text: byte windows, y = x shifted by one
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and torch.equal(x[:, 1:], y[:, :-1])
        else:
            assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape[1:] == dm.dims
    elif group == "quant":
        if "_target_" not in node:
            assert option == "none"
            return
        assert intqat.resolve_config(node.config) == intqat.QuantConfig.from_preset(option)
        cb = instantiate(node)
        assert isinstance(cb, intqat.IntQAT) and not cb.export_on_fit_end
    elif group == "trainer":
        trainer = instantiate(node, logger=False, enable_checkpointing=False)
        assert trainer.max_epochs == node.max_epochs and trainer.num_devices == node.devices
    elif group == "callbacks":
        callbacks = [instantiate(c) for c in node.values() if c is not None]
        assert all(hasattr(c, "state_dict") for c in callbacks)
    elif group == "export":
        assert set(node) == {"enabled", "dir", "fn", "formats"}
        from intqat.deploy.formats import parse_formats

        assert parse_formats(list(node.formats)) == ["pt2"]  # the default: nothing changes for current users
        if node.enabled:
            qat = instantiate(_compose_train([f"export={option}", "quant=w8a8", f"output_dir={tmp_path}"]).quant)
            assert qat.export_on_fit_end and callable(qat.export_fn) and str(qat.export_dir).startswith(str(tmp_path))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_instantiates(recipe, tmp_path, cifar_dir):
    text = (recipes_dir() / f"{recipe}.yaml").read_text()
    assert text.startswith("#") and f"recipe={recipe}" in text  # the launch command comes first
    for section in ("# Model", "# Data", "# Quantization", "# Trainer"):
        assert section in text, f"{recipe}.yaml lacks its {section} section"
    for line in text.splitlines():  # a comment on every knob
        code = line.split("#")[0]
        if ":" in code and code.split(":", 1)[1].strip() and not code.startswith("  - "):
            assert "#" in line, f"{recipe}.yaml: no comment on {line.strip()!r}"
    overrides = [f"output_dir={tmp_path}"] + ([f"data.data_dir={cifar_dir}"] if "cifar10" in recipe else [])
    cfg = _compose_recipe(recipe, overrides)
    qat = instantiate(cfg.quant)
    assert isinstance(qat, intqat.IntQAT) and qat.boundaries == {}
    dm = instantiate(cfg.data)
    module = instantiate(cfg.module)
    assert isinstance(module, ClassificationModule) and module.hparams.model["_target_"] == cfg.model._target_
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=False)
    assert trainer.max_epochs == cfg.trainer.max_epochs
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert module(x).shape == ((len(y), 10) if y.dim() == 1 else (*y.shape, cfg.module.num_classes))


# -- command line ----------------------------------------------------------------------------------
def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "intqat.cli.train", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=180)


def _usage_error(capsys, *args: str) -> str:
    """intqat-train's command line checked in this process (it exits before Hydra and Lightning start): exit
    status 2 (EXIT_USAGE) -> what it printed to stderr. The console script's own start: tests/test_install.py."""
    with pytest.raises(SystemExit) as exited:
        train_cli.main(list(args))
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_unknown_recipe_lists_recipes(capsys):
    err = _usage_error(capsys, "recipe=mlp_digit_w8a8")
    assert "unknown recipe 'mlp_digit_w8a8'" in err
    assert all(name in err for name in RECIPES)


def test_typo_key_lists_valid_keys(capsys):
    err = _usage_error(capsys, "trainer.max_epoch=1", "model=mlpp")
    assert "no key 'max_epoch' at 'trainer'" in err and "max_epochs" in err
    assert "'model' is a config group; its options are: cifar10_cnn, cnn, gpt, mlp" in err


def test_fp32_run_writes_everything(tmp_path):
    out = tmp_path / "run"
    r = _cli("trainer.max_epochs=1", "quant=none", "callbacks.lr_monitor=null", "trainer.enable_progress_bar=false",
             f"output_dir={out}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("metrics.csv", "report.md", "curves.png", "hparams.yaml", "checkpoints/last.ckpt", ".hydra/config.yaml"):
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    report = (out / "report.md").read_text()
    assert "test accuracy" in report and "none (fp32)" in report
    assert str(out) in r.stdout
    # the checkpoint carries the model's config: it loads without the model being passed again
    module = ClassificationModule.load_from_checkpoint(out / "checkpoints" / "last.ckpt")
    assert isinstance(module.model, MLP) and _kinds(module) == set()


# A short QAT run: fake quant from epoch 0, integer from epoch 1, 3 steps an epoch. One run (module scope)
# serves the report test and the resume test, which continues it.
QAT_RUN = ["recipe=mlp_digits_w8a8", "quant.prepare_at=0", "quant.freeze_bn_at=null", "quant.freeze_observers_at=1",
           "quant.integer_at=1", "export=none", "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=2",
           "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qat") / "run"
    r = _cli(*QAT_RUN, "trainer.max_epochs=2", f"output_dir={out}", cwd=out.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_qat_run_reports_stages_and_tests_the_integer_model(qat_run):
    report = (qat_run / "report.md").read_text()
    assert "| fake-quant | 0.00 | 0 |" in report and "| observers frozen + integer | 1.00 | 3 |" in report
    assert "last checkpoint" in report  # test_ckpt=auto: the integer model is the one tested
    module = ClassificationModule.load_from_checkpoint(qat_run / "checkpoints" / "last.ckpt")
    assert _kinds(module) == {"integer"}


# -- data ------------------------------------------------------------------------------------------
def test_digits_split_is_seeded_stratified_and_complete():
    a, b, c = DigitsDataModule(seed=0), DigitsDataModule(seed=0), DigitsDataModule(seed=1)
    for dm in (a, b, c):
        dm.setup()
    sets = lambda dm: (dm.train_set, dm.val_set, dm.test_set)  # noqa: E731
    assert sum(len(s) for s in sets(a)) == 1797
    assert [len(s) for s in sets(a)] == [1257, 270, 270]
    for sa, sb in zip(sets(a), sets(b)):
        torch.testing.assert_close(sa.tensors[0], sb.tensors[0], atol=0, rtol=0)
    assert not torch.equal(a.test_set.tensors[1], c.test_set.tensors[1])
    x = a.train_set.tensors[0]
    assert x.shape[1:] == (1, 8, 8) and x.dtype == torch.float32 and x.min() == 0 and x.max() == 1
    # stratified: every class is in each split in proportion (within rounding, from two splits)
    all_counts = torch.bincount(torch.cat([s.tensors[1] for s in sets(a)]), minlength=10).float()
    for s, frac in zip(sets(a), (1257 / 1797, 0.15, 0.15)):
        counts = torch.bincount(s.tensors[1], minlength=10).float()
        assert (counts - frac * all_counts).abs().max() <= 1.5
    train, val, test = (set(i.tolist()) for i in split_indices(load_digits().target, 0.15, 0.15, seed=0))
    assert not (train & val or train & test or val & test) and len(train | val | test) == 1797
    xb, _ = next(iter(a.train_dataloader()))
    xb2, _ = next(iter(b.train_dataloader()))
    torch.testing.assert_close(xb, xb2, atol=0, rtol=0)  # the shuffling order depends on the seed only


def test_cifar10_reads_local_batches(cifar_dir):
    for data_dir in (cifar_dir, cifar_dir.parent):  # the batch dir or the directory it was extracted in
        dm = Cifar10DataModule(data_dir=str(data_dir), batch_size=8, val_fraction=0.2, augment=False)
        dm.setup()
        assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (80, 20, 20)
        assert torch.bincount(torch.stack([dm.val_set[i][1] for i in range(20)]), minlength=10).tolist() == [2] * 10
    x, y = next(iter(dm.test_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    with open(cifar_dir / "test_batch", "rb") as f:
        raw = pickle.load(f)[b"data"][0].reshape(3, 32, 32)
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    expected = (torch.from_numpy(raw).float() / 255 - mean) / std
    torch.testing.assert_close(x[0], expected)


def test_cifar10_missing_data_says_where_and_how(tmp_path, cifar_dir):
    with pytest.raises(FileNotFoundError, match=r"does not exist.*cifar-10-python\.tar\.gz"):
        Cifar10DataModule(data_dir=str(tmp_path / "nowhere")).setup()
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "data_batch_1").write_bytes((cifar_dir / "data_batch_1").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"data_batch_2.*test_batch.*partial"):
        Cifar10DataModule(data_dir=str(partial)).setup()


# -- models and the LightningModule ------------------------------------------------------------------
@pytest.mark.parametrize("model,n_convs", [(SmallCNN(), 2), (Cifar10CNN(), 6)], ids=["SmallCNN", "Cifar10CNN"])
def test_every_batchnorm_folds_into_its_conv(model, n_convs):
    quantized = intqat.quantized_modules(intqat.prepare_qat(model)).values()
    folded = {id(q.bn) for q in quantized if getattr(q, "bn", None) is not None}
    assert len(folded) == n_convs
    assert all(id(m) in folded for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_checkpoint_restores_the_quantization_stage():
    module = ClassificationModule({"_target_": "intqat.models.MLP", "hidden": [16]}, scheduler=None)
    intqat.prepare_qat(module.model, "w8a8")
    module.train()
    module.model(torch.rand(4, 1, 8, 8))  # observers see one batch
    intqat.to_integer(module.model)
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)

    fresh = ClassificationModule(**module.hparams)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"])  # strict: the swapped modules fit the keys
    assert _kinds(fresh) == {"integer"}
    module.eval(), fresh.eval()
    x = torch.rand(5, 1, 8, 8)
    torch.testing.assert_close(fresh(x), module(x), atol=0, rtol=0)

    # and back: a float checkpoint into the integer model rebuilds it from its config
    float_module = ClassificationModule(**module.hparams)
    float_ckpt = {"state_dict": float_module.state_dict()}
    float_module.on_save_checkpoint(float_ckpt)
    fresh.on_load_checkpoint(float_ckpt)
    fresh.load_state_dict(float_ckpt["state_dict"])
    assert _kinds(fresh) == set()


@pytest.mark.parametrize("group", ["w8a8", "w8a8_dynamic", "w4a8", "8da4w"])
def test_adding_a_field_to_a_quant_group_keeps_its_preset(group):
    """`quant=<group> +quant.config.weight.bits=N` changes one field of that group's preset: the groups name
    their preset inside the config ({preset: ...}); a bare preset name was replaced by the dict, which then
    silently fell back to w8a8 (w8a8_dynamic trained with static activations)."""
    from intqat.compose import compose as _compose
    from intqat.config import resolve_config

    cfg = _compose("mlp_digits_w8a8", [f"quant={group}", "+quant.config.weight.bits=3"])
    got = resolve_config(dict(cfg.quant.config))
    want = intqat.PRESETS[group]
    assert got.weight.bits == 3 and got.activation == want.activation
    assert got.weight.granularity == want.weight.granularity and got.weight.group_size == want.weight.group_size
    assert resolve_config(dict(_compose("mlp_digits_w8a8", [f"quant={group}"]).quant.config)) == want


def test_ckpt_path_resumes_a_run_where_it_stopped(qat_run, tmp_path, capsys):
    """`intqat-train ... ckpt_path=<run>/checkpoints/last.ckpt` continues that run (it was silently ignored as
    `+ckpt_path`); a path that is no file is a usage error naming it."""
    last = qat_run / "checkpoints" / "last.ckpt"
    second = _cli(*QAT_RUN, "trainer.max_epochs=3", f"ckpt_path={last}", f"output_dir={tmp_path / 'b'}")
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["epoch"] == 2 and resumed["global_step"] == 9  # 2 epochs of 3 steps before, 1 more here
    import csv

    with open(tmp_path / "b" / "metrics.csv") as f:
        epochs = {int(float(row["epoch"])) for row in csv.DictReader(f) if row.get("epoch")}
    assert 2 in epochs and not epochs & {0, 1}  # it started where the first run stopped (3: the test split)
    assert "nope.ckpt: no such checkpoint file" in _usage_error(capsys, "recipe=mlp_digits_w8a8",
                                                                 f"ckpt_path={tmp_path / 'nope.ckpt'}")


def test_a_recipe_file_of_your_own_trains(tmp_path, capsys):
    """recipe=path/to/my.yaml: a recipe outside the installed package (after `pip install`, recipes/ is in
    site-packages) composes with intqat's conf/ groups and trains; a missing file is a usage error."""
    own = tmp_path / "my_recipes" / "mlp_wide.yaml"
    own.parent.mkdir()
    text = (recipes_dir() / "mlp_digits_w8a8.yaml").read_text()
    assert "  hidden: [128, 128]" in text
    own.write_text(text.replace("  hidden: [128, 128]", "  hidden: [96, 96]", 1))
    r = _cli(f"recipe={own}", "trainer.max_epochs=1", "quant=none", "export=none", "+trainer.limit_train_batches=2",
             "+trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", f"output_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-2000:]
    saved = (tmp_path / "run" / ".hydra" / "config.yaml").read_text()
    assert "- 96" in saved
    assert "nope.yaml does not exist" in _usage_error(capsys, f"recipe={tmp_path / 'nope.yaml'}")
