"""Per-group integer modules and quantized embeddings: the 8da4w preset end to end.

Training forward == eval forward == deployed module == exported program, all torch.equal; tied
lm_head / embedding stay one Parameter in training and one buffer when deployed; the exported
program holds only aten ops.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import intqat
from intqat.config import QuantConfig, QuantSpec, resolve_config
from intqat.nn import (
    DeployedGroupedIntLinear,
    DeployedIntEmbedding,
    FakeQuantEmbedding,
    FakeQuantGroupedLinear,
    GroupedIntLinear,
    IntEmbedding,
)
from intqat.ops.int_linear_grouped import dequantize_weight_grouped, quantize_weight_grouped

CFG = {"preset": "8da4w", "embedding": {"bits": 4, "granularity": "group", "group_size": 32}}


class TinyLM(nn.Module):
    def __init__(self, vocab=48, d=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, 128)
        self.fc2 = nn.Linear(128, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(h + self.fc2(torch.relu(self.fc(h))))


def test_preset_8da4w_and_group_size_override():
    cfg = resolve_config("8da4w")
    assert (cfg.weight.bits, cfg.weight.granularity, cfg.weight.group_size) == (4, "group", 32)
    assert cfg.activation.dynamic and cfg.activation.granularity == "token" and cfg.embedding is None
    cfg = resolve_config({"preset": "8da4w", "weight": {"group_size": 128}})
    assert cfg.weight.group_size == 128 and cfg.weight.bits == 4
    g128 = resolve_config("w8a8_g128")
    assert (g128.weight.bits, g128.weight.group_size) == (8, 128)
    back = resolve_config({"preset": "8da4w", "weight": {"granularity": "channel"}})  # group_size dropped
    assert back.weight.granularity == "channel" and back.weight.group_size is None
    assert resolve_config(CFG).embedding == QuantSpec(bits=4, granularity="group", group_size=32)


def test_embedding_spec_rejected_when_not_symmetric_per_channel_or_group():
    with pytest.raises(ValueError, match="embedding weights are symmetric, per channel or per group"):
        QuantConfig(embedding=QuantSpec(granularity="tensor"))


def test_prepare_and_convert_keep_parameters_and_tie():
    torch.manual_seed(0)
    m = TinyLM()
    params = {id(p) for p in m.parameters()}
    intqat.prepare_qat(m, CFG)
    assert isinstance(m.fc, FakeQuantGroupedLinear) and isinstance(m.emb, FakeQuantEmbedding)
    assert isinstance(m.head, FakeQuantGroupedLinear) and m.head.weight is m.emb.weight
    intqat.to_integer(m)
    assert isinstance(m.fc, GroupedIntLinear) and isinstance(m.emb, IntEmbedding) and m.head.weight is m.emb.weight
    assert {id(p) for p in m.parameters()} == params
    intqat.prepare_qat(m, CFG)  # twice: a no-op
    assert isinstance(m.fc, GroupedIntLinear)


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="group_size=32 must be a positive divisor of K=48"):
        FakeQuantGroupedLinear.from_linear(nn.Linear(48, 8), "8da4w")


def test_train_eval_deployed_exported_are_equal():
    torch.manual_seed(0)
    m = intqat.to_integer(intqat.prepare_qat(TinyLM(), CFG))
    idx = torch.randint(0, 48, (3, 10))
    y_train = m(idx)  # the custom op (grad enabled, weights require grad)
    y_train.sum().backward()
    with torch.no_grad():
        y_eval = m.eval()(idx)
    assert torch.equal(y_train.detach(), y_eval)
    dep = intqat.to_deployed(m)
    assert isinstance(dep.fc, DeployedGroupedIntLinear) and isinstance(dep.emb, DeployedIntEmbedding)
    assert dep.head.q_w is dep.emb.q_w and dep.head.w_scale is dep.emb.w_scale  # tied: one buffer
    with torch.no_grad():
        assert torch.equal(dep(idx), y_eval)
    ep = torch.export.export(dep, (idx,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert all(t.startswith("aten.") for t in targets), targets
    assert torch.equal(ep.module()(idx), y_eval)
    codes = {name: b for name, b in ep.named_buffers() if name.endswith("q_w")}
    assert codes["head.q_w"] is codes["emb.q_w"]  # the program stores the tied codes once
    assert len({id(b) for b in codes.values()}) == 3


def test_fake_quant_matches_integer_within_fp32_accumulation():
    torch.manual_seed(1)
    lin = nn.Linear(128, 40)
    fq = FakeQuantGroupedLinear.from_linear(copy.deepcopy(lin), "8da4w")
    x = torch.randn(16, 128)
    y_fq = fq(x)
    y_int = GroupedIntLinear.from_fake_quant(fq)(x)
    sqnr = 10 * torch.log10(y_int.pow(2).sum() / (y_int - y_fq).pow(2).sum())
    assert sqnr > 80  # the same codes; only the fp32 accumulation order differs


def test_fake_quant_weight_codes_equal_the_ops():
    torch.manual_seed(2)
    w = torch.randn(24, 96)
    fq = FakeQuantGroupedLinear.from_linear(nn.Linear(96, 24), "8da4w")
    q_w, _, s_w = quantize_weight_grouped(w, None, 32, -7, 7)
    assert torch.equal(fq.weight_quantizer.fake_quant(w), dequantize_weight_grouped(q_w, s_w))


def test_embedding_int_forward_equals_fake_quant_and_gradient_is_ste():
    torch.manual_seed(3)
    emb = nn.Embedding(30, 64, padding_idx=0)
    cfg = {"preset": "8da4w", "embedding": {"bits": 8, "granularity": "channel"}}
    fq = FakeQuantEmbedding.from_embedding(emb, cfg)
    ie = IntEmbedding.from_fake_quant(fq)
    idx = torch.tensor([[0, 3, 3, 29]])
    y = ie(idx)
    y.sum().backward()
    with torch.no_grad():
        assert torch.equal(ie(idx), fq(idx)) and torch.equal(y.detach(), fq(idx))
    expected = torch.zeros(30, 64)
    expected[3], expected[29] = 2.0, 1.0  # padding_idx gets no gradient; STE elsewhere (min-max scales never clip)
    assert torch.equal(emb.weight.grad, expected)
    assert ie.weight_quantizer.group_size == 64  # per channel: one group per row


def test_embedding_with_max_norm_stays_float_and_is_named():
    m = nn.Sequential(nn.Embedding(10, 32, max_norm=1.0), nn.Linear(32, 4))
    with pytest.warns(UserWarning, match=r"0 \(nn.Embedding with max_norm"):
        intqat.prepare_qat(m, CFG)
    assert type(m[0]) is nn.Embedding


def test_static_activations_with_groups_export_exactly():
    torch.manual_seed(4)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    cfg = {"preset": "w8a8", "weight": {"granularity": "group", "group_size": 32}}
    intqat.prepare_qat(m, cfg)
    for _ in range(3):
        m(torch.randn(16, 64))
    intqat.freeze_observers(m)
    intqat.to_integer(m)
    x = torch.randn(5, 64)
    y = m(x)
    with torch.no_grad():
        assert torch.equal(y.detach(), m.eval()(x))
        dep = intqat.to_deployed(m)
        ep = torch.export.export(dep, (x,))
        assert torch.equal(ep.module()(x), y.detach())


def test_lsq_learned_group_scales_train():
    torch.manual_seed(5)
    lin = nn.Linear(64, 16)
    cfg = {"preset": "8da4w", "weight": {"learnable": True}}
    m = GroupedIntLinear.from_fake_quant(FakeQuantGroupedLinear.from_linear(lin, cfg))
    s = m.weight_quantizer.scale
    assert s.shape == (16, 2) and s.requires_grad
    m(torch.randn(8, 64)).pow(2).sum().backward()
    assert s.grad is not None and s.grad.shape == (16, 2) and s.grad.abs().sum() > 0


def test_checkpoint_record_restores_grouped_and_embedding_layers():
    from intqat.callback import restore_quant_structure, save_quant_structure

    torch.manual_seed(6)
    m = intqat.to_integer(intqat.prepare_qat(TinyLM(), CFG))
    ckpt = {}
    save_quant_structure(m, ckpt)
    assert ckpt["intqat"]["modules"]["emb"]["activation"] is None
    fresh = TinyLM()
    restore_quant_structure(fresh, ckpt)
    assert isinstance(fresh.emb, IntEmbedding) and isinstance(fresh.fc, GroupedIntLinear)
    fresh.load_state_dict(m.state_dict())
    idx = torch.randint(0, 48, (2, 5))
    with torch.no_grad():
        assert torch.equal(fresh.eval()(idx), m.eval()(idx))


def test_layer_whose_width_the_group_does_not_divide_stays_float_and_is_named():
    m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))
    with pytest.warns(UserWarning, match=r"0 \(in_features 64 is not a multiple of group_size 128\)"):
        intqat.prepare_qat(m, "w8a8_g128")
    assert type(m[0]) is nn.Linear and type(m[1]) is nn.Linear
