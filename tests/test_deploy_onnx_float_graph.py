"""The float parts of intqat's ONNX files (intqat.deploy.onnx_graph): a residual Add before a LayerNormalization is
written as Sum (onnxruntime's SkipLayerNormalization fusion of Add -> LayerNormalization is the slower kernel on CPU),
and a plain 4-D scaled_dot_product_attention transposes k with one static Transpose (torchlib's translation computes
a 3-D reshape's shapes at run time). Both keep the values: checked against torch here and against the integer model
through export_onnx. Speed is measured by intqat-bench deploy, never asserted (docs/deploy.md, "ONNX")."""

import contextlib
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("onnxruntime", reason="the ONNX tests need onnx, onnxscript, onnxruntime (pip install 'intqat[deploy]')")
import onnx  # noqa: E402

import intqat  # noqa: E402
from intqat.deploy.onnx import export_onnx  # noqa: E402
from intqat.deploy.onnx_graph import float_translations, residual_adds_as_sum  # noqa: E402
from intqat.deploy.onnx_runtime import ort_graph, run_session, session  # noqa: E402

# float32 products and softmax in another library: torch's and onnxruntime's kernels sum in other orders
RTOL, ATOL = 1e-5, 1e-5


def _onnx(module: nn.Module, args: tuple, rewrite: bool = True) -> onnx.ModelProto:
    """torch.onnx.export of module with intqat's float translations (and its residual rewrite), batch dynamic."""
    program = torch.export.export(module, args, dynamic_shapes=[{0: torch.export.Dim("batch")}] * len(args))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        exported = torch.onnx.export(program, args, dynamo=True, opset_version=21, optimize=True,
                                     custom_translation_table=float_translations() if rewrite else None)
    if rewrite:
        residual_adds_as_sum(exported.model)
    return onnx.load_from_string(exported.model_proto.SerializeToString())


class Attention(nn.Module):
    def __init__(self, **sdpa):
        super().__init__()
        self.sdpa = sdpa

    def forward(self, q, k, v):  # (B, H, T, E) each
        return F.scaled_dot_product_attention(q, k, v, **self.sdpa)


def _qkv(b=2, h=2, t=5, e=8):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, t, e, generator=g) for _ in range(3))


@pytest.mark.parametrize("sdpa", [{}, {"scale": 0.3}], ids=["default scale", "explicit scale"])
def test_plain_attention_transposes_k_once_and_matches_torch(sdpa):
    module, args = Attention(**sdpa), _qkv()
    proto = _onnx(module, args)
    ops = [n.op_type for n in proto.graph.node]
    transposes = [[a.ints for a in n.attribute if a.name == "perm"][0] for n in proto.graph.node if n.op_type == "Transpose"]
    assert transposes == [[0, 1, 3, 2]] and "Shape" not in ops and "Concat" not in ops and "Reshape" not in ops, ops
    for batch in (1, 3):  # the batch stays dynamic
        x = tuple(a[:1].expand(batch, -1, -1, -1).contiguous() * (1 + i) for i, a in enumerate(args))
        got = run_session(session(proto.SerializeToString()), x)[0]
        torch.testing.assert_close(got, module(*x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("sdpa", [{"is_causal": True}, "bool mask"], ids=["causal", "bool mask"])
def test_other_attention_keeps_torchlibs_translation(sdpa):
    """A mask or is_causal goes to onnxscript's own translation (its run-time shapes are back), values the same."""
    q, k, v = _qkv()
    if sdpa == "bool mask":
        mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(1)) > 0.3
        mask.fill_diagonal_(True)

        class Masked(nn.Module):
            def forward(self, q, k, v):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        module = Masked()
    else:
        module = Attention(**sdpa)
    proto = _onnx(module, (q, k, v))
    assert "Shape" in [n.op_type for n in proto.graph.node]
    got = run_session(session(proto.SerializeToString()), (q, k, v))[0]
    torch.testing.assert_close(got, module(q, k, v), rtol=RTOL, atol=ATOL)


class Residual(nn.Module):
    def __init__(self, also_return_sum: bool = False):
        super().__init__()
        self.norm, self.also = nn.LayerNorm(16), also_return_sum

    def forward(self, x, r):  # (B, T, 16)
        s = x + r
        return (self.norm(s), s) if self.also else self.norm(s)


def test_residual_add_before_a_norm_is_a_sum_onnxruntime_leaves_unfused():
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 16, generator=g))
    module = Residual().eval()
    proto = _onnx(module, args)
    assert [n.op_type for n in proto.graph.node] == ["Sum", "LayerNormalization"]
    ran = ort_graph(proto.SerializeToString())["ops"]
    assert "SkipLayerNormalization" not in ran and ran.get("Sum") == 1, ran
    torch.testing.assert_close(run_session(session(proto.SerializeToString()), args)[0], module(*args),
                               rtol=RTOL, atol=ATOL)
    # the check can fail: the file as torch.onnx writes it is fused by onnxruntime
    plain = _onnx(module, args, rewrite=False)
    assert "SkipLayerNormalization" in ort_graph(plain.SerializeToString())["ops"]


def test_an_add_used_elsewhere_too_stays_an_add():
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 16, generator=g))
    ops = [n.op_type for n in _onnx(Residual(also_return_sum=True).eval(), args).graph.node]
    assert "Add" in ops and "Sum" not in ops, ops


def test_encoder_files_carry_both_rewrites_and_still_match_the_integer_model():
    """intqat.bench.blocks' encoder (torch's TransformerEncoderLayer), w8a8, both forms: two Sums before the two
    norms, k transposed once, no SkipLayerNormalization in what onnxruntime runs; the integer form bit for bit."""
    from intqat.bench.blocks import make_encoder

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, 32, generator=g),) for _ in range(2)]
    model = intqat.to_integer(make_encoder(32, 2, 64, 10).eval(), config="w8a8", calibration_data=batches).eval()
    for form in ("qdq", "int"):
        result = export_onnx(model, batches[0][0][:2], None, form=form, validation_data=batches)
        ops = [n.op_type for n in onnx.load_from_string(result.data).graph.node]
        assert ops.count("Sum") == 2 and "Concat" not in ops, (form, ops)
        assert "SkipLayerNormalization" not in result.info["onnxruntime_graph"]["ops"], form
        v = result.validation
        assert v["top1_agreement"] == 1.0, (form, v)
        assert v["bit_exact"] if form == "int" else v["max_diff_in_steps"] <= 1e-3, (form, v)
