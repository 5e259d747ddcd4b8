""".pte: the graph rewrites for XNNPACK (intqat/deploy/xnnpack_graph.py) keep the program's values, cut its
delegate calls and leave the census as it was. (The floor, the C++ runner and the size parts are checked on the
digits MLP's report in tests/test_deploy_pte.py::test_cli_format_pte_of_a_run_directory, which measures them anyway.)

Tolerances: the rewritten attention computes the same formula as torch's math SDPA (sqrt(scale) on q and k, bmm,
softmax, bmm) where the original program runs SDPA's fused CPU kernel, so the two agree to float rounding:
rtol 1e-5, atol 1e-6 on outputs of magnitude ~1.
"""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("executorch", reason="the .pte tests need ExecuTorch (pip install 'intqat[deploy]')")

import intqat  # noqa: E402
from intqat.bench.blocks import make_encoder  # noqa: E402
from intqat.deploy.executorch import _export, _lower  # noqa: E402
from intqat.deploy.qdq import to_qdq  # noqa: E402
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
    lowered = _lower(qdq, (batches[0][0][:2],), 64, batches, None)[0]  # (export_pte's: rewrites, int8 outputs)
    assert lowered.rewrites == counts
    # without the rewrites: 13 delegate calls, and _safe_softmax's where / eq / any and a 4-D matmul's expand_copy
    # outside XNNPACK (measured; not lowered again here to keep the file's time down)
    assert lowered.delegate_calls <= 6, lowered.delegate_calls
    outside = set(lowered.float_ops_outside)
    assert not outside & {"aten.where.self", "aten.expand_copy.default", "aten.mul.Scalar", "aten.eq.Scalar"}, outside
    assert lowered.taken == lowered.present and len(lowered.taken) == 5  # the census: every layer forward calls, XNNPACK


def test_masked_attention_is_left_as_it_is():
    """A causal mask: the rewrite does not apply (its all -inf rows are what _safe_softmax handles)."""

    class Causal(nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    program = torch.export.export(Causal(), (torch.randn(2, 2, 8, 16),))
    assert rewrite_for_xnnpack(program)["unmasked_sdpa"] == 0
