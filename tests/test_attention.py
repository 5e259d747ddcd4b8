"""Integer nn.MultiheadAttention (intqat.nn.attention) and the transformer layers around it.

Numeric intent: the attention arithmetic between the projections is MHA's own (compared with
nn.MultiheadAttention through float projections: equal within 1e-6, fp32 op-order noise at most);
integer results are compared exactly (eval with and without grad, deployed module, exported program);
against the float model the integer one is lossy: SQNR.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat.nn import DeployedIntMultiheadAttention, FakeQuantMultiheadAttention, IntLinear, IntMultiheadAttention
from intqat.nn.attention import mha_forward


def sqnr(ref, x):
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


class _FloatProjections(nn.Module):
    """MHA's attributes with float projections through mha_forward: checks everything but the GEMMs."""

    def __init__(self, mha):
        super().__init__()
        self.m = mha
        for name in ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout", "batch_first",
                     "head_dim", "add_zero_attn", "bias_k", "bias_v"):
            setattr(self, name, getattr(mha, name))
        self.out_proj = mha.out_proj

    def project(self, group, x, rows):
        m = self.m
        w = m.in_proj_weight[rows] if m._qkv_same_embed_dim else getattr(m, f"{group}_proj_weight")
        b = None if m.in_proj_bias is None else m.in_proj_bias[rows]
        return F.linear(x, w, b)

    def forward(self, *args, **kwargs):
        return mha_forward(self, self.project, *args, **kwargs)


CASES = {
    "self-batch_first": dict(kw=dict(batch_first=True), call="self"),
    "self-seq_first-weights": dict(kw=dict(), call="self", need_weights=True),
    "cross-kv": dict(kw=dict(batch_first=True), call="kv"),
    "qkv-separate-inputs": dict(kw=dict(batch_first=True), call="qkv"),
    "kdim-vdim": dict(kw=dict(batch_first=True, kdim=12, vdim=20), call="qkv"),
    "bias_kv-zero_attn-no-bias": dict(kw=dict(batch_first=True, add_bias_kv=True, add_zero_attn=True, bias=False),
                                      call="self", need_weights=True),
    "causal": dict(kw=dict(batch_first=True), call="self", causal=True),
    "padding-and-mask": dict(kw=dict(batch_first=True), call="self", padding=True, mask=True),
    "padding-weights-per-head": dict(kw=dict(), call="kv", padding=True, need_weights=True, average=False),
    "unbatched": dict(kw=dict(), call="self", unbatched=True),
}


def _inputs(case, E=16, B=3, L=5, S=7):
    kw = case["kw"]
    bf = kw.get("batch_first", False)
    shape = (lambda n, d: (B, n, d) if bf else (n, B, d)) if not case.get("unbatched") else (lambda n, d: (n, d))
    q = torch.randn(shape(L, E))
    if case["call"] == "self":
        k = v = q
    elif case["call"] == "kv":
        k = v = torch.randn(shape(S, E))
    else:
        k, v = torch.randn(shape(S, kw.get("kdim", E))), torch.randn(shape(S, kw.get("vdim", E)))
    src = q.shape[-2] if case["call"] == "self" and (bf or case.get("unbatched")) else (k.shape[1] if bf else k.shape[0])
    opts = dict(need_weights=case.get("need_weights", False), average_attn_weights=case.get("average", True))
    if case.get("causal"):
        opts.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(L), is_causal=True)
    if case.get("mask"):
        opts["attn_mask"] = torch.rand(L, src) < 0.2
    if case.get("padding"):
        pad = torch.zeros(B, src, dtype=torch.bool)
        pad[0, -2:] = True
        opts["key_padding_mask"] = pad
    return (q, k, v), opts


@pytest.mark.parametrize("name", list(CASES))
def test_mha_semantics_match_torch(name):
    """Everything between the projections is MHA's: float projections through mha_forward == nn.MHA."""
    torch.manual_seed(0)
    case = CASES[name]
    mha = nn.MultiheadAttention(16, 4, **case["kw"]).eval()
    args, opts = _inputs(case)
    with torch.no_grad():
        ref_out, ref_w = mha(*args, **opts)
        out, w = _FloatProjections(mha).eval()(*args, **opts)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=0)
    assert (w is None) == (ref_w is None)
    if w is not None:
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)


def _observe(model, *args, **kwargs):
    model.train()
    with torch.no_grad():
        model(*args, **kwargs)
    intqat.freeze_observers(model)


@pytest.mark.parametrize("name", list(CASES))
def test_integer_mha_is_close_to_float_and_deploys_exactly(name):
    torch.manual_seed(0)
    case = CASES[name]
    mha = nn.MultiheadAttention(16, 4, **case["kw"])
    params = dict(mha.named_parameters())
    keys = set(mha.state_dict())
    args, opts = _inputs(case)
    with torch.no_grad():
        ref = mha.eval()(*args, **opts)[0]
    wrapper = nn.ModuleDict({"attn": mha})
    intqat.prepare_qat(wrapper, "w8a8")
    assert type(wrapper.attn) is FakeQuantMultiheadAttention
    _observe(wrapper.attn, *args, **opts)
    intqat.to_integer(wrapper)
    attn = wrapper.attn
    assert type(attn) is IntMultiheadAttention and type(attn.out_proj) is IntLinear
    # the same Parameter objects under the same names; the original state_dict keys are all still there
    assert all(dict(attn.named_parameters())[n] is p for n, p in params.items())
    assert keys <= set(attn.state_dict())
    attn.eval()
    with torch.no_grad():
        out_nograd, w_nograd = attn(*args, **opts)
    out, w = attn(*args, **opts)  # grad enabled: the differentiable op; the same bits
    assert torch.equal(out_nograd, out.detach())
    assert sqnr(ref, out_nograd) > 25, sqnr(ref, out_nograd)
    deployed = intqat.to_deployed(wrapper).attn
    assert type(deployed) is DeployedIntMultiheadAttention
    with torch.no_grad():
        assert torch.equal(deployed(*args, **opts)[0], out_nograd)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a8_dynamic", "w8a8_lsq", "w4a8"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "separate-kdim"])
def test_integer_mha_trains(cfg, packed):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, **({} if packed else {"kdim": 16 + 4, "vdim": 16 + 4}))
    model = nn.Sequential()
    model.attn = mha
    x, target = torch.randn(8, 6, 16), torch.randn(8, 6, 16)
    kv = x if packed else torch.randn(8, 6, 20)
    intqat.prepare_qat(model, cfg)
    _observe(model.attn, x, kv, kv)
    intqat.to_integer(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = F.mse_loss(model.attn(x, kv, kv, need_weights=False)[0], target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    w = mha.in_proj_weight if packed else mha.k_proj_weight
    assert w.grad is not None and mha.out_proj.weight.grad is not None
    model.eval()
    with torch.no_grad():
        y = model.attn(x, kv, kv)[0]
        assert torch.equal(intqat.to_deployed(model).attn(x, kv, kv)[0], y)


def test_cross_attention_call_on_a_self_attention_layer_names_the_quantizer():
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    model = nn.ModuleDict({"attn": mha})
    x = torch.randn(2, 5, 16)
    intqat.prepare_qat(model, "w8a8")
    _observe(model.attn, x, x, x)  # only self-attention: the k quantizer never sees data
    intqat.to_integer(model)
    model.eval()
    with pytest.raises(RuntimeError, match="no scale yet"):
        model.attn(x, torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    deployed = intqat.to_deployed(model).attn
    with pytest.raises(RuntimeError, match="k_input_quantizer"):
        deployed(x, torch.randn(2, 3, 16), torch.randn(2, 3, 16))


# -- nn.TransformerEncoder / DecoderLayer: fast paths --------------------------------------------------


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


def _train_steps(model, x, steps, forward=None):
    forward = forward or (lambda: model(x))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    target = torch.randn_like(forward())
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(forward(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("padding", [False, True], ids=["no-mask", "key-padding"])
def test_encoder_fast_path_never_runs_float_weights(padding):
    """In eval under no_grad torch's fused encoder kernels read linear1.weight / in_proj_weight directly:
    the converted encoder must run its integer layers there (== its own grad-enabled forward, != float)."""
    enc, x = _encoder(), torch.randn(4, 8, 32)
    pad = torch.zeros(4, 8, dtype=torch.bool)
    pad[1, -3:] = True
    kw = {"src_key_padding_mask": pad} if padding else {}
    with torch.no_grad():
        ref = enc.eval()(x, **kw)
    intqat.prepare_qat(enc, "w8a8")
    _observe(enc, x, **kw)  # no weight moves: the float model stays the reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every linear-like layer converts: nothing to warn about
        intqat.to_integer(enc)
    assert not enc.use_nested_tensor and all(not la.activation_relu_or_gelu for la in enc.layers)
    enc.eval()
    with torch.no_grad():
        fast = enc(x, **kw)
    slow = enc(x, **kw)  # grad enabled: torch takes the slow path anyway
    assert torch.equal(fast, slow.detach())
    keep = ~pad  # torch's nested-tensor path (the float reference) returns 0 at padded positions
    assert not torch.equal(fast, ref) and sqnr(ref[keep], fast[keep]) > 15
    # the same with one layer called directly (its own fast-path check)
    with torch.no_grad():
        assert torch.equal(enc.layers[0](x), enc.layers[0](x.requires_grad_()).detach())


def test_encoder_exports_and_equals_the_integer_model(tmp_path):
    enc, x = _encoder(), torch.randn(4, 8, 32)
    intqat.prepare_qat(enc, "w8a8")
    enc.train()
    losses = _train_steps(enc, x, 4)
    intqat.to_integer(enc)
    losses += _train_steps(enc, x, 6)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[4]
    result = intqat.export_mixed_precision(enc, (x,))
    enc.eval()
    with torch.no_grad():
        assert torch.equal(result.reference.module()(x), enc(x))
    assert result.validation["reference_equals_integer_model"] is True
    ops = {str(n.target) for n in result.reference.graph.nodes if n.op == "call_function"}
    assert "aten._int_mm.default" in ops and not any(o.startswith("intqat") for o in ops)
    # no float GEMM on a weight is left: every matmul-like op left is the attention's q @ kᵀ / p @ v
    assert not {"aten.linear.default", "aten.addmm.default"} & ops


def test_decoder_layer_converts_and_runs_cross_attention():
    torch.manual_seed(0)
    dec = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    tgt, mem = torch.randn(2, 6, 32), torch.randn(2, 9, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad():
        ref = dec.eval()(tgt, mem, tgt_mask=mask, tgt_is_causal=True)
    intqat.prepare_qat(dec, "w8a8")
    dec.train()
    _train_steps(dec, tgt, 2, lambda: dec(tgt, mem, tgt_mask=mask, tgt_is_causal=True))
    intqat.to_integer(dec)
    assert type(dec.self_attn) is IntMultiheadAttention and type(dec.multihead_attn) is IntMultiheadAttention
    dec.eval()
    with torch.no_grad():
        out = dec(tgt, mem, tgt_mask=mask, tgt_is_causal=True)
        assert torch.equal(intqat.to_deployed(dec)(tgt, mem, tgt_mask=mask, tgt_is_causal=True), out)
    assert sqnr(ref, out) > 15
