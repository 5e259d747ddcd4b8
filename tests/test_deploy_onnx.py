"""The Q/DQ ONNX form (export_onnx(form="qdq"), model.onnx) in onnxruntime (CPU) against the integer model, the file's
structure (per-channel int8 weights with zero point 0, INT4 per-group weights in blocked DequantizeLinear), loading
it in a Python that never imports intqat, layers kept float and named, bad input, atomic writes, and intqat-export
--format onnx,onnx-int end to end.

Tolerance (docs/numerics.md, "ONNX forms"): the Q/DQ form's codes are the integer model's (QuantizeLinear divides by s
where intqat multiplies by fp32(1/s): a code may move by one where x / s lies within an ulp of a half), and
onnxruntime computes y from them in its own float order (or fuses the pattern into its own integer kernels). Outputs
are compared by max |diff| in steps of a symmetric int8 grid over the output's range (max |y| / 127): at most
QDQ_MAX_STEPS (measured here: <= 0.3 on these models), and by SQNR >= 35 dB."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import intqat

pytest.importorskip("onnxruntime", reason="the ONNX tests need onnx, onnxscript, onnxruntime (pip install 'intqat[deploy]')")
import onnx  # noqa: E402

from intqat.deploy.onnx import export_onnx  # noqa: E402
from intqat.deploy.onnx_runtime import run_session, session  # noqa: E402
from test_deploy_onnx_int import PRESETS, Layers, integer, layers_data  # noqa: E402

QDQ_MAX_STEPS = 1.0
MIN_SQNR_DB = 35.0


@pytest.fixture(scope="module", params=list(PRESETS))
def layers_qdq(request):
    torch.manual_seed(0)
    model = integer(Layers(), PRESETS[request.param], [layers_data() for _ in range(3)])
    ex = tuple(t[:2] for t in layers_data())
    return request.param, model, export_onnx(model, ex, None, form="qdq", validation_data=[layers_data(32)])


def test_every_preset_and_layer_type_as_qdq(layers_qdq):
    preset, _, result = layers_qdq
    became = {c.name: c.became for c in result.census}
    v = result.validation
    assert v["max_diff_in_steps"] <= QDQ_MAX_STEPS and v["sqnr_db"] >= MIN_SQNR_DB, v
    assert became["emb"] == "DequantizeLinear, Gather"
    gemms = {n: b for n, b in became.items() if n != "emb"}
    if preset == "8da4w":
        assert set(gemms) == {"lin", "lin3d", "conv1d"}  # the convs are float (named)
        assert {"stem", "dw", "grouped", "pw"} <= set(result.float_layers)
    else:
        assert set(gemms) == {"lin", "lin3d", "conv1d", "stem", "dw", "grouped", "pw"}
    for name, ops in gemms.items():
        assert "DequantizeLinear" in ops and ops.split(", ")[-1] in ("Gemm", "MatMul", "Conv"), (name, ops)
        if preset != "w8a8":  # dynamic: the activation's quantize written out, no QuantizeLinear
            assert "QuantizeLinear" not in ops.split(", ")
            assert "activation scale computed at run time" in next(c.note for c in result.census if c.name == name)
    if preset == "w8a8":  # (dw, grouped and pw read one tensor on one grid: the exporter keeps one QuantizeLinear)
        assert all(gemms[n].startswith("QuantizeLinear, DequantizeLinear") for n in ("lin", "lin3d", "conv1d", "stem"))
        assert any(gemms[n].startswith("QuantizeLinear") for n in ("dw", "grouped", "pw"))


def _initializers(data: bytes) -> dict:
    return {t.name: t for t in onnx.load_from_string(data).graph.initializer}


def test_weights_are_symmetric_int_codes_per_channel_or_per_group(layers_qdq):
    """TensorRT's explicit quantization: weights int8 per output channel (axis 0), zero point 0; 8da4w: INT4 codes,
    one scale per group (DequantizeLinear's block_size, opset 21), zero point 0."""
    preset, _, result = layers_qdq
    graph = onnx.load_from_string(result.data).graph
    inits = {t.name: t for t in graph.initializer}
    weight_dq = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert weight_dq
    for node in weight_dq:
        codes = inits[node.input[0]]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        zero = onnx.numpy_helper.to_array(inits[node.input[2]])
        assert not zero.any(), node.name
        if node.input[0].startswith("emb"):  # the table: one scale per row (8-bit) or per group of 16 (4-bit)
            assert attrs["axis"] == 1 and attrs["block_size"] == (16 if preset == "8da4w" else 32)
        elif preset == "8da4w":
            assert codes.data_type == onnx.TensorProto.INT4 and attrs["axis"] == 1 and attrs["block_size"] == 16
        else:
            assert codes.data_type == onnx.TensorProto.INT8 and attrs.get("axis", 1) == 0, (node.name, attrs)
    assert result.opset == 21 and any(o.version == 21 for o in onnx.load_from_string(result.data).opset_import)


_NO_INTQAT = r"""
import importlib.abc, sys

class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "intqat" or name.startswith("intqat.") or name == "torch":
            raise ImportError(f"this process must not import {name}")

sys.meta_path.insert(0, _Block())
import numpy as np
import onnxruntime as ort

sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
arrays = np.load(sys.argv[2])
feeds = {i.name: arrays[f"arr_{k}"] for k, i in enumerate(sess.get_inputs())}
np.savez(sys.argv[3], *sess.run(None, feeds))
assert "intqat" not in sys.modules and "torch" not in sys.modules
"""


@pytest.mark.parametrize("form", ["qdq", "int"])
def test_file_loads_and_runs_with_onnxruntime_alone(form, tmp_path):
    """The file as a deployer runs it: onnxruntime and numpy only (neither intqat nor torch imported), any batch."""
    torch.manual_seed(0)
    model = integer(Layers(), PRESETS["8da4w" if form == "qdq" else "w8a8"], [layers_data() for _ in range(2)])
    path = tmp_path / "model.onnx"
    result = export_onnx(model, tuple(t[:2] for t in layers_data()), path, form=form)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"] and path.read_bytes() == result.data
    inputs = layers_data(5)
    np.savez(tmp_path / "in.npz", *[t.numpy() for t in inputs])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _NO_INTQAT, str(path), str(tmp_path / "in.npz"),
                           str(tmp_path / "out.npz")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = np.load(tmp_path / "out.npz")
    expected = run_session(session(path), inputs)  # the same file, the same runtime, in this process
    assert [torch.equal(torch.from_numpy(out[f"arr_{i}"]), e) for i, e in enumerate(expected)] == [True] * len(expected)


def _mlp(preset="w8a8"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return integer(model, preset, [(torch.randn(8, 16),) for _ in range(2)])


@pytest.mark.parametrize("form", ["qdq", "int"])
def test_a_layer_kept_float_is_named(form):
    model = _mlp()
    result = export_onnx(model, torch.randn(2, 16), None, form=form, keep_float=["0"])
    rows = {c.name: c for c in result.census}
    assert rows["0"].became == "kept float" and rows["0"].note == "asked (keep_float)"
    assert rows["2"].became != "kept float"
    ops = {n.op_type for n in onnx.load_from_string(result.data).graph.node}
    assert ("MatMulInteger" in ops) == (form == "int")
    assert result.validation["top1_agreement"] == 1.0  # the float layer computes with w_hat on the float input


def test_a_layer_onnxruntime_refuses_is_kept_float_with_its_error(monkeypatch):
    """onnxruntime refusing a node at load time ("Could not find an implementation for ... node with name ...", as it
    does for kernels it lacks) sends the layer that node belongs to back float, named with the error, and the model is
    exported again. (No intqat layer type is refused by onnxruntime 1.32 on this CPU: the refusal is simulated here,
    on the first load, for the node of layer 0's integer product.)"""
    import intqat.deploy.onnx as onnx_mod

    real, calls = onnx_mod.session, []

    def refusing(data):
        calls.append(1)
        if len(calls) == 1:
            model = onnx.load_from_string(data)
            node = next(n for n in model.graph.node if n.op_type == "MatMulInteger")
            raise RuntimeError(f"[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for "
                               f"MatMulInteger(10) node with name '{node.name}'")
        return real(data)

    monkeypatch.setattr(onnx_mod, "session", refusing)
    result = export_onnx(_mlp(), torch.randn(2, 16), None, form="int")
    rows = {c.name: c for c in result.census}
    assert len(calls) == 2 and rows["0"].became == "kept float"
    assert rows["0"].note.startswith("onnxruntime refused it:") and "NOT_IMPLEMENTED" in rows["0"].note
    assert rows["2"].became == "MatMulInteger"


def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path):
    model = _mlp()
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="unknown ONNX form 'tensorrt'.*'qdq'.*'int'"):
        export_onnx(model, x, tmp_path / "a.onnx", form="tensorrt")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="not a writable directory"):
        export_onnx(model, x, tmp_path / "file" / "model.onnx")
    with pytest.raises(ValueError, match="is a directory"):
        export_onnx(model, x, tmp_path)
    with pytest.raises(ValueError, match="opset >= 21"):
        export_onnx(model, x, tmp_path / "b.onnx", opset=17)
    with pytest.raises(ValueError, match=r"keep_float names \['nope'\].*integer layers: 0, 2"):
        export_onnx(model, x, tmp_path / "c.onnx", keep_float=["nope"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_file_is_written_atomically(tmp_path, monkeypatch):
    result = export_onnx(_mlp(), torch.randn(2, 16), None, form="int")
    (tmp_path / "model.int.onnx").write_bytes(b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        result.save(tmp_path / "model.int.onnx", report=True)
    assert [p.name for p in tmp_path.iterdir()] == ["model.int.onnx"]  # no temporary file left behind
    assert (tmp_path / "model.int.onnx").read_bytes() == b"old"


def test_float_regions_fp16_by_the_autocast_rules_and_bf16_named():
    """fp16: intqat's autocast rules cast the float regions (the integer layers keep their fp32 quantize and
    epilogue); bf16: kept fp32, with the reason (onnxruntime's CPU provider has no bf16 kernels)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
    data = [(torch.randn(8, 16),) for _ in range(2)]
    integer(model, "w8a8_dynamic", data)
    # layer 2 kept float: a float GEMM between GELUs, which the rules lower to fp16
    fp16 = export_onnx(model, data[0][0][:2], None, form="int", low_precision_type=torch.float16,
                       calibration_data=data, validation_data=data, keep_float=["2"])
    assert fp16.info["float_regions"] == "torch.float16"
    casts = [n for n in onnx.load_from_string(fp16.data).graph.node if n.op_type == "Cast"
             and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute)]
    assert casts and fp16.validation["sqnr_db"] >= 30, fp16.validation  # fp16 rounding in the float layer
    bf16 = export_onnx(model, data[0][0][:2], None, form="int", low_precision_type=torch.bfloat16, data_max=256.0,
                       validation_data=data)
    assert bf16.info["float_regions"] == "fp32" and "no bf16 kernels" in bf16.info["notes"][0]
    assert bf16.validation["top1_agreement"] == 1.0


# -- intqat-export --format onnx,onnx-int --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A digits MLP run of the default recipe (intqat-train's layout), trained 4 steps (integer from step 2)."""
    from omegaconf import OmegaConf
    from test_export import RECIPE, _fit_checkpoint, _recipe_config

    run = tmp_path_factory.mktemp("run")
    cfg = _recipe_config(RECIPE)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "checkpoints").mkdir()
    _fit_checkpoint(OmegaConf.to_container(cfg.model, resolve=True), run / "checkpoints" / "last.ckpt")
    return run


def test_cli_format_onnx_and_onnx_int(run_dir, capsys):
    from intqat.cli import export as cli

    out = run_dir / "onnx_export"
    cli.main([str(run_dir), "--format", "onnx,onnx-int", "--out", str(out)])
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "model.int.onnx", "model.onnx", "model_int_onnx_report.json", "model_int_onnx_report.md",
        "model_onnx_report.json", "model_onnx_report.md"]
    assert "model.int.onnx" in printed and "bit for bit" in printed and "no bf16 kernels" in printed
    int_report = json.loads((out / "model_int_onnx_report.json").read_text())
    assert int_report["validation"]["bit_exact"] and int_report["validation"]["samples"] == 270
    assert {c["became"] for c in int_report["census"]} == {"MatMulInteger"} and len(int_report["census"]) == 3
    qdq = json.loads((out / "model_onnx_report.json").read_text())
    assert qdq["validation"]["top1_agreement"] == 1.0 and qdq["validation"]["samples"] == 270
    assert qdq["size"]["ratio"] < 0.5 and set(qdq["latency"]["per_batch"]) == {"1", "32"}
    # the floor (an Identity file on the same inputs, timed beside them) and the session options beside the figures
    assert {"floor_ms", "ratio_above_floor", "after_other"} <= set(qdq["latency"]["per_batch"]["1"])
    assert "floor" in printed and "back-to-back" in qdq["latency"]["method"]
    assert qdq["latency"]["session_options"]["intra_op_num_threads"] == 1
    assert qdq["onnx"]["onnxruntime_graph"]["integer_kernels"] == {"QGemm": 3}
    assert qdq["onnx"]["source"].startswith(str(run_dir))
    sess = session(out / "model.onnx")  # the written file is the one measured
    assert len(sess.get_inputs()) == 1 and isinstance(sess.get_inputs()[0].shape[0], str)  # the batch: symbolic
