"""TensorRT's explicit quantization: the w8a8_sym preset (symmetric static activations) end to end, and
intqat.deploy.tensorrt_check on intqat's files and on hand-built ones.

w8a8_sym through prepare_qat -> to_integer -> the Q/DQ ONNX file: TensorRT-ready by the documented rules, its codes the
integer model's (the narrow range [-127, 127] clipped in float before QuantizeLinear, so the Q feeds its DQ alone), and
onnxruntime's output equal to the integer model's bit for bit (QGemm with a float output: the exact int32 sum times
s_x s_w, then the bias: intqat's epilogue). w8a8's file is refused for its zero points, onnx-int's for MatMulInteger,
a contrib op, a Clip between Q and DQ, a run-time scale, an activation per channel, a weight's axis and the opset are
named with their nodes. TensorRT itself cannot run here (no GPU): docs/deploy.md, "TensorRT"."""

import numpy as np
import pytest
import torch
from torch import nn

import intqat

pytest.importorskip("onnxruntime", reason="the ONNX tests need onnx, onnxscript, onnxruntime (pip install 'intqat[deploy]')")
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from intqat.deploy.onnx import export_onnx  # noqa: E402
from intqat.deploy.onnx_runtime import run_session, session  # noqa: E402
from intqat.deploy.qdq import _integer_copy  # noqa: E402
from intqat.deploy.tensorrt_check import check_tensorrt  # noqa: E402
from qat_helpers import integer  # noqa: E402


class Net(nn.Module):
    """conv 3x3 -> ReLU -> depthwise 3x3 -> flatten -> Linear -> ReLU -> Linear: every layer static int8."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 6 * 6, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.dw(torch.relu(self.conv(x))).flatten(1))))


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))


def _images(n=16):
    return (torch.randn(n, 3, 6, 6),)


def _rows(n=16):
    return (2 * torch.randn(n, 16),)


@pytest.fixture(scope="module")
def sym_net():
    torch.manual_seed(0)
    model = integer(Net(), "w8a8_sym", [_images() for _ in range(3)])
    return model, export_onnx(model, _images(2), None, form="qdq", validation_data=[_images(32)])


@pytest.fixture(scope="module")
def mlp_files():
    """The MLP under w8a8_sym and w8a8: (model, Q/DQ result) each, and w8a8_sym's integer form."""
    out = {}
    for preset in ("w8a8_sym", "w8a8"):
        torch.manual_seed(0)
        model = integer(_mlp(), preset, [_rows() for _ in range(3)])
        out[preset] = model, export_onnx(model, _rows(2), None, form="qdq", validation_data=[_rows(64)])
    out["int"] = export_onnx(out["w8a8_sym"][0], _rows(2), None, form="int", validation_data=[_rows(64)])
    return out


def test_w8a8_sym_preset_is_symmetric_static_per_tensor():
    a, w = intqat.PRESETS["w8a8_sym"].activation, intqat.PRESETS["w8a8_sym"].weight
    assert (a.symmetric, a.qmin, a.qmax, a.granularity, a.dynamic) == (True, -127, 127, "tensor", False)
    assert w == intqat.PRESETS["w8a8"].weight
    torch.manual_seed(0)
    model = integer(_mlp(), "w8a8_sym", [_rows()])
    deployed = _integer_copy(model)
    zero_points = [int(m.x_zero_point.reshape(-1)[0]) for m in deployed.modules() if hasattr(m, "x_zero_point")]
    assert zero_points == [0, 0, 0]


def test_w8a8_sym_qdq_file_is_tensorrt_ready(sym_net, mlp_files):
    for result in (sym_net[1], mlp_files["w8a8_sym"][1]):
        readiness = result.tensorrt()
        assert readiness.ready, readiness.reasons
        assert result.lines()[-1].startswith("TensorRT explicit quantization: ready")
        assert "## TensorRT" in result.to_markdown() and result.to_dict()["tensorrt"]["ready"] is True
        graph = onnx.load_from_string(result.data).graph
        consumers = {}
        for node in graph.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node.op_type)
        quantize = [n for n in graph.node if n.op_type == "QuantizeLinear"]
        assert quantize
        for node in quantize:  # [-127, 127]: a float Clip before the Q, whose output feeds DequantizeLinear alone
            assert set(consumers[node.output[0]]) == {"DequantizeLinear"}, node.name
            assert next(n for n in graph.node if node.input[0] in n.output).op_type == "Clip"
    census = {c.name: c.became for c in sym_net[1].census}
    assert census == {"conv": "QuantizeLinear, DequantizeLinear, Conv", "dw": "QuantizeLinear, DequantizeLinear, Conv",
                      "fc": "QuantizeLinear, DequantizeLinear, Gemm", "head": "QuantizeLinear, DequantizeLinear, Gemm"}
    # onnxruntime runs these convs as float Convs on x_hat, w_hat (no float-output integer conv): their fp32 sums round
    # otherwise than the exact int32 ones, and a code of the next layer's input may move by one (as w8a8's file,
    # test_deploy_onnx's QDQ_MAX_STEPS)
    v = sym_net[1].validation
    assert v["max_diff_in_steps"] <= 1.0 and v["sqnr_db"] >= 35.0, v


def test_w8a8_sym_qdq_equals_the_integer_model_in_onnxruntime(mlp_files):
    """0 steps: onnxruntime fuses each DQ -> Gemm into QGemm with a float output (the bias split off, the narrow
    range's Clip before the next Q), i.e. float(int32 sum) * (s_x s_w) + b, the integer model's epilogue."""
    model, result = mlp_files["w8a8_sym"]
    v, ort = result.validation, result.info["onnxruntime_graph"]
    assert v["bit_exact"] and v["max_diff_in_steps"] == 0.0, v
    assert ort["integer_kernels"] == {"QGemm": 3} and not ort["float_gemms"], ort
    data = _rows(33)  # fresh data, another batch size
    got = run_session(session(result.data), data)[0]
    with torch.no_grad():
        want = _integer_copy(model).eval()(*data)
    assert torch.equal(got, want)


def test_w8a8_sym_exports_exactly_and_reaches_xnnpack(sym_net):
    """The rest of the road: export_mixed_precision's reference program is the integer model bit for bit, and the
    .pte's integer layers all lowered to XNNPACK (its static symmetric per-tensor form), close to the integer model."""
    pytest.importorskip("executorch", reason="the .pte tests need ExecuTorch (pip install 'intqat[deploy]')")
    from intqat.deploy.executorch import export_pte
    from intqat.export import export_mixed_precision

    model, _ = sym_net
    x = _images(32)
    exported = export_mixed_precision(model, (x[0][:2],), calibration_data=[x])
    assert exported.validation["reference_equals_integer_model"] is True
    pte = export_pte(model, _images(2), calibration_data=[_images()], validation_data=[_images(32)],
                     fp32_baseline=False)
    where = {c.name: c.where for c in pte.census}
    assert set(where) == {"conv", "dw", "fc", "head"} and all(w.startswith("XNNPACK") for w in where.values()), where
    assert pte.validation["top1_agreement"] >= 0.95 and pte.validation["max_diff_in_steps"] <= 6.0, pte.validation


def test_w8a8_file_is_not_ready_for_its_zero_points(mlp_files):
    _, result = mlp_files["w8a8"]
    readiness = result.tensorrt()
    graph = onnx.load_from_string(result.data).graph
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    first = next(n for n in graph.node if n.op_type == "QuantizeLinear")
    zero = int(inits[first.input[2]])
    assert zero != 0  # asymmetric static activations
    want = f"QuantizeLinear '{first.name}' zero point {zero} != 0: TensorRT takes symmetric activations; " \
           "train with preset w8a8_sym"
    assert not readiness.ready and want in readiness.reasons, readiness.reasons
    assert any(line.strip() == f"- {want}" for line in result.lines())


def test_onnx_int_file_is_not_ready_naming_matmulinteger(mlp_files):
    result = mlp_files["int"]
    assert result.validation["bit_exact"]
    graph = onnx.load_from_string(result.data).graph
    names = [n.name for n in graph.node if n.op_type == "MatMulInteger"]
    reasons = result.tensorrt().reasons
    assert len(names) == 3
    for name in names:
        assert f"MatMulInteger '{name}' is not supported by TensorRT's ONNX parser: the integer form (onnx-int) is " \
               "for onnxruntime; TensorRT takes the Q/DQ form (--format onnx)" in reasons


# -- hand-built files: one refusal each ------------------------------------------------------------------------------


def _model(nodes, inits, opset=21, inputs=("x", [2, 4]), extra_opsets=()):
    x = helper.make_tensor_value_info(inputs[0], TensorProto.FLOAT, inputs[1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], [numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in extra_opsets]
    return helper.make_model(graph, opset_imports=opsets)


def _linear(zero=0, scale=0.1, w_axis=0, clip_between=False, x_scale_shape=()):
    """x -> Q -> DQ -> Gemm(transB=1) with a per-channel int8 weight (3, 4)."""
    channels = 3 if w_axis == 0 else 4
    inits = {"s": np.full(x_scale_shape, scale, np.float32), "z": np.full(x_scale_shape, zero, np.int8),
             "w": np.arange(-6, 6, dtype=np.int8).reshape(3, 4), "sw": np.full(channels, 0.5, np.float32),
             "zw": np.zeros(channels, np.int8), "lo": np.array(-127, np.int8), "hi": np.array(127, np.int8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="x_q")]
    if clip_between:
        nodes.append(helper.make_node("Clip", ["xq", "lo", "hi"], ["xc"], name="x_clip"))
    nodes += [helper.make_node("DequantizeLinear", ["xc" if clip_between else "xq", "s", "z"], ["xd"], name="x_dq"),
              helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wd"], name="w_dq", axis=w_axis),
              helper.make_node("Gemm", ["xd", "wd"], ["y"], name="fc", transB=1)]
    return _model(nodes, inits)


def test_hand_built_symmetric_linear_is_ready():
    readiness = check_tensorrt(_linear().SerializeToString())
    assert readiness.ready and readiness.opset == 21, readiness.reasons


@pytest.mark.parametrize("kwargs, want", [
    ({"zero": 3}, "QuantizeLinear 'x_q' zero point 3 != 0: TensorRT takes symmetric activations; train with preset "
                  "w8a8_sym"),
    ({"clip_between": True}, "Clip 'x_clip' reads the quantized tensor 'xq': TensorRT reads INT8 / INT4 tensors with "
                             "DequantizeLinear only"),
    ({"scale": -0.1}, "QuantizeLinear 'x_q' scale has values <= 0 or not finite"),
    ({"x_scale_shape": (4,)}, "QuantizeLinear 'x_q' quantizes an activation per channel (scale shape [4]): TensorRT "
                              "takes activations per tensor"),
    ({"w_axis": 1}, "DequantizeLinear 'w_dq' per-channel axis 1 is axis 1 of Gemm 'fc''s weight: TensorRT quantizes "
                    "weights per output channel (axis 0 there)"),
])
def test_hand_built_refusals_name_the_node(kwargs, want):
    reasons = check_tensorrt(_linear(**kwargs)).reasons
    assert any(r.startswith(want) for r in reasons), reasons


def test_contrib_op_run_time_scale_and_opset_are_named(tmp_path):
    # onnxruntime's contrib op (com.microsoft): no TensorRT importer
    contrib = _model([helper.make_node("FusedMatMul", ["x", "w"], ["y"], name="fused", domain="com.microsoft")],
                     {"w": np.ones((4, 3), np.float32)}, extra_opsets=("com.microsoft",))
    path = tmp_path / "contrib.onnx"
    onnx.save(contrib, str(path))
    reasons = check_tensorrt(path).reasons
    assert reasons == ["FusedMatMul 'fused' is a com.microsoft op, not standard ONNX: TensorRT's ONNX parser needs a "
                       "plugin for it (export without onnxruntime's contrib ops)"]
    # a scale computed from the data (a dynamic activation), and an opset beyond the parser's
    dynamic = _model([helper.make_node("ReduceMax", ["x"], ["m"], name="amax", keepdims=0),
                      helper.make_node("QuantizeLinear", ["x", "m", "z"], ["xq"], name="x_q"),
                      helper.make_node("DequantizeLinear", ["xq", "m", "z"], ["y"], name="x_dq")],
                     {"z": np.array(0, np.int8)}, opset=25)
    reasons = check_tensorrt(dynamic).reasons
    assert reasons[0] == "model opset 25 is outside TensorRT 10.15's parser range 9 to 24"
    assert any(r.startswith("QuantizeLinear 'x_q' scale is computed at run time") for r in reasons), reasons
    with pytest.raises(FileNotFoundError, match="no ONNX file"):
        check_tensorrt(tmp_path / "missing.onnx")
    with pytest.raises(TypeError, match="path, its bytes or an onnx.ModelProto"):
        check_tensorrt(3)
