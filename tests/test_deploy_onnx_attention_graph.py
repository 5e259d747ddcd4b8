"""torch's MultiheadAttention in intqat's ONNX files (intqat.deploy.onnx_graph): the packed q / k / v heads written
as Split -> Reshape -> Transpose (split_packed_heads), and a batch_first attention's output without its last
Transpose (batch_first_out_projection). Both are data movement (and a row permutation of the out-projection's
GEMM), so onnxruntime's outputs must equal the unrewritten graph's element for element, at batch 1 and above; the
encoder's Q/DQ file stays 0 steps from the integer model and its integer file bit for bit. Speed is measured by
intqat-bench deploy, never asserted (docs/deploy.md, "Attention's heads")."""

import contextlib
import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime", reason="the ONNX tests need onnx, onnxscript, onnxruntime (pip install 'intqat[deploy]')")
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnxscript import ir  # noqa: E402

import intqat  # noqa: E402
import intqat.deploy.onnx as deploy_onnx  # noqa: E402
from intqat.deploy.onnx import export_onnx  # noqa: E402
from intqat.deploy.onnx_graph import batch_first_out_projection, float_translations, split_packed_heads  # noqa: E402
from intqat.deploy.onnx_runtime import ort_graph, run_session, session  # noqa: E402


def _exported(module: nn.Module, args: tuple):
    """torch.onnx.export (batch dynamic, intqat's float translations) -> the onnx_ir model, not rewritten."""
    program = torch.export.export(module, args, dynamic_shapes=[{0: torch.export.Dim("batch")}] * len(args))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return torch.onnx.export(program, args, dynamo=True, opset_version=21, optimize=True,
                                 custom_translation_table=float_translations()).model


def _bytes(model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def _ops(data: bytes) -> list[str]:
    return [n.op_type for n in onnx.load_from_string(data).graph.node]


class SelfAttention(nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=batch_first)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class CrossAttention(nn.Module):
    """key is value, not query: torch packs k and v (2 parts) and projects q alone."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, q, kv):
        return self.mha(q, kv, kv, need_weights=False)[0]


def _inputs(module: nn.Module, batch: int, seq: int = 6) -> tuple:
    g = torch.Generator().manual_seed(batch)
    count = 2 if isinstance(module, CrossAttention) else 1
    first = not getattr(getattr(module, "mha", None), "batch_first", True)
    shape = (seq, batch, 32) if first else (batch, seq, 32)
    return tuple(torch.randn(*shape, generator=g) for _ in range(count))


@pytest.mark.parametrize("module, heads, out", [(SelfAttention(True), 1, 1), (SelfAttention(False), 1, 0),
                                                (CrossAttention(), 1, 1)],
                         ids=["self batch_first", "self (T, B, E)", "cross batch_first"])
def test_rewritten_attention_equals_the_unrewritten_graph_in_onnxruntime(module, heads, out):
    """The same outputs element for element (torch.equal), at batch 1 and 3; the chain's small nodes are gone (its
    five-dimensional transpose and the per-part ones become one per part; the output's last one goes)."""
    module = module.eval()
    if not module.mha.batch_first:  # the batch is dim 1 here: export with it static (the rewrite does not care)
        args = _inputs(module, 2)
        program = torch.export.export(module, args)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            plain = torch.onnx.export(program, args, dynamo=True, opset_version=21, optimize=True,
                                      custom_translation_table=float_translations()).model
        batches = (2,)
    else:
        plain = _exported(module, _inputs(module, 2))
        batches = (1, 3)
    before = _bytes(plain)
    assert split_packed_heads(plain) == heads and batch_first_out_projection(plain) == out
    after = _bytes(plain)
    ops_before, ops_after = _ops(before), _ops(after)
    assert "Unsqueeze" not in ops_after and "Squeeze" not in ops_after and "Gather" not in ops_after, ops_after
    assert ops_after.count("Split") == ops_before.count("Split") + 1, ops_after
    assert ops_after.count("Transpose") == ops_before.count("Transpose") - 1 - out, ops_after
    a, b = session(before), session(after)
    for batch in batches:
        args = _inputs(module, batch)
        want, got = run_session(a, args)[0], run_session(b, args)[0]
        assert torch.equal(got, want), (batch, (got - want).abs().max())
        torch.testing.assert_close(got, module(*args), rtol=1e-5, atol=1e-5)  # and still torch's attention


def _out_chain(middle: list, extra: list) -> onnx.ModelProto:
    """x (B, H=2, T=3, d=4) -> Transpose(2, 0, 1, 3) -> Reshape (-1, 8) -> middle -> Reshape (3, -1, 8) ->
    Transpose(1, 0, 2) -> y: batch_first_out_projection's pattern with `middle` between the reshapes."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1, 3]),
             helper.make_node("Reshape", ["t", "flat"], ["m0"]), *middle,
             helper.make_node("Reshape", [f"m{len(middle)}", "back"], ["r"]),
             helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0, 2])]
    inits = [numpy_helper.from_array(np.array([-1, 8], np.int64), "flat"),
             numpy_helper.from_array(np.array([3, -1, 8], np.int64), "back"), *extra]
    graph = helper.make_graph(nodes, "out", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_out_projection_rewrite_takes_row_wise_ops_only():
    """A Gemm on a constant weight and a per-column bias are row by row: rewritten, the same values; an Add of a
    (rows, E) constant depends on the row order: left as it is."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    rows = numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "rows")
    x = torch.from_numpy(rng.standard_normal((2, 2, 3, 4)).astype(np.float32))
    cases = {"gemm": ([helper.make_node("Gemm", ["m0", "w", "b"], ["m1"], transB=1)], [w, b], 1),
             "row add": ([helper.make_node("Add", ["m0", "rows"], ["m1"])], [rows], 0)}
    for name, (middle, extra, expected) in cases.items():
        proto = _out_chain(middle, extra)
        model = ir.serde.deserialize_model(proto)
        model.graph.inputs[0].shape = ir.Shape([2, 2, 3, 4])
        assert batch_first_out_projection(model) == expected, name
        rewritten = _bytes(model)
        assert _ops(rewritten).count("Transpose") == 2 - expected, name
        want = run_session(session(proto.SerializeToString()), (x,))[0]
        assert torch.equal(run_session(session(rewritten), (x,))[0], want), name


@pytest.fixture(scope="module")
def encoder():
    """intqat.bench.blocks' encoder (torch's TransformerEncoderLayer, batch_first), small, w8a8 integer."""
    from intqat.bench.blocks import make_encoder

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, 32, generator=g),) for _ in range(2)]
    return intqat.to_integer(make_encoder(32, 2, 64, 10).eval(), config="w8a8", calibration_data=batches).eval(), \
        batches


@pytest.mark.parametrize("form", ["qdq", "int"])
def test_encoder_files_exact_and_equal_to_the_unrewritten_files(encoder, form, monkeypatch):
    """Both forms through export_onnx: the Q/DQ file 0 steps from the integer model, the integer file bit for bit;
    the files without the two rewrites give the same outputs element for element; onnxruntime runs fewer nodes."""
    model, batches = encoder
    result = export_onnx(model, batches[0][0][:2], None, form=form, validation_data=batches)
    v = result.validation
    assert v["bit_exact"] and v["max_diff_in_steps"] == 0 and v["top1_agreement"] == 1.0, (form, v)
    monkeypatch.setattr(deploy_onnx, "split_packed_heads", lambda model: 0)
    monkeypatch.setattr(deploy_onnx, "batch_first_out_projection", lambda model: 0)
    plain = export_onnx(model, batches[0][0][:2], None, form=form, validation_data=batches)
    ran, ran_plain = result.info["onnxruntime_graph"]["ops"], plain.info["onnxruntime_graph"]["ops"]
    assert "Squeeze" not in ran and "Unsqueeze" not in ran and ran.get("Transpose") == 2 and ran.get("Split") == 1, ran
    assert sum(ran.values()) == sum(ran_plain.values()) - 16, (ran, ran_plain)  # (onnxruntime 1.32: 44 -> 28 Q/DQ)
    a, b = session(result.data), session(plain.data)
    for batch in (1, 5):
        x = torch.randn(batch, 8, 32, generator=torch.Generator().manual_seed(batch))
        assert torch.equal(run_session(a, (x,))[0], run_session(b, (x,))[0]), (form, batch)


def test_fp32_baseline_gets_the_same_rewrites(encoder):
    """The bench's fp32 file is written by the same _to_onnx: its attention is rewritten too (a ratio between the
    files measures the quantized layers, not the graph)."""
    from intqat.deploy.qdq import _integer_copy

    model, batches = encoder
    data = deploy_onnx._fp32_file(model, _integer_copy(model).eval(), (batches[0][0][:2],), None, 21)
    ran = ort_graph(data)["ops"]
    assert "Squeeze" not in ran and ran.get("Split") == 1 and ran.get("Transpose") == 2, ran
