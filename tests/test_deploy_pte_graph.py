""".pte: the graph rewrites for XNNPACK keep the program's values and cut its delegate calls; the latency carries
the runtime's floor and the C++ runner's figures; the size breakdown adds up.

Tolerances: the rewritten attention computes the same formula as torch's math SDPA (sqrt(scale) on q and k, bmm,
softmax, bmm) where the original program runs SDPA's fused CPU kernel, so the two agree to float rounding:
rtol 1e-5, atol 1e-6 on outputs of magnitude ~1. No timing is asserted (ratios are the bench's), only that each
figure was measured.
"""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("executorch", reason="the .pte tests need ExecuTorch (pip install 'intqat[deploy]')")

import intqat  # noqa: E402
from intqat.bench.blocks import make_encoder  # noqa: E402
from intqat.deploy.executorch import _export, export_pte  # noqa: E402
from intqat.deploy.lower import lower_xnnpack  # noqa: E402
from intqat.deploy.pte_size import pte_parts  # noqa: E402
from intqat.deploy.qdq import qdq_layers, to_qdq  # noqa: E402
from intqat.deploy.xnnpack_graph import rewrite_for_xnnpack  # noqa: E402


@pytest.fixture(scope="module")
def encoder():
    """A small encoder block (d 32, 2 heads, seq 8) in intqat's integer w8a8 form, calibrated on random data."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, 32, generator=g),) for _ in range(2)]
    model = intqat.to_integer(copy.deepcopy(make_encoder(32, 2, 64, 10).eval()), config="w8a8",
                              calibration_data=batches).eval()
    return model, batches


def test_rewrites_keep_the_values_and_cut_delegate_calls(encoder):
    model, batches = encoder
    qdq = to_qdq(model)
    x = torch.randn(3, 8, 32)
    before = _export(qdq, (batches[0][0][:2],), 64)
    after = _export(qdq, (batches[0][0][:2],), 64)
    counts = rewrite_for_xnnpack(after)
    assert counts["unmasked_sdpa"] == 1 and counts["static_reshapes"] >= 1, counts
    assert not any(n.target == torch.ops.aten.scaled_dot_product_attention.default for n in after.graph.nodes)
    want, got = before.module()(x), after.module()(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    layers = list(qdq_layers(qdq))
    calls = [lower_xnnpack(p, layers).delegate_calls for p in (before, after)]
    assert calls[1] < calls[0], calls  # (measured: 13 -> 6 on the bench's encoder)


def test_masked_attention_is_left_as_it_is():
    """A causal mask: the rewrite does not apply (its all -inf rows are what _safe_softmax handles)."""

    class Causal(nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    program = torch.export.export(Causal(), (torch.randn(2, 2, 8, 16),))
    assert rewrite_for_xnnpack(program)["unmasked_sdpa"] == 0


def test_latency_has_the_floor_and_the_cpp_runner_and_the_census_is_unchanged(encoder):
    model, batches = encoder
    result = export_pte(model, (batches[0][0][:2],), calibration_data=batches, validation_data=batches,
                        latency_batches=(1,), latency_repeats=3)
    assert {c.name: c.where for c in result.census} == {
        "layer.self_attn.in_proj.qkv": "XNNPACK", "layer.self_attn.out_proj": "XNNPACK", "layer.linear1": "XNNPACK",
        "layer.linear2": "XNNPACK", "head": "XNNPACK (fp32 GEMM, int8-quantized input)"}
    assert result.info["graph_rewrites"]["unmasked_sdpa"] == 1
    assert result.latency["cpp"] == "measured", result.latency["cpp"]  # (g++ and the wheel's headers are here)
    t = result.latency["per_batch"][1]
    for figures in (t, t["cpp"]):
        assert figures["floor_ms"] > 0 and figures["int8_ms"] > 0 and figures["fp32_ms"] > 0
        assert figures["int8_above_floor_ms"] == pytest.approx(figures["int8_ms"] - figures["floor_ms"])
    md = result.to_markdown()
    assert "floor" in md and "C++" in md and "delegate calls per forward" in md
    parts = result.size["int8_parts"]
    assert parts["program"] + parts["delegate_payloads"] + parts["constant_data"] + parts["padding_and_header"] \
        == parts["total"] == len(result.buffer)
    assert 0 <= parts["padding_and_header"] < 4096


def test_pte_parts_of_the_digits_sized_mlp():
    """int8 weights are stored once (no fp32 copy): the constants are the int8 codes, the fp32 head kept by the
    model-output rule, and per-channel scales / biases."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    data = [(torch.randn(16, 1, 8, 8),) for _ in range(2)]
    model = intqat.to_integer(model.eval(), config="w8a8", calibration_data=data).eval()
    result = export_pte(model, (data[0][0][:2],), calibration_data=data, validation_data=data, fp32_baseline=False)
    parts = pte_parts(result.buffer)
    assert parts["largest_constants"][:3] == [128 * 128, 64 * 128, 10 * 128 * 4]  # int8, int8, the fp32 head
    small = parts["constant_data"] - sum(parts["largest_constants"][:3])
    assert small == 2 * (3 * 128 * 4) + 10 * 4  # per layer: weight scales, int32 bias, bias scales; the head's bias
