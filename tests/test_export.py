"""intqat.export_mixed_precision, the atomic save, model.pt2 in a Python without intqat, and
intqat-export on checkpoints.

Everything is real: models trained a few steps through intqat.prepare_qat / to_integer (and the
IntQAT callback for the checkpoints), real torch.export, real files. Numeric intent: the export
of integer layers is exact (torch.equal); the mixed-precision program is lossy and its error is
reported, not asserted small.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

import intqat
from intqat.cli import export as cli
from intqat.data import DigitsDataModule
from intqat.export import OUTPUT_FILES, export_fn_for_callback, export_mixed_precision, validate
from intqat.nn import DeployedIntConv2d, DeployedIntLinear, IntConv2d, IntLinear
from intqat.training import ClassificationModule

RECIPE = "mlp_digits_w8a8"


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for i in range(steps):
        idx = torch.arange(i * 32, i * 32 + 32) % len(x)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


def _qat(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """fp32 -> fake quant -> integer, a few steps each."""
    _train(model, x, y, 4)
    intqat.prepare_qat(model, "w8a8")
    _train(model, x, y, 4)
    intqat.to_integer(model)
    _train(model, x, y, 4)
    return model


@pytest.fixture(scope="module")
def digits():
    dm = DigitsDataModule(batch_size=64, seed=0)
    dm.setup()
    return dm


@pytest.fixture(scope="module")
def conv_mlp(digits):
    """A conv block (Conv2d + BN folded -> IntConv2d) then an MLP (two IntLinear): one export
    covers both integer layer types. Returns (model in train mode, result)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10),
    )
    x, y = digits.train_set.tensors
    _qat(model, x, y)
    xt, yt = digits.test_set.tensors
    result = export_mixed_precision(model, (x[:2],), calibration_data=[(x[:128],)],
                                    validation_data=[(xt[:128], yt[:128]), (xt[128:], yt[128:])])
    return model, result


# -- export_mixed_precision --------------------------------------------------------------------------


def test_export_converts_integer_layers_and_leaves_the_model_alone(conv_mlp, digits):
    model, result = conv_mlp
    types = [type(m) for m in model.modules()]
    assert IntConv2d in types and IntLinear in types and model.training  # untouched: still training
    assert DeployedIntConv2d not in types and DeployedIntLinear not in types
    ops = {str(n.target) for n in result.program.graph.nodes if n.op == "call_function"}
    assert "aten._int_mm.default" in ops
    assert not any(op.startswith("intqat") for op in ops)
    assert result.info["integer_layers"] == 3 and result.info["dynamic_batch"]
    nodes = result.info["graph_nodes"]  # tidy + constant folding: fewer nodes per call
    assert nodes["tidied"] < nodes["exported"]
    # the batch dimension is dynamic: batch 1 and a full batch run
    for n in (1, 100):
        assert result.program.module()(digits.test_set.tensors[0][:n]).shape == (n, 10)


def test_validation_reports_error_and_accuracy(conv_mlp):
    _, result = conv_mlp
    v = result.validation
    assert v["batches"] == 2 and v["samples"] == 270
    assert 0.0 <= v["mean_abs_error"] <= v["max_abs_error"] < float("inf")
    assert v["reference_equals_integer_model"] is True  # export + tidy are exact
    assert 0.0 <= v["accuracy"] <= 1.0 and 0.0 <= v["accuracy_reference"] <= 1.0
    assert v["accuracy_delta_points"] == pytest.approx(100 * (v["accuracy"] - v["accuracy_reference"]))
    # bf16 ops somewhere, or the error would be 0 by construction
    assert "bf16" in result.report.counts()


def test_reference_program_is_the_integer_model_exactly(conv_mlp, digits):
    model, result = conv_mlp
    x = digits.test_set.tensors[0]
    model.eval()
    try:
        with torch.no_grad():
            assert torch.equal(result.reference.module()(x), model(x))
    finally:
        model.train()


def test_validate_rejects_labels_of_the_wrong_length(conv_mlp, digits):
    _, result = conv_mlp
    x = digits.test_set.tensors[0][:10]
    with pytest.raises(ValueError, match="labels has 3 entries but the validation batches hold 10 samples"):
        validate(result.program, result.reference, [(x,)], 1, labels=[1, 2, 3])


def test_example_inputs_must_be_tensors_or_a_tuple():
    with pytest.raises(TypeError, match=r"export_mixed_precision\(model, \(x\[:2\],\)\)"):
        export_mixed_precision(nn.Linear(2, 2), None)


# -- save ---------------------------------------------------------------------------------------------


def test_save_writes_loadable_program_and_reports(conv_mlp, digits, tmp_path):
    _, result = conv_mlp
    paths = result.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(OUTPUT_FILES)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left
    report = json.loads(paths["report.json"].read_text())
    assert report["validation"]["max_abs_error"] == result.validation["max_abs_error"]
    assert {n["name"] for n in report["autocast"]["nodes"]} == {n.name for n in result.report.nodes}
    assert report["files"]["model.pt2"]["bytes"] == paths["model.pt2"].stat().st_size
    md = paths["report.md"].read_text()
    assert "| name | op | precision | rule |" in md and "| max_abs_error |" in md
    loaded = torch.export.load(paths["model.pt2"])
    x = digits.test_set.tensors[0]
    assert torch.equal(loaded.module()(x), result.program.module()(x))


@pytest.mark.parametrize("where", ["torch.export.save", "report"])
def test_save_is_atomic(conv_mlp, tmp_path, monkeypatch, where):
    _, result = conv_mlp
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    if where == "torch.export.save":
        monkeypatch.setattr(torch.export, "save", boom)
    else:  # model.pt2 already written into the temporary directory
        monkeypatch.setattr(type(result), "to_markdown", boom)
    with pytest.raises(OSError, match="disk full"):
        result.save(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(OSError, match="disk full"):
        result.save(tmp_path / "new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # neither new/ nor a temporary directory


# -- portability: a fresh Python that never imports intqat --------------------------------------------

_NO_INTQAT = r"""
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "intqat" or name.startswith("intqat."):
            raise ImportError("this process must not import intqat")

sys.meta_path.insert(0, _Block())
import torch

for pt2, inputs, out in zip(*[iter(sys.argv[1:])] * 3):
    ep = torch.export.load(pt2)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    spaces = {getattr(t, "namespace", None) for t in targets if isinstance(t, torch._ops.OpOverload)}
    assert spaces <= {"aten"}, spaces  # core aten only: no intqat:: op
    assert torch.ops.aten._int_mm.default in targets
    y = ep.module()(torch.load(inputs))
    torch.save(y, out)
assert "intqat" not in sys.modules
"""


def _run_without_intqat(tmp_path, jobs):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [str(a) for job in jobs for a in job]
    proc = subprocess.run([sys.executable, "-c", _NO_INTQAT, *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_program_runs_without_intqat_and_int_layer_is_exact(conv_mlp, digits, tmp_path):
    torch.manual_seed(0)
    x, y = digits.train_set.tensors
    x = x.flatten(1)
    layer = nn.Sequential(nn.Linear(64, 16))
    intqat.prepare_qat(layer, "w8a8")
    _train(layer, x, y % 16, 3)
    intqat.to_integer(layer)
    _train(layer, x, y % 16, 3)
    assert isinstance(layer[0], IntLinear)
    layer.eval()
    xs = x[:50].clone()
    with torch.no_grad():
        expected = layer(xs)
    single = export_mixed_precision(layer, (x[:2],))
    _, mixed = conv_mlp
    xt = digits.test_set.tensors[0].clone()
    torch.save(xs, tmp_path / "x_linear.pt")
    torch.save(xt, tmp_path / "x_conv.pt")
    single.save(tmp_path / "linear")
    mixed.save(tmp_path / "conv")
    _run_without_intqat(tmp_path, [
        (tmp_path / "linear" / "model.pt2", tmp_path / "x_linear.pt", tmp_path / "y_linear.pt"),
        (tmp_path / "conv" / "model.pt2", tmp_path / "x_conv.pt", tmp_path / "y_conv.pt"),
    ])
    assert torch.equal(torch.load(tmp_path / "y_linear.pt"), expected)  # the integer layer, bit for bit
    assert torch.equal(torch.load(tmp_path / "y_conv.pt"), mixed.program.module()(xt))


# -- intqat-export on checkpoints -----------------------------------------------------------------


def _recipe_config(name: str, overrides=()):
    from hydra import compose, initialize_config_dir

    from intqat.cli.train import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3", job_name="test_export"):
        return compose(config_name=name, overrides=list(overrides))


def _fit_checkpoint(model_cfg: dict, path, export_dir=None) -> None:
    """A few integer-stage steps with the IntQAT callback (integer from step 2), then a checkpoint."""
    torch.manual_seed(0)
    module = ClassificationModule(model_cfg, lr=3e-3, scheduler=None)
    extra = dict(export_on_fit_end=True, export_dir=str(export_dir), export_fn=export_fn_for_callback) if export_dir else {}
    qat = intqat.IntQAT("w8a8", prepare_at=0, freeze_observers_at=2, integer_at=2, unit="step",
                        log_quant_metrics=False, **extra)
    trainer = L.Trainer(max_steps=4, callbacks=[qat], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(path.parent))
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=64, seed=0))
    trainer.save_checkpoint(path)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An intqat-train-like run directory: .hydra/config.yaml + checkpoints/last.ckpt, and the
    export IntQAT wrote at the end of fit through export_fn_for_callback."""
    run = tmp_path_factory.mktemp("run")
    cfg = _recipe_config(RECIPE)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "checkpoints").mkdir()
    _fit_checkpoint(OmegaConf.to_container(cfg.model, resolve=True), run / "checkpoints" / "last.ckpt",
                    export_dir=run / "fit_end_export")
    return run


def test_callback_export_fn_writes_the_export_at_fit_end(run_dir):
    report = json.loads((run_dir / "fit_end_export" / "report.json").read_text())
    assert report["validation"]["samples"] == 270 and "accuracy" in report["validation"]
    assert report["export"]["integer_layers"] == 3


def test_cli_exports_a_run_directory(run_dir, capsys):
    cli.main([str(run_dir)])
    out = run_dir / "export"
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_FILES)
    report = json.loads((out / "report.json").read_text())
    v = report["validation"]
    assert v["reference_equals_integer_model"] is True and "accuracy" in v and v["samples"] == 270
    assert "last.ckpt" in report["export"]["source"] and "'integer'" in report["export"]["source"]
    assert zipfile.is_zipfile(out / "model.pt2")
    assert "intqat-export: wrote" in capsys.readouterr().out


def test_cli_exports_a_named_checkpoint_beside_it_and_never_over_an_earlier_export(run_dir, capsys):
    """A checkpoint given by its path exports to CKPT_STEM-export (it wrote RUN_DIR/export, replacing the run's
    end-of-training export with another checkpoint's); a second run refuses to replace it without --out."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    cli.main([str(ckpt)])
    out = run_dir / "checkpoints" / "last-export"
    assert (out / "model.pt2").is_file()
    before = (out / "report.json").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(ckpt)])
    assert exit_info.value.code != 0 and "last-export exists" in capsys.readouterr().err
    assert (out / "report.json").read_bytes() == before


def test_cli_rejects_a_corrupt_checkpoint(tmp_path, capsys):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(os.urandom(4096))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(bad), "--recipe", RECIPE, "--out", str(out)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert str(bad) in err and "not a PyTorch checkpoint" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_cli_rejects_a_checkpoint_of_another_recipe(tmp_path, capsys):
    ckpt = tmp_path / "cnn.ckpt"
    cnn = OmegaConf.to_container(_recipe_config("cnn_digits_w8a8").model, resolve=True)
    _fit_checkpoint(cnn, ckpt)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(ckpt), f"recipe={RECIPE}", "--out", str(out)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert str(ckpt) in err and f"does not come from recipe {RECIPE}" in err and "SmallCNN" in err
    assert not out.exists()


def test_cli_help_names_the_recipe_and_the_options(capsys):
    """intqat-export --help (here in-process; the installed console script starts: tests/test_install.py)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "recipe=NAME" in out and "--low-precision" in out


def _mlp_config() -> dict:
    return OmegaConf.to_container(_recipe_config(RECIPE).model, resolve=True)


@pytest.mark.parametrize("case, code, message", [
    ("not_lightning", 1, "is not a Lightning checkpoint: no 'state_dict'"),
    ("float_model", 1, "holds a float model (no quantized layer)"),
    ("no_record", 1, "has no quantization record"),
    ("no_config", 2, "cannot tell which recipe"),
    ("unknown_recipe", 2, "unknown recipe 'nope'; available recipes:"),
    ("twice", 2, "recipe given 2 times"),
])
def test_cli_errors_name_the_file_and_the_problem(tmp_path, capsys, case, code, message):
    ckpt = tmp_path / "model.ckpt"
    contents = {"state_dict": {}, "hyper_parameters": {"model": _mlp_config()}, "intqat": {"format": 1, "modules": {}}}
    if case == "not_lightning":
        contents = {"weights": torch.zeros(2)}
    elif case == "no_record":
        del contents["intqat"]
    torch.save(contents, ckpt)
    recipe = {"no_config": [], "unknown_recipe": ["recipe=nope"], "twice": ["recipe=nope", "--recipe", RECIPE]}.get(case, [f"recipe={RECIPE}"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(ckpt), *recipe, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert message in err and (case in ("unknown_recipe", "twice") or str(ckpt) in err)
    assert not (tmp_path / "out").exists()


# -- AOTInductor package ------------------------------------------------------------------------------

_AOTI_NO_INTQAT = """
import sys, torch, torch._inductor
package, x_path, y_path = sys.argv[1:4]
runner = torch._inductor.aoti_load_package(package)
torch.save(runner(torch.load(x_path)), y_path)
assert "intqat" not in sys.modules
"""


def test_cli_aoti_package_equals_the_program_and_runs_without_intqat(run_dir, digits, tmp_path, capsys):
    # intqat-export --aoti: model.aoti.pt2 beside model.pt2, checked equal before it is kept
    out = tmp_path / "aoti-export"
    cli.main([str(run_dir), "--out", str(out), "--aoti"])
    assert sorted(p.name for p in out.iterdir()) == sorted((*OUTPUT_FILES, "model.aoti.pt2"))
    report = json.loads((out / "report.json").read_text())
    meta = report["files"]["model.aoti.pt2"]
    assert meta["bytes"] == (out / "model.aoti.pt2").stat().st_size and meta["checked_equal_on"]
    assert "model.aoti.pt2" in capsys.readouterr().out
    xt = digits.test_set.tensors[0][:37].clone()  # a batch size it was not compiled or checked on
    torch.save(xt, tmp_path / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _AOTI_NO_INTQAT, str(out / "model.aoti.pt2"), str(tmp_path / "x.pt"),
                           str(tmp_path / "y.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    program = torch.export.load(out / "model.pt2").module()
    assert torch.equal(torch.load(tmp_path / "y.pt"), program(xt))


def test_compile_aoti_keeps_nothing_when_the_package_differs(tmp_path, monkeypatch):
    """A package whose numbers are not the program's (one ulp off) is refused and removed. The compiler is
    stubbed (it writes a placeholder file, and the "package" runs the program itself): what is checked is
    compile_aoti's own check and clean-up; real packages are compiled by the two tests around this one."""
    import torch._inductor

    from intqat import export as export_mod

    torch.manual_seed(0)
    x = torch.randn(16, 8)
    layer = intqat.prepare_qat(nn.Sequential(nn.Linear(8, 4)), "w8a8")
    intqat.calibrate(layer, [(x,)])
    result = export_mixed_precision(intqat.to_integer(layer), (x[:2],), validation_data=[(x,)])

    def placeholder_package(program, package_path):
        Path(package_path).write_bytes(b"not a package")

    def off_by_one_ulp(path):  # the program's output, one ulp up
        assert Path(path).read_bytes() == b"not a package"
        runner = result.program.module()
        return lambda *a: torch.nextafter(runner(*a), torch.tensor(float("inf")))

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", placeholder_package)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", off_by_one_ulp)
    target = tmp_path / "m.aoti.pt2"
    with pytest.raises(ValueError, match="differs from the exported program"):
        export_mod.compile_aoti(result.program, target, result.check_inputs)
    assert not target.exists()


@pytest.fixture(scope="module")
def wide_k_export():
    """A layer with K = 1500 (two fp32 slices of <= 1024) and codes at their extremes, exported: (result, x)."""
    torch.manual_seed(0)
    x = torch.randn(64, 1500) * 3
    model = intqat.prepare_qat(nn.Sequential(nn.Linear(1500, 24), nn.ReLU(), nn.Linear(24, 5)), "w8a8")
    intqat.calibrate(model, [(x,)])
    return export_mixed_precision(intqat.to_integer(model), (x[:2],), validation_data=[(x,)]), x


def test_int_mm_decomposed_into_fp32_slices_is_exact(wide_k_export):
    """int_mm="fp32" (what "auto" picks on a CPU without int8 dot products, where aten._int_mm is a scalar
    loop) decomposes _int_mm into exact fp32 GEMMs of K slices <= 1024: the decomposed program holds no
    _int_mm and gives the program's bits. (The AOTInductor package of it: the slow test below.)"""
    from intqat.ops.backends.fp32_exact import int_mm_via_fp32

    result, x = wide_k_export
    decomposed = result.program.run_decompositions({torch.ops.aten._int_mm.default: int_mm_via_fp32})
    targets = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert not any("_int_mm" in t for t in targets) and any("mm" in t for t in targets)
    with torch.no_grad():
        assert torch.equal(decomposed.module()(x), result.program.module()(x))


@pytest.mark.slow  # an AOTInductor compile (~8-15 s here); make test compiles one package: the CLI test above
def test_aoti_package_for_cpus_without_int8_dot_units_decomposes_int_mm_exactly(wide_k_export, tmp_path):
    """The package compiled with int_mm="fp32" equals the program (compile_aoti checks it with torch.equal
    before keeping it); int_mm="bf16" is refused."""
    from intqat.export import compile_aoti

    result, x = wide_k_export
    report = compile_aoti(result.program, tmp_path / "m.aoti.pt2", (x,), int_mm="fp32")
    assert report["checked_equal_on"] and report["int_mm"].startswith("exact fp32")
    with pytest.raises(ValueError, match="int_mm='bf16'"):
        compile_aoti(result.program, tmp_path / "n.aoti.pt2", (x,), int_mm="bf16")


def test_export_takes_dynamic_shapes_and_forward_star_args():
    """A sequence model exports with its sequence length dynamic (dynamic_shapes, passed to torch.export), and a
    wrapper whose forward takes *args exports with its batch dynamic (it failed on the dynamic_shapes structure)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 6, 16)
    intqat.prepare_qat(model, "w8a8")
    intqat.calibrate(model, [x])
    model = intqat.to_integer(model).eval()
    auto = torch.export.Dim.AUTO
    result = intqat.export_mixed_precision(model, (x,), dynamic_shapes=({0: auto, 1: auto},))
    longer = torch.randn(3, 11, 16)
    with torch.no_grad():
        assert torch.equal(result.reference.module()(longer), model(longer))

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(args[0]) + args[1]

    wrapped = Wrapper(model).eval()
    bias = torch.randn(4, 6, 8)
    result = intqat.export_mixed_precision(wrapped, (x, bias))
    with torch.no_grad():
        assert torch.equal(result.reference.module()(x[:2], bias[:2]), wrapped(x[:2], bias[:2]))


def test_cli_and_graphs_take_a_recipe_file_of_your_own(run_dir, tmp_path, capsys):
    """--recipe path/to/my.yaml (intqat-export) and recipe=path/to/my.yaml (intqat-graphs), as intqat-train takes."""
    from intqat.cli.graphs import compose_recipe
    from intqat.cli.train import recipes_dir

    own = tmp_path / "mine" / "my_mlp.yaml"
    own.parent.mkdir()
    own.write_text((recipes_dir() / f"{RECIPE}.yaml").read_text())
    out = tmp_path / "out"
    cli.main([str(run_dir / "checkpoints" / "last.ckpt"), f"recipe={own}", "--out", str(out)])
    assert (out / "model.pt2").is_file() and "my_mlp" in json.loads((out / "report.json").read_text())["export"]["source"]
    assert compose_recipe(str(own), ["model.hidden=[16]"]).model.hidden == [16]
