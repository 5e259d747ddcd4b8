"""to_qdq: the Q/DQ deploy form makes the integer model's codes bit for bit, and its outputs differ from the integer
layers' only by float rounding (docs/numerics.md, "Deploy forms"). Runtimes are not involved here (test_deploy_pte.py)."""

import warnings

import pytest
import torch
from torch import nn

import intqat
from intqat.deploy.qdq import (QDQ_TYPES, FloatKeptConv2d, FloatKeptLinear, QDQGroupedIntLinear, QDQIntConv2d,
                               QDQIntEmbedding, QDQIntLinear, _integer_copy, qdq_layers, to_qdq)
from intqat.nn import DeployedGroupedIntLinear, DeployedIntConv2d, DeployedIntEmbedding, DeployedIntLinear
from intqat.ops.int_linear import quantize_activation
from intqat.ops.qparams import SCALE_EPS
from intqat.ops.quant import quantize
from real_models import ViTBlock, tiny_gpt2

pytest.importorskip("torchao", reason="to_qdq's dynamic and per-group forms are torchao's ops (intqat[deploy])")

U = 2.0 ** -24  # fp32 unit roundoff
EMB8 = {"bits": 8, "granularity": "channel"}
EMB4 = {"bits": 4, "granularity": "group", "group_size": 16}
PRESETS = {
    "w8a8": {"preset": "w8a8", "embedding": EMB8},
    "w8a8_dynamic": {"preset": "w8a8_dynamic", "embedding": EMB8},
    "w4a8": {"preset": "w4a8", "embedding": EMB8},
    "8da4w": {"preset": "8da4w", "weight": {"group_size": 16}, "embedding": EMB4},
}


class ConvNet(nn.Module):
    """conv 3x3 -> depthwise 3x3 -> pointwise 1x1 (a depthwise-separable block) -> linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.pw(torch.relu(self.dw(torch.relu(self.stem(x))))))
        return self.head(x.mean((2, 3)))


def _models():
    return {
        "mlp": (lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)),
                lambda: torch.randn(8, 32)),
        "gpt2": (tiny_gpt2, lambda: torch.randint(0, 64, (2, 16))),  # HF Conv1D projections, wte embedding
        "convnet": (ConvNet, lambda: torch.randn(4, 3, 8, 8)),
        "vit_block": (lambda: ViTBlock(32, 4, 64), lambda: torch.randn(2, 9, 32)),  # nn.MultiheadAttention
    }


def integer_model(name: str, preset: str) -> tuple[nn.Module, callable]:
    make, data = _models()[name]
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the census of layers each preset leaves float)
        intqat.prepare_qat(model, PRESETS[preset])
        model.train()
        with torch.no_grad():
            for _ in range(3):
                model(data())
        intqat.to_integer(model)
    return model.eval(), data


def _integer_codes(dep: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The codes the integer (deployed) layer computes from its input x, with the integer model's own functions."""
    x = x.to(torch.float32)
    if isinstance(dep, DeployedIntConv2d):
        if dep.x_dynamic:  # _deployed_conv: one symmetric scale for the tensor
            s = torch.clamp(x.abs().amax() / dep.x_qmax, min=SCALE_EPS)
            return quantize(x, s, 0, dep.x_qmin, dep.x_qmax)
        return quantize(x, dep.x_scale.reshape(()), dep.x_zero_point.reshape(()), dep.x_qmin, dep.x_qmax)
    x2d = x.reshape(-1, x.shape[-1])
    q, _, _ = quantize_activation(x2d, dep.x_scale, dep.x_zero_point, dep.x_qmin, dep.x_qmax, dep.x_dynamic, False)
    return q.reshape(x.shape)


def _captured_inputs(model: nn.Module, x) -> dict[str, torch.Tensor]:
    seen, hooks = {}, []
    for name, layer in qdq_layers(model).items():
        hooks.append(layer.register_forward_pre_hook(lambda m, a, name=name: seen.setdefault(name, a[0].detach())))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def _rounding_bound(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """|fl(x_hat . w_hat) - exact| <= K u sum_k |x_hat w_hat| (+ a few roundings of |y| on each side)."""
    x_hat = layer.input_qdq(x.to(torch.float32)).abs()
    w_hat = layer.w_hat().abs()
    bias = 0 if layer.bias is None else layer.bias.abs()
    if isinstance(layer, QDQIntConv2d):
        k = w_hat[0].numel()
        mag = nn.functional.conv2d(x_hat, w_hat, None, layer.stride, layer.padding, layer.dilation, layer.groups)
        bias = bias.reshape(-1, 1, 1) if torch.is_tensor(bias) else bias
    else:
        k = w_hat.shape[1]
        mag = x_hat @ w_hat.t()
    return (k + 4) * U * (mag + bias) * 2


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("name", list(_models()))
def test_codes_equal_and_outputs_differ_by_rounding(name, preset):
    model, data = integer_model(name, preset)
    deployed = dict(_integer_copy(model).named_modules())
    qdq = to_qdq(model)
    layers = qdq_layers(qdq)
    assert layers, f"{name} under {preset}: no integer layer reached the Q/DQ form"
    x = data()
    inputs = _captured_inputs(qdq, x)
    # (an attention deploys a projection for every input grouping it has scales for; self-attention runs "qkv")
    assert inputs, f"{name}: no Q/DQ layer ran"
    for lname, layer in layers.items():
        if lname not in inputs:
            continue
        dep, xin = deployed[lname], inputs[lname]
        assert torch.equal(layer.q_w, dep.q_w), f"{lname}: weight codes"
        if isinstance(layer, QDQIntEmbedding):
            with torch.no_grad():  # a gather of w_hat = float(q) * s: the integer embedding's one rounding
                assert torch.equal(layer(xin), dep(xin)), lname
            continue
        q, _, _ = layer.input_qdq.codes(xin.to(torch.float32))
        assert torch.equal(q, _integer_codes(dep, xin)), f"{lname}: activation codes ({preset})"
        with torch.no_grad():
            got, want = layer(xin), dep(xin)
        assert (got - want).abs().le(_rounding_bound(layer, xin)).all(), \
            f"{lname}: |y_qdq - y_int| {float((got - want).abs().max()):.3g} beyond float rounding"
    with torch.no_grad():  # the whole model: rounding differences pass through later layers' quantizers
        y_int, y_qdq = model(x), qdq(x)
    assert torch.isfinite(y_qdq).all() and y_qdq.shape == y_int.shape


def test_layer_types_by_preset():
    """Which Q/DQ module each integer layer becomes (w4a8 declares int4 codes on the int4 grid [-8, 7])."""
    kinds = {type(m) for m in qdq_layers(to_qdq(integer_model("convnet", "w8a8")[0])).values()}
    assert kinds == {QDQIntConv2d, QDQIntLinear}
    gpt = qdq_layers(to_qdq(integer_model("gpt2", "8da4w")[0]))
    assert {type(m) for m in gpt.values()} == {QDQGroupedIntLinear, QDQIntEmbedding}
    w4 = qdq_layers(to_qdq(integer_model("mlp", "w4a8")[0]))
    assert all((m.w_qmin, m.w_qmax) == (-8, 7) and int(m.q_w.abs().max()) <= 7 for m in w4.values())
    vit = qdq_layers(to_qdq(integer_model("vit_block", "w8a8")[0]))
    assert {"attn.in_proj.qkv", "attn.out_proj"} <= set(vit)


def test_keep_float_and_unknown_names():
    model, data = integer_model("convnet", "w8a8_dynamic")
    qdq = to_qdq(model, keep_float=["dw", "head"])
    assert isinstance(qdq.dw, FloatKeptConv2d) and isinstance(qdq.head, FloatKeptLinear)
    assert set(qdq_layers(qdq)) == {"stem", "pw"}
    ref = to_qdq(model)
    with torch.no_grad():  # kept float: the same w_hat, the input not quantized
        assert torch.equal(qdq.dw.weight, ref.dw.w_hat())
        x = torch.randn(2, 16, 4, 4)
        assert torch.allclose(qdq.dw(x), nn.functional.conv2d(x, ref.dw.w_hat(), ref.dw.bias, 1, 1, 1, 16), atol=0)
    stored = to_qdq(model, fp32_weights=["head"])  # w_hat stored fp32, the input keeps its Q/DQ: the same numbers
    assert stored.head.w_stored.dtype == torch.float32 and not hasattr(stored.head, "q_w")
    with torch.no_grad():
        x = torch.randn(2, 3, 8, 8)
        assert torch.equal(stored(x), ref(x))
    with pytest.raises(ValueError, match="keep_float / fp32_weights name \\['nope'\\]"):
        to_qdq(model, keep_float=["nope"])


def test_model_is_not_modified_and_chained_layers_agree():
    model, data = integer_model("mlp", "w8a8")
    intqat.freeze_observers(model)
    intqat.chain_int8(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qdq = to_qdq(model)
    assert before.keys() == model.state_dict().keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert qdq_layers(qdq)["0"].out_qparams is not None  # the producer requantizes on its consumer's grid
    x = data()
    inputs = _captured_inputs(qdq, x)
    deployed = dict(_integer_copy(model).named_modules())
    # the consumer's codes from the producer's requantized output are the chained integer codes
    q, _, _ = qdq_layers(qdq)["2"].input_qdq.codes(inputs["2"])
    with torch.no_grad():
        assert torch.equal(q, deployed["0"](x))
    assert all(isinstance(m, QDQ_TYPES) for m in qdq_layers(qdq).values())
    assert not any(isinstance(m, (DeployedIntLinear, DeployedGroupedIntLinear, DeployedIntEmbedding))
                   for m in qdq.modules())
