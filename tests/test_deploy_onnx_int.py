"""The integer ONNX form (export_onnx(form="int"), model.int.onnx): MatMulInteger / ConvInteger into int32 and intqat's
fp32 epilogue after them, run in onnxruntime (CPU), equals the integer model bit for bit (torch.equal) for every
preset x layer type; a model whose float ops onnxruntime computes in its own order (LayerNorm, softmax, GELU, means)
is compared within a stated tolerance (docs/numerics.md, "ONNX forms")."""


import pytest
import torch
from torch import nn

import intqat

pytest.importorskip("onnxruntime", reason="the ONNX tests need onnx, onnxscript, onnxruntime (pip install 'intqat[deploy]')")
from intqat.deploy.onnx import export_onnx  # noqa: E402
from intqat.deploy.onnx_runtime import run_session, session  # noqa: E402
from intqat.deploy.qdq import _integer_copy  # noqa: E402
from qat_helpers import integer  # noqa: E402

EMB8 = {"bits": 8, "granularity": "channel"}
PRESETS = {
    "w8a8": {"preset": "w8a8", "embedding": EMB8},
    "w8a8_dynamic": {"preset": "w8a8_dynamic", "embedding": EMB8},
    "8da4w": {"preset": "8da4w", "weight": {"group_size": 16},
              "embedding": {"bits": 4, "granularity": "group", "group_size": 16}},
}
# the float ops of a transformer block (LayerNorm, softmax, GELU) are onnxruntime's kernels, which sum and round in
# their own order: measured here at most ~1e-3 steps of the output's int8 grid; 0.5 step still catches a wrong scale
BLOCK_MAX_STEPS = 0.5


class Layers(nn.Module):
    """One output per integer layer, each computed from the inputs by that layer alone (no float op between that
    onnxruntime could round otherwise): embedding, nn.Linear on 2-D and 3-D input, HF Conv1D, conv 3x3 (stride 2),
    depthwise 3x3 (dilation 2), grouped 3x3, pointwise 1x1. Under 8da4w the linear layers are per-group (8da4w's
    GroupedIntLinear) and the convs stay float."""

    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.emb = nn.Embedding(64, 32)
        self.lin = nn.Linear(32, 48)
        self.lin3d = nn.Linear(32, 24)
        self.conv1d = Conv1D(40, 32)  # (nf, nx): weight (in, out)
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=16)
        self.grouped = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.pw = nn.Conv2d(16, 8, 1)

    def forward(self, tokens, x, seq, seq2, image, feat):
        return (self.emb(tokens), self.lin(x), self.lin3d(seq), self.conv1d(seq2), self.stem(image), self.dw(feat),
                self.grouped(feat), self.pw(feat))


def layers_data(n: int = 8):
    return (torch.randint(0, 64, (n, 6)), torch.randn(n, 32), torch.randn(n, 5, 32), 2 * torch.randn(n, 4, 32),
            torch.randn(n, 3, 9, 9), torch.randn(n, 16, 6, 6))


def _run_equal(result, model, data, outputs=None):
    """The file in onnxruntime against the integer model on fresh data: the outputs (indices; default all)
    torch.equal; the others (float layers' outputs) within 1e-5 relative."""
    sess = session(result.data)
    reference = _integer_copy(model).eval()
    got = run_session(sess, data)
    with torch.no_grad():
        want = reference(*data)
    want = list(want) if isinstance(want, tuple) else [want]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if outputs is None or i in outputs:
            assert g.dtype == w.dtype and torch.equal(g, w), (i, float((g - w).abs().max()))
        else:  # a float layer: onnxruntime's fp32 kernel sums in its own order
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_layer_type_equals_the_integer_model_bit_for_bit(preset):
    torch.manual_seed(0)
    model = integer(Layers(), PRESETS[preset], [layers_data() for _ in range(3)])
    ex = tuple(t[:2] for t in layers_data())
    result = export_onnx(model, ex, None, form="int", validation_data=[layers_data(17)])
    became = {c.name: c.became for c in result.census}
    if preset == "8da4w":  # per-group linear layers; convs float (named), embedding int4 per group
        assert became == {"emb": "Gather", "lin": "MatMulInteger", "lin3d": "MatMulInteger", "conv1d": "MatMulInteger"}
        assert {"stem", "dw", "grouped", "pw"} <= set(result.float_layers)
        kinds = {c.kind for c in result.census}
        assert kinds == {"DeployedIntEmbedding", "DeployedGroupedIntLinear"}
    else:
        assert became == {"emb": "Gather", "lin": "MatMulInteger", "lin3d": "MatMulInteger",
                          "conv1d": "MatMulInteger", "stem": "ConvInteger", "dw": "ConvInteger",
                          "grouped": "ConvInteger", "pw": "ConvInteger"}
    if preset == "8da4w":  # the float convs' outputs are onnxruntime's fp32 Conv: not compared bit for bit
        _run_equal(result, model, layers_data(33), outputs=(0, 1, 2, 3))
        return
    assert result.validation["bit_exact"] and result.validation["max_abs_diff"] == 0.0, result.validation
    _run_equal(result, model, layers_data(33))  # a batch the trace never saw


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_dynamic"])
def test_depthwise_separable_block_bit_for_bit(preset):
    """conv -> BN (folded) -> ReLU6 -> depthwise -> ReLU6 -> pointwise -> ReLU -> flatten -> linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.ReLU6(), nn.Conv2d(16, 32, 1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    data = [(torch.randn(8, 3, 8, 8),) for _ in range(3)]
    model.train()
    with torch.no_grad():
        for (x,) in data:  # BatchNorm statistics, then folded into the conv by prepare_qat
            model(x)
    integer(model, preset, data)
    result = export_onnx(model, data[0][0][:2], None, form="int", validation_data=data)
    assert [c.became for c in result.census] == ["ConvInteger"] * 3 + ["MatMulInteger"]
    assert result.validation["bit_exact"], result.validation
    _run_equal(result, model, (torch.randn(5, 3, 8, 8),))


def test_chained_int8_layers_pass_codes_and_stay_exact():
    """intqat.chain_int8: the producer's MatMulInteger output requantized to its consumer's grid (ReLU as a max on the
    codes), the consumer takes the int8 codes: the same numbers as the deployed chain."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    data = [(torch.randn(8, 16),) for _ in range(3)]
    integer(model, "w8a8", data)
    intqat.freeze_observers(model)
    assert intqat.chain_int8(model)
    result = export_onnx(model, data[0][0][:2], None, form="int", validation_data=data)
    assert result.validation["bit_exact"], result.validation
    _run_equal(result, model, (torch.randn(3, 16),))


@pytest.mark.parametrize("preset", ["w8a8", "w8a8_dynamic"])
def test_transformer_block_within_tolerance(preset):
    """A BERT-tiny-like encoder layer (nn.MultiheadAttention: its projections; LayerNorm, GELU, softmax in float):
    every projection is a MatMulInteger; the float ops are onnxruntime's, so the output is within BLOCK_MAX_STEPS."""
    from intqat.bench.blocks import make_encoder

    torch.manual_seed(0)
    model = make_encoder(32, 2, 64, 10).eval()
    data = [(torch.randn(4, 8, 32),) for _ in range(3)]
    model = intqat.to_integer(model, config=preset, calibration_data=data).eval()
    result = export_onnx(model, data[0][0][:2], None, form="int", validation_data=data)
    assert len(result.census) >= 5 and all(c.became == "MatMulInteger" for c in result.census), result.census
    v = result.validation
    assert v["top1_agreement"] == 1.0 and v["max_diff_in_steps"] <= BLOCK_MAX_STEPS, v
