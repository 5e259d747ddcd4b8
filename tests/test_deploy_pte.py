"""ExecuTorch (.pte, XNNPACK): every preset x layer type lowered and run in ExecuTorch's own runtime against the
integer model; the delegation census; a layer XNNPACK cannot take is named and kept float; the .pte runs in a
Python that never imports intqat; formats asked for without their package fail before anything is written.

Tolerances (the .pte against intqat's integer model, docs/numerics.md "Deploy forms"): the codes of the Q/DQ form are
the integer model's (tests/test_deploy_qdq.py), but XNNPACK computes from them with its own arithmetic:
dynamic activations are re-quantized on XNNPACK's own per-row (per-image) asymmetric grid, static GEMMs round
their int32 bias to s_x s_w and requantize their int8 outputs, and a static layer that feeds float ops gets an
int8 output grid the integer model does not have (a rounding of up to half its step). Outputs are compared by
top-1 agreement and by max |diff| in steps of a symmetric int8 grid over the output's range (max |y| / 127): at
most MAX_STEPS steps (measured here: 0.1-2.5 on these models, 0.1 on the digits MLP), which still catches a wrong
scale, zero point or layout (those are off by tens of steps or more).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import intqat
from intqat.deploy.qdq import qdq_layers, to_qdq

pytest.importorskip("executorch", reason="the .pte tests need ExecuTorch (pip install 'intqat[deploy]')")
from intqat.deploy.executorch import export_pte, load_pte, run_pte  # noqa: E402
from qat_helpers import integer  # noqa: E402

MAX_STEPS = 6.0
MIN_AGREEMENT = 0.95
EMB8 = {"bits": 8, "granularity": "channel"}
PRESETS = {
    "w8a8": {"preset": "w8a8", "embedding": EMB8},
    "w8a8_dynamic": {"preset": "w8a8_dynamic", "embedding": EMB8},
    "w4a8": {"preset": "w4a8", "embedding": EMB8},
    "8da4w": {"preset": "8da4w", "weight": {"group_size": 32},  # (XNNPACK: groups of a multiple of 32)
              "embedding": {"bits": 4, "granularity": "group", "group_size": 16}},
}


class Zoo(nn.Module):
    """Every layer type in one model: tokens -> embedding -> HF Conv1D -> attention; image -> conv 3x3 ->
    depthwise 3x3 -> pointwise 1x1 (a depthwise-separable block); both -> linear head."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.emb = nn.Embedding(64, 32)
        self.proj = Conv1D(32, 32)  # (nf, nx): weight (in, out)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, tokens, image):
        h = torch.relu(self.proj(self.emb(tokens)))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        x = torch.relu(self.pw(torch.relu(self.dw(torch.relu(self.stem(image))))))
        return self.head(h.mean(1) + x.mean((2, 3)))


def zoo_data(n: int = 16):
    return torch.randint(0, 64, (n, 8)), torch.randn(n, 3, 8, 8)


def _census(result) -> dict[str, str]:
    return {c.name: c.where for c in result.census}


@pytest.fixture(scope="module", params=list(PRESETS))
def zoo_pte(request):
    torch.manual_seed(0)
    model = integer(Zoo(), PRESETS[request.param], [zoo_data() for _ in range(3)])
    calibration = [zoo_data() for _ in range(2)]
    validation = [zoo_data(32) for _ in range(2)]
    ex = tuple(t[:2] for t in zoo_data())
    return request.param, model, export_pte(model, ex, calibration_data=calibration, validation_data=validation,
                                            fp32_baseline=False)


def test_every_preset_and_layer_type_reaches_xnnpack(zoo_pte):
    preset, model, result = zoo_pte
    where = _census(result)
    qdq, called = to_qdq(model), set()
    for name, layer in qdq_layers(qdq).items():
        layer.register_forward_pre_hook(lambda m, a, name=name: called.add(name))
    with torch.no_grad():
        qdq(*zoo_data(2))
    assert set(where) == called  # every integer layer forward calls is in the census, nothing else
    gemms = {n: w for n, w in where.items() if n not in ("emb",)}
    if preset == "w8a8_dynamic":  # XNNPACK's dynamic conv is standard 2-D only: the depthwise one is named
        assert gemms.pop("dw").startswith("kept float")
        note = next(c.note for c in result.census if c.name == "dw")
        assert "XNNPACK only supports standard 2D convolutions for dynamic quantization" in note
    if preset == "8da4w":  # per-group weights: linear layers only (prepare_qat names convs and attention float)
        assert set(gemms) == {"proj", "head"}
    assert all(w.startswith("XNNPACK") for w in gemms.values()), gemms
    expected_kernel = "embedding_4bit" if preset == "8da4w" else "embedding_byte"
    assert expected_kernel in where["emb"]  # no gather in XNNPACK: ExecuTorch's quantized kernel


def test_pte_agrees_with_the_integer_model(zoo_pte):
    _, _, result = zoo_pte
    v = result.validation
    assert v["samples"] == 64
    assert v["top1_agreement"] >= MIN_AGREEMENT, v
    assert v["max_diff_in_steps"] <= MAX_STEPS, v


def test_pte_runs_any_batch_up_to_max_batch(zoo_pte):
    """Lowering a conv narrows the batch's range to [2, 15] (torch's fake conv guards it against 16): export_pte
    plans for max_batch again; batch 1 and max_batch both run and match the integer model's shape."""
    _, model, result = zoo_pte
    method = load_pte(result.buffer)
    for n in (1, 64):
        tokens, image = zoo_data(n)
        out = run_pte(method, (tokens, image), 64)[0]
        with torch.no_grad():
            ref = model(tokens, image)
        assert out.shape == ref.shape
        assert float((out - ref).abs().max()) <= MAX_STEPS * float(ref.abs().max()) / 127


_NO_INTQAT = r"""
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "intqat" or name.startswith("intqat."):
            raise ImportError("this process must not import intqat")

sys.meta_path.insert(0, _Block())
import torch
import executorch.kernels.quantized  # noqa: F401  (embedding_byte / embedding_4bit)
from executorch.runtime import Runtime

program = Runtime.get().load_program(sys.argv[1])
method = program.load_method("forward")
inputs = torch.load(sys.argv[2])
torch.save(method.execute(list(inputs))[0], sys.argv[3])
assert "intqat" not in sys.modules
"""


@pytest.mark.parametrize("zoo_pte", ["8da4w"], indirect=True)  # one preset is enough for the loader (8da4w: int4
def test_pte_loads_and_runs_in_a_python_without_intqat(zoo_pte, tmp_path):  # per group + the embedding_4bit kernel)
    _, _, result = zoo_pte
    paths = result.save(tmp_path / "model.pte")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(paths)
    report = json.loads((tmp_path / "model_report.json").read_text())
    assert {c["name"] for c in report["census"]} == {"emb", "proj", "head"}
    inputs = zoo_data(5)
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _NO_INTQAT, str(tmp_path / "model.pte"), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = run_pte(load_pte(tmp_path / "model.pte"), inputs, 64)[0]
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)  # the same program, the same runtime


def test_depthwise_separable_block_static_outputs_requantized_exactly():
    """conv -> relu -> dw -> relu -> pw (w8a8): each static conv's int8 output is its consumer's own input grid
    (exact); the model-output layer keeps fp32 logits (its weight stored dequantized, an fp32 GEMM)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=16),
                          nn.ReLU(), nn.Conv2d(16, 32, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 10))
    data = [(torch.randn(8, 3, 8, 8),) for _ in range(3)]
    integer(model, "w8a8", data)
    result = export_pte(model, data[0][0][:2], calibration_data=data, validation_data=data, fp32_baseline=False)
    rows = {c.name: c for c in result.census}
    assert rows["0"].where == rows["2"].where == rows["4"].where == "XNNPACK"
    assert "next layer's input grid, directly (exact)" in rows["0"].note and "(exact)" in rows["2"].note
    assert "feeds" in rows["4"].note and "calibration data" in rows["4"].note  # into the average pool: observed grid
    assert rows["8"].where.startswith("XNNPACK (fp32 GEMM") and "model's output" in rows["8"].note
    assert result.validation["top1_agreement"] >= MIN_AGREEMENT
    assert result.validation["max_diff_in_steps"] <= MAX_STEPS


def test_transformer_block_hf_gpt2():
    """A tiny Hugging Face GPT-2 (Conv1D projections, embeddings, LayerNorm, GELU, causal attention), static w8a8:
    every projection's int8 output requantized for XNNPACK where it feeds LayerNorm, GELU, the attention or a
    residual add (8da4w's transformer path is the zoo's, and the gpt recipe's in docs/deploy.md)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from real_models import HFLogits

    torch.manual_seed(0)
    model = HFLogits(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))
    config = {"preset": "w8a8", "embedding": EMB8}
    data = [(torch.randint(0, 64, (4, 16)),) for _ in range(3)]
    integer(model, config, data)
    result = export_pte(model, data[0][0][:2], calibration_data=data, validation_data=data, fp32_baseline=False)
    where = _census(result)
    assert where and all(w.startswith(("XNNPACK", "ExecuTorch kernel")) for w in where.values()), where
    assert sum(w.startswith("XNNPACK") for w in where.values()) >= 5  # 4 projections + lm_head
    v = result.validation
    assert v["top1_agreement"] >= 0.9 and v["max_diff_in_steps"] <= MAX_STEPS, v


def test_pte_is_written_atomically(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = integer(nn.Sequential(nn.Linear(16, 8)), "w8a8_dynamic", [(torch.randn(4, 16),)])
    result = export_pte(model, torch.randn(2, 16), fp32_baseline=False)
    (tmp_path / "model.pte").write_bytes(b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        result.save(tmp_path / "model.pte")
    assert [p.name for p in tmp_path.iterdir()] == ["model.pte"]  # no temporary file left behind
    assert (tmp_path / "model.pte").read_bytes() == b"old"  # and the old file whole


_WITHOUT_DEPLOY = r"""
import importlib.util, sys

# an environment without the deploy extra, as intqat's check sees it (importlib.util.find_spec)
_real, HIDDEN = importlib.util.find_spec, {"executorch", "onnx", "onnxruntime", "onnxscript"}
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] in HIDDEN else _real(name, package)

from intqat.deploy import MissingDeployPackage, require
try:
    require("pte")
except MissingDeployPackage as e:
    print("ERR", e)
from intqat.cli import export as cli
try:  # (a run directory that does not exist: the check comes before anything is loaded)
    cli.main([sys.argv[1], "--format", "pt2,pte", "--out", sys.argv[2]])
except SystemExit as e:
    print("EXIT", e.code)
"""


def test_a_format_without_its_package_names_the_extra_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_DEPLOY, str(tmp_path / "no-such-run"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert "ERR the 'pte' format needs executorch" in proc.stdout, proc.stdout + proc.stderr
    assert "pip install 'intqat[deploy]'" in proc.stdout
    assert "EXIT 1" in proc.stdout, proc.stdout + proc.stderr
    assert "pip install 'intqat[deploy]'" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_format_names_are_the_deploy_formats():
    from intqat.cli.export import FORMATS
    from intqat.deploy.formats import FORMATS as DEPLOY_FORMATS, parse_formats

    assert FORMATS == DEPLOY_FORMATS
    assert parse_formats("pt2, pte,pt2") == ["pt2", "pte"] and parse_formats(None) == ["pt2"]
    with pytest.raises(ValueError, match="unknown tflite"):
        parse_formats("pt2,tflite")


def test_a_layer_xnnpack_cannot_take_is_named_and_kept_float():
    """Per-group weights in groups of 16: XNNPACK's per-group GEMM takes int4 in groups of a multiple of 32 (its
    serializer asserts otherwise). The layer is kept float (w_hat, fp32 GEMM), named with the reason; the other
    layer (groups of 32 = K) reaches XNNPACK."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 8))
    data = [(torch.randn(8, 32),) for _ in range(2)]
    integer(model, {"preset": "8da4w", "weight": {"group_size": 16}}, data)
    result = export_pte(model, data[0][0][:2], calibration_data=data, validation_data=data, fp32_baseline=False)
    rows = {c.name: c for c in result.census}
    assert rows["0"].where == rows["2"].where == "kept float (fp32 GEMM in XNNPACK)"
    assert "groups of a multiple of 32" in rows["0"].note and "groups of 16" in rows["0"].note
    assert result.validation["top1_agreement"] >= MIN_AGREEMENT  # float layers: the input is not quantized


# -- intqat-export --format and the recipes' export.formats ------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A digits MLP run (intqat-train's layout: .hydra/config.yaml, checkpoints/last.ckpt) of a recipe with
    `export.formats: [pt2, pte]`, whose end-of-fit export went through export_fn_for_callback(formats=...)."""
    import functools

    import lightning as L
    from omegaconf import OmegaConf
    from test_export import RECIPE, _recipe_config

    from intqat.data import DigitsDataModule
    from intqat.export import export_fn_for_callback
    from intqat.training import ClassificationModule

    run = tmp_path_factory.mktemp("run")
    cfg = _recipe_config(RECIPE, ["export.formats=[pt2,pte]"])
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    torch.manual_seed(0)
    module = ClassificationModule(OmegaConf.to_container(cfg.model, resolve=True), lr=3e-3, scheduler=None)
    export_fn = functools.partial(export_fn_for_callback, formats=list(cfg.export.formats))
    qat = intqat.IntQAT("w8a8", prepare_at=0, freeze_observers_at=2, integer_at=2, unit="step", log_quant_metrics=False,
                        export_on_fit_end=True, export_dir=str(run / "fit_end_export"), export_fn=export_fn)
    trainer = L.Trainer(max_steps=4, callbacks=[qat], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(run))
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=64, seed=0))
    trainer.save_checkpoint(run / "checkpoints" / "last.ckpt")
    return run


def test_callback_writes_the_formats_of_the_recipe(run_dir):
    files = sorted(p.name for p in (run_dir / "fit_end_export").iterdir())
    assert files == ["model.pt2", "model.pte", "model_report.json", "model_report.md", "report.json", "report.md"]
    report = json.loads((run_dir / "fit_end_export" / "model_report.json").read_text())
    assert report["pte"]["source"].startswith("end of fit") and report["validation"]["samples"] == 270


def test_cli_format_pte_of_a_run_directory(run_dir, capsys):
    from intqat.cli import export as cli

    out = run_dir / "cli_export"
    cli.main([str(run_dir), "--out", str(out)])  # no --format: the run's export.formats, pt2 and pte
    printed = capsys.readouterr().out
    assert (out / "model.pt2").is_file() and (out / "model.pte").is_file()
    assert "model.pte" in printed and "top-1 agreement 100.00%" in printed  # fp32 logits: the integer model's
    report = json.loads((out / "model_report.json").read_text())
    where = {c["name"]: c["where"] for c in report["census"]}
    assert where == {"features.1": "XNNPACK", "features.3": "XNNPACK",
                     "head": "XNNPACK (fp32 GEMM, int8-quantized input)"}
    assert report["validation"]["top1_agreement"] == 1.0 and report["validation"]["samples"] == 270
    assert report["size"]["ratio"] < 0.5 and set(report["latency"]["per_batch"]) == {"1", "32"}
    # the floor and the C++ runner measured beside both files (no timing asserted: the bench gives ratios)
    assert report["latency"]["cpp"] == "measured", report["latency"]["cpp"]  # (g++ and the wheel's headers: here)
    for t in report["latency"]["per_batch"].values():
        for figures in (t, t["cpp"]):
            assert figures["floor_ms"] > 0 and figures["int8_ms"] > 0 and figures["fp32_ms"] > 0
            assert figures["int8_above_floor_ms"] == pytest.approx(figures["int8_ms"] - figures["floor_ms"])
            # back to back is the figure; each burst's first call (just after another file's) beside it
            after = figures["after_other"]
            assert after["int8_ms"] > 0 and after["ratio"] == pytest.approx(after["int8_ms"] / after["fp32_ms"])
    # the file's parts add up; the int8 weights are stored once, beside the fp32 head (the model-output rule) and,
    # per static layer, fp32 weight scales, the int32 bias and its own scales (XNNPACK's format); nothing else
    parts = report["size"]["int8_parts"]
    assert sum(parts[k] for k in ("program", "delegate_payloads", "constant_data", "padding_and_header")) \
        == parts["total"] == (out / "model.pte").stat().st_size
    assert parts["largest_constants"][:3] == [128 * 128, 64 * 128, 10 * 128 * 4]
    assert parts["constant_data"] - sum(parts["largest_constants"][:3]) == 2 * (3 * 128 * 4) + 10 * 4
    assert "floor" in (out / "model_report.md").read_text()
    with pytest.raises(SystemExit) as e:  # a wrong format name: a usage error, nothing written
        cli.main([str(run_dir), "--format", "pt2,tflite", "--out", str(run_dir / "nope")])
    assert e.value.code == 2 and not (run_dir / "nope").exists()
    assert "unknown tflite" in capsys.readouterr().err


def test_bench_deploy_is_registered():
    from intqat.cli.bench import _parser

    args = _parser().parse_args(["deploy", "--quick", "--repeats", "3"])
    assert args.command == "deploy" and args.quick and args.repeats == 3
