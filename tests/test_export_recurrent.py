"""Models with recurrent layers export to every format (issue 23, item 7): an LSTM / GRU tagger (embedding ->
2-layer bidirectional nn.LSTM / nn.GRU -> linear head) under a dynamic batch. The recurrent layer stays float and is
named: in model.pt2's autocast report (rule recurrent_op: the cast pass once crashed on aten.lstm, "Cannot call
numel() on tensor with symbolic sizes/strides"), in the ONNX results' float layers, and by prepare_qat's census."""

import warnings

import pytest
import torch
from torch import nn

import intqat

RECURRENT = {"lstm": nn.LSTM, "gru": nn.GRU}


class Tagger(nn.Module):
    def __init__(self, rnn: str):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnn = RECURRENT[rnn](16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(48, 5)

    def forward(self, tokens):
        h, _ = self.rnn(self.emb(tokens))
        return self.head(h)


def tokens(n: int = 4):
    return torch.randint(0, 50, (n, 7))


@pytest.fixture(scope="module", params=list(RECURRENT))
def tagger(request):
    torch.manual_seed(0)
    model = Tagger(request.param)
    with pytest.warns(UserWarning, match="intqat has no integer recurrent layer"):  # prepare_qat's census names it
        intqat.prepare_qat(model, "w8a8")
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(tokens(8))
    intqat.to_integer(model)
    return request.param, model.eval()


def test_pt2_exports_with_the_recurrent_op_fp32(tagger):
    """bf16 float regions (the default of intqat-export), dynamic batch: the aten.lstm / gru node stays fp32 by the
    rule recurrent_op; the program runs any batch."""
    rnn, model = tagger
    data = [(tokens(8),) for _ in range(2)]
    result = intqat.export_mixed_precision(model, (tokens(4),), calibration_data=data, low_precision_type=torch.bfloat16)
    rows = [n for n in result.report.nodes if n.op.startswith(f"aten.{rnn}")]
    assert rows and all(n.precision == "fp32" and n.rule == "recurrent_op" for n in rows), rows
    out = result.program.module()(tokens(11))
    assert out.shape == (11, 7, 5) and out.dtype == torch.float32


@pytest.mark.parametrize("form", ["qdq", "int"])
def test_onnx_exports_with_the_recurrent_layer_float_and_named(tagger, form):
    pytest.importorskip("onnxruntime", reason="pip install 'intqat[deploy]'")
    from intqat.deploy.onnx import export_onnx

    rnn, model = tagger
    result = export_onnx(model, (tokens(2),), None, form=form, validation_data=[(tokens(9),)],
                         low_precision_type=torch.float16, calibration_data=[(tokens(8),)])
    assert result.float_layers["rnn"] == f"{RECURRENT[rnn].__name__}: intqat has no integer recurrent layer; its " \
                                         "weights compute in float"
    became = "QuantizeLinear, DequantizeLinear, MatMul" if form == "qdq" else "MatMulInteger"  # (3-D input: MatMul)
    assert [(c.name, c.became) for c in result.census] == [("head", became)]
    v = result.validation
    assert v["samples"] == 9 and v["max_diff_in_steps"] <= 1.0 and v["sqnr_db"] >= 30, v


@pytest.mark.slow  # ~30 s per model here: lowering unrolls the 2 x 2 directions x 7 steps of cells for XNNPACK
def test_pte_exports_with_the_recurrent_layer_float(tagger):
    """ExecuTorch: the head reaches XNNPACK; the recurrent layer runs in float (its cells' GEMMs fp32 in XNNPACK, the
    slicing between them in ExecuTorch's portable kernels, named in the report's float ops outside XNNPACK)."""
    pytest.importorskip("executorch", reason="pip install 'intqat[deploy]'")
    from intqat.deploy.executorch import export_pte

    _, model = tagger
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = export_pte(model, (tokens(2),), None, calibration_data=[(tokens(8),)],
                            validation_data=[(tokens(9),)], fp32_baseline=False, max_batch=16)
    assert [(c.name, c.where.split(" (")[0]) for c in result.census] == [("head", "XNNPACK")]
    assert result.info["float_ops_outside_xnnpack"]
    assert result.validation["top1_agreement"] == 1.0 and result.validation["max_diff_in_steps"] <= 1.0
