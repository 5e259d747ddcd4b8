"""What onnxruntime (CPU) makes of intqat's Q/DQ ONNX form: its own optimized graph (onnx_runtime.ort_graph, from
the session's optimized_model_filepath) must run every static integer GEMM as one of its integer kernels (QGemm,
MatMulIntegerToFloat, QLinearMatMul), with no weight DequantizeLinear left to run at every call; the dynamic
per-token codes written in the file equal the integer model's bit for bit; the latency floor (an Identity file on
the same inputs) is timed beside the files. A regression in fusion fails here; speed itself is measured by
intqat-bench deploy, never asserted (docs/deploy.md, "ONNX")."""

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime", reason="the ONNX tests need onnx, onnxscript, onnxruntime (pip install 'intqat[deploy]')")
import onnx  # noqa: E402

import intqat  # noqa: E402
from intqat.deploy.onnx import export_onnx  # noqa: E402
from intqat.deploy.onnx_runtime import floor_model, onnx_latency, ort_graph, run_session, session  # noqa: E402
from test_deploy_onnx import QDQ_MAX_STEPS  # noqa: E402
from test_deploy_onnx_int import integer  # noqa: E402


def _mlp(preset: str) -> tuple[nn.Module, torch.Tensor]:
    """The digits MLP's shape (64 -> 128 -> 128 -> 10, ReLU), calibrated on random inputs in [0, 1]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    x = torch.rand(64, 64)
    return integer(model, preset, [(x[i:i + 16],) for i in range(0, 64, 16)]), x


@pytest.fixture(scope="module")
def mlp_qdq():
    model, x = _mlp("w8a8")
    return export_onnx(model, x[:2], None, form="qdq", validation_data=[(x,)])


def test_static_mlp_every_linear_runs_as_qgemm(mlp_qdq):
    g = mlp_qdq.info["onnxruntime_graph"]
    # one QuantizeLinear (the input), three QGemm (the ReLUs folded into the next layer's quantize), nothing float
    assert g["integer_kernels"] == {"QGemm": 3} and g["float_gemms"] == {}, g["ops"]
    assert (g["quantize_linear"], g["dequantize_linear"]) == (1, 0), g["ops"]
    assert g["session_options"]["graph_optimization_level"] == "ORT_ENABLE_ALL"
    v = mlp_qdq.validation
    assert v["top1_agreement"] == 1.0 and v["max_diff_in_steps"] <= QDQ_MAX_STEPS, v
    md = mlp_qdq.to_markdown()
    assert "What onnxruntime runs" in md and "3 QGemm" in md and "intra_op_num_threads=1" in md


def test_the_head_gemm_keeps_its_float_bias_in_an_add(mlp_qdq):
    """The head's output is not requantized: its Gemm has no bias (so onnxruntime's QGemm selector, which wants every
    Gemm input from a DequantizeLinear, takes it) and the fp32 bias follows in an Add (what TensorRT reads)."""
    graph = onnx.load_from_string(mlp_qdq.data).graph
    inits = {t.name: t for t in graph.initializer}
    gemms = [n for n in graph.node if n.op_type == "Gemm"]
    assert [len([i for i in n.input if i]) for n in gemms] == [3, 3, 2]  # the hidden layers keep theirs: requantized
    add = next(n for n in graph.node if n.op_type == "Add" and gemms[-1].output[0] in n.input)
    bias = inits[next(i for i in add.input if i in inits)]
    assert bias.data_type == onnx.TensorProto.FLOAT and list(bias.dims) == [10]
    assert add.output[0] == graph.output[0].name


def test_without_the_bias_split_the_head_stays_a_float_gemm(monkeypatch):
    """The check above can fail: the file as torch.onnx writes it leaves the head to a float Gemm on its weight
    dequantized at every call (onnxruntime 1.32)."""
    import intqat.deploy.onnx_qdq as onnx_qdq

    monkeypatch.setattr(onnx_qdq, "split_unrequantized_bias", lambda model: 0)
    model, x = _mlp("w8a8")
    g = export_onnx(model, x[:2], None, form="qdq").info["onnxruntime_graph"]
    assert g["integer_kernels"] == {"QGemm": 2} and g["float_gemms"] == {"Gemm": 1} and g["dequantize_linear"] == 2


def test_static_encoder_every_linear_fuses():
    """A transformer block (intqat.bench.blocks' encoder, small) under w8a8: its five integer linears (qkv, out_proj,
    FFN x2, head) all become onnxruntime integer kernels; the only float GEMMs left are attention's own two products
    (float in the model too); no DequantizeLinear is left. Close to the integer model: measured 0 steps here (the
    fused kernels compute float(acc) * (s_x s_w) + b, intqat's epilogue); LayerNorm / softmax / GELU are
    onnxruntime's."""
    from intqat.bench.blocks import make_encoder

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, 32, generator=g),) for _ in range(2)]
    model = intqat.to_integer(make_encoder(32, 2, 64, 10).eval(), config="w8a8", calibration_data=batches).eval()
    result = export_onnx(model, batches[0][0][:2], None, form="qdq", validation_data=batches)
    fused = result.info["onnxruntime_graph"]
    assert sum(fused["integer_kernels"].values()) == 5, fused["ops"]
    assert set(fused["float_gemms"]) <= {"MatMul", "FusedMatMul"} and sum(fused["float_gemms"].values()) == 2, fused
    assert fused["dequantize_linear"] == 0, fused["ops"]
    v = result.validation
    assert v["top1_agreement"] == 1.0 and v["max_diff_in_steps"] <= 1e-3, v


def test_dynamic_codes_in_the_file_equal_the_integer_models():
    """w8a8_dynamic: the per-token codes the Q/DQ file computes (its Cast to int8, exposed as outputs) equal the integer
    model's own (quantize_activation, the kernels' path) bit for bit; the codes take ~12 small ops, no Expand."""
    from intqat.deploy.qdq import _integer_copy
    from intqat.ops.int_linear import quantize_activation

    model, x = _mlp("w8a8_dynamic")
    result = export_onnx(model, x[:2], None, form="qdq", validation_data=[(x,)])
    proto = onnx.load_from_string(result.data)
    ops = [n.op_type for n in proto.graph.node]
    assert "Expand" not in ops and ops.count("ReduceMax") == 3 and ops.count("Round") == 3
    codes = [n.output[0] for n in proto.graph.node
             if n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.INT8 for a in n.attribute)]
    assert len(codes) == 3
    proto.graph.output.extend(onnx.helper.make_tensor_value_info(c, onnx.TensorProto.INT8, None) for c in codes)
    got = run_session(session(proto.SerializeToString()), (x,))[1:]

    reference, want = _integer_copy(model).eval(), []
    layers = [m for m in reference.modules() if hasattr(m, "x_dynamic")]
    hooks = [m.register_forward_pre_hook(lambda m, a: want.append(quantize_activation(
        a[0].reshape(-1, a[0].shape[-1]), None, torch.zeros(1, dtype=torch.int32), m.x_qmin, m.x_qmax, True, False)[0]))
        for m in layers]
    with torch.no_grad():
        reference(x)
    for h in hooks:
        h.remove()
    assert [torch.equal(g, w) for g, w in zip(got, want)] == [True] * 3
    assert result.validation["top1_agreement"] == 1.0 and result.validation["max_diff_in_steps"] <= QDQ_MAX_STEPS


def test_floor_model_returns_its_inputs_and_is_timed_beside_the_files(tmp_path, mlp_qdq):
    x, tokens = torch.randn(3, 64), torch.randint(0, 9, (3, 5))
    out = run_session(session(floor_model((x, tokens))), (x, tokens))
    assert torch.equal(out[0], x) and torch.equal(out[1], tokens)
    path = tmp_path / "model.onnx"
    path.write_bytes(mlp_qdq.data)
    after_other: dict = {}
    times = onnx_latency({"qdq": path}, {1: (x[:1],)}, repeats=3, warmup=1, after_other=after_other)
    assert set(times) == {1} and set(times[1]) == {"qdq", "floor"} and min(times[1].values()) > 0
    # each round's first call of a file (just after another file's) kept apart from the back-to-back ones
    assert set(after_other) == {1} and set(after_other[1]) == {"qdq", "floor"} and min(after_other[1].values()) > 0
    with pytest.raises(ValueError, match="burst must be >= 1"):
        onnx_latency({"qdq": path}, {1: (x[:1],)}, burst=0)
    with pytest.raises(ValueError, match='"floor" names the floor model'):
        onnx_latency({"floor": path}, {1: (x[:1],)})
    assert ort_graph(path)["integer_kernels"] == {"QGemm": 3}
