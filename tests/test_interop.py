"""intqat.interop: fake-quant models of intqat, torchao and torch.ao -> integer modules via to_integer.

Each source trains a few fake-quant steps, is converted, and must keep: the module types, the very
same Parameter objects (the optimizer built before keeps working), the fake-quant model's output
(SQNR), and falling loss over 30 more steps. Unconvertible modules stay, named in one warning.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat.nn import GroupedIntLinear
from intqat import interop
from intqat.nn import ActivationQuantizer, IntConv2d, IntLinear
from intqat.ops.quant import fake_quantize

tq = pytest.importorskip("torch.ao.quantization")
try:  # torchao is optional: its tests skip without it, the others run
    from torchao.quantization import quantize_
    from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig, initialize_fake_quantizers
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    PER_TOKEN_ASYM = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
except ImportError:
    quantize_ = None
needs_torchao = pytest.mark.skipif(quantize_ is None, reason="torchao is not installed")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())).item()


def _mlp_data(n=256, k=16, classes=4):
    x = torch.randn(n, k)
    return x, (x @ torch.randn(k, classes)).argmax(1)


def _image_data(n=64):
    x = torch.randn(n, 3, 8, 8)
    return x, (x.mean((2, 3)) @ torch.randn(3, 4)).argmax(1)


def _train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _to_integer(model):
    """to_integer, returning the messages of its 'left these modules as they were' warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        intqat.to_integer(model)
    return [str(w.message) for w in caught if str(w.message).startswith("to_integer left")]


class TorchAOMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


class TorchAOConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv2, self.relu2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        x = self.pool(self.relu1(self.bn1(self.conv1(self.quant(x)))))
        x = self.relu2(self.conv2(x))
        return self.dequant(self.fc(torch.flatten(x, 1)))


def _intqat_mlp():
    return intqat.prepare_qat(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "w8a8"), _mlp_data()


def _torchao_mlp():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    weight = IntxFakeQuantizeConfig(torch.int8, "per_channel")
    quantize_(model, QATConfig(activation_config=PER_TOKEN_ASYM, weight_config=weight, step="prepare"))
    return model, _mlp_data()


def _torch_ao(model, fuse, data):
    model.train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    if fuse:
        tq.fuse_modules_qat(model, fuse, inplace=True)
    return tq.prepare_qat(model, inplace=True), data


# SQNR thresholds. intqat's fake-quant and integer modules share every rounding: they differ only by fp32
# accumulation order (docs/numerics.md). torch.ao and torchao have their own conventions: [-128, 127] weights
# with s = amax / 127.5, torch.ao's [0, 127] activations and moving-average weight scales. The converters
# carry those (TorchRangeWeightQuantizer, the observed scales), so torch.ao matches too; but torchao's
# per-token activations are asymmetric and intqat's dynamic per-token kernel is symmetric (one-sided rows
# after ReLU get about one bit less), and a new conversion may miss a convention: 30 dB for both.
# Measured (seed 0): intqat 141 dB; torchao 42 dB; torch.ao MLP and conv net equal (inf: the last
# layer's output FakeQuantize rounds away the fp32 differences, 141 / 137 dB before it).
SOURCES = {
    "intqat": (_intqat_mlp, {"0": IntLinear, "2": IntLinear}, 40.0),
    "torchao": (_torchao_mlp, {"0": IntLinear, "2": IntLinear}, 30.0),
    "torch.ao-mlp": (lambda: _torch_ao(TorchAOMLP(), None, _mlp_data()), {"fc1": IntLinear, "fc2.0": IntLinear}, 30.0),
    "torch.ao-conv": (
        lambda: _torch_ao(TorchAOConvNet(), [["conv1", "bn1", "relu1"], ["conv2", "relu2"]], _image_data()),
        {"conv1.0": IntConv2d, "conv1.1": nn.ReLU, "conv2.0": IntConv2d, "conv2.1": nn.ReLU, "fc.0": IntLinear},
        30.0,
    ),
}


@pytest.mark.parametrize("source", [pytest.param(s, marks=needs_torchao) if s == "torchao" else s for s in SOURCES])
def test_fake_quant_to_integer_keeps_parameters_output_and_training(source):
    build, types, min_sqnr = SOURCES[source]
    model, (x, y) = build()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    _train(model, opt, x, y, 10)
    torch_ao = source.startswith("torch.ao")
    if torch_ao:
        links = interop.attach_torch_ao_input_qparams(model, (x,))
        assert links[next(iter(links))] == "quant.activation_post_process"
    ref = copy.deepcopy(model).eval()
    before = [p for g in opt.param_groups for p in g["params"]]

    assert _to_integer(model) == []
    for name, cls in types.items():
        assert type(model.get_submodule(name)) is cls, name
    converted = [type(mod) for mod in model.modules()]
    assert _to_integer(model) == [] and [type(mod) for mod in model.modules()] == converted  # a no-op twice
    # same Parameter objects; the only new ones are carried (LSQ) weight scales
    now = dict(model.named_parameters())
    assert {id(p) for p in before} <= {id(p) for p in now.values()}
    assert all(n.endswith("weight_quantizer.scale") for n, p in now.items() if all(p is not q for q in before))

    if torch_ao:  # torch.ao's FakeQuantize observes even in eval mode: freeze both sides to compare
        ref.apply(tq.disable_observer)
        model.apply(tq.disable_observer)
        # deepcopy mapped each layer's link to the copy's own FakeQuantize
        links = [mod._intqat_torch_ao for mod in ref.modules() if hasattr(mod, "_intqat_torch_ao")]
        assert links and all(any(link.input_fq is mod for mod in ref.modules()) for link in links)
    model.eval()
    with torch.no_grad():
        measured = sqnr(ref(x), model(x))
    print(f"\n{source}: SQNR integer vs fake quant = {measured:.1f} dB")
    assert measured >= min_sqnr

    model.train()
    losses = _train(model, opt, x, y, 30)  # the optimizer built before the swap
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 and losses[-1] < losses[0]
    assert all(p in opt.state for p in before)  # Adam moments carried on


@needs_torchao
def test_torchao_weights_match_bit_for_bit():
    """torchao's grid ([-128, 127], s = amax / 127.5, reciprocal multiply) is reproduced exactly."""
    model, (x, y) = _torchao_mlp()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, 3)
    fq = model[0]
    ref_w = fq.weight_fake_quantizer(fq.weight)
    intqat.to_integer(model)
    wq = model[0].weight_quantizer
    assert (wq.qmin, wq.qmax) == (-128, 127)
    int_w = fake_quantize(model[0].weight, wq.channel_scale(model[0].weight), 0, wq.qmin, wq.qmax, axis=0)
    torch.testing.assert_close(int_w, ref_w, atol=0, rtol=0)


@needs_torchao
def test_torchao_static_scales_are_carried():
    x, _ = _mlp_data()
    learned = IntxFakeQuantizeConfig(torch.int4, "per_channel", is_dynamic=False, range_learning=True)
    model = nn.Sequential(nn.Linear(16, 8))
    quantize_(model, QATConfig(activation_config=PER_TOKEN_ASYM, weight_config=learned, step="prepare"))
    initialize_fake_quantizers(model, (x,))
    w_scale = model[0].weight_fake_quantizer.scale
    ref = model(x).detach()
    intqat.to_integer(model)
    wq = model[0].weight_quantizer
    assert isinstance(wq.scale, nn.Parameter) and torch.equal(wq.scale.detach(), w_scale.detach().reshape(-1))
    assert (wq.qmin, wq.qmax) == (-8, 7)
    assert sqnr(ref, model.eval()(x)) >= 30.0

    # a static activation scale shared by the tensor becomes a static ActivationQuantizer as it is
    act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False, is_dynamic=False)
    static = FakeQuantizedLinear(16, 8, activation_config=act, weight_config=IntxFakeQuantizeConfig(torch.int8, "per_channel"))
    static.activation_fake_quantizer.scale = torch.tensor([[0.05]])
    static.activation_fake_quantizer.zero_point = torch.tensor([[3]], dtype=torch.int32)
    aq = interop.from_torchao_linear(static).input_quantizer
    assert isinstance(aq, ActivationQuantizer) and not aq.dynamic and (aq.qmin, aq.qmax) == (-128, 127)
    assert aq.scale.item() == pytest.approx(0.05) and aq.zero_point.item() == 3
    assert bool(aq.initialized) and not bool(aq.observer_enabled)
    static.activation_fake_quantizer.scale = torch.full((4, 1), 0.05)  # per row of one batch: no integer kernel
    with pytest.raises(ValueError, match="per-token activation scales"):
        interop.from_torchao_linear(static)


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.mha, self.head = nn.Linear(16, 32), nn.MultiheadAttention(32, 4, batch_first=True), nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc(x).relu()
        return self.head(h + self.mha(h, h, h, need_weights=False)[0]).mean(1)


@needs_torchao
def test_unconvertible_modules_stay_and_one_warning_names_them():
    model = _Mixed()
    for fqn, weight in (("fc", IntxFakeQuantizeConfig(torch.int8, "per_channel")),
                        ("head", IntxFakeQuantizeConfig(torch.int4, group_size=8))):
        config = QATConfig(activation_config=PER_TOKEN_ASYM, weight_config=weight, step="prepare")
        quantize_(model, config, filter_fn=lambda m, name, fqn=fqn: name == fqn)
    mha = model.mha
    messages = _to_integer(model)
    assert len(messages) == 1
    assert "mha (nn.MultiheadAttention" in messages[0] and "head (" not in messages[0]  # per-group: converted
    assert type(model.fc) is IntLinear and type(model.head) is GroupedIntLinear and model.mha is mha
    x, y = torch.randn(8, 5, 16), torch.randint(0, 4, (8,))
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), x, y, 2)


def test_torch_ao_without_input_links_stays_with_one_warning():
    model, (x, y) = _torch_ao(TorchAOMLP(), None, _mlp_data())
    _train(model, torch.optim.SGD(model.parameters(), lr=0.01), x, y, 2)
    qat_types = {type(model.fc1), type(model.fc2)}
    messages = _to_integer(model)  # attach_torch_ao_input_qparams was not run
    assert len(messages) == 1
    assert "fc1 (no input qparams" in messages[0] and "fc2 (no input qparams" in messages[0]
    assert "attach_torch_ao_input_qparams" in messages[0]
    assert {type(model.fc1), type(model.fc2)} == qat_types


class TorchAOResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv1, self.relu1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        self.add, self.pool, self.fc = torch.ao.nn.quantized.FloatFunctional(), nn.MaxPool2d(2), nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        h = self.relu1(self.conv1(self.quant(x)))
        h = self.add.add(h, self.conv2(h))
        return self.dequant(self.fc(self.pool(h).flatten(1)))


def test_torch_ao_output_fake_quant_is_kept_only_where_no_integer_layer_requantizes():
    model, (x, y) = _torch_ao(TorchAOResidual(), [["conv1", "relu1"]], _image_data())
    _train(model, torch.optim.Adam(model.parameters(), lr=5e-3), x, y, 5)
    links = interop.attach_torch_ao_input_qparams(model, x)
    # producers are found through ReLU, pooling and flatten
    assert links == {"conv1": "quant.activation_post_process", "conv2": "conv1.activation_post_process",
                     "fc": "add.activation_post_process"}
    ref = copy.deepcopy(model).eval().apply(tq.disable_observer)
    assert _to_integer(model) == []
    # conv1's output also feeds the add, conv2's only the add, fc's the model output: all keep torch.ao's
    # FakeQuantize after the integer layer; an output read by integer layers alone drops it (see the MLP)
    for name, fq in (("conv1", "2"), ("conv2", "1"), ("fc", "1")):
        assert isinstance(model.get_submodule(f"{name}.{fq}"), tq.FakeQuantizeBase), name
    model.eval().apply(tq.disable_observer)
    with torch.no_grad():
        measured = sqnr(ref(x), model(x))
    print(f"\ntorch.ao-residual: SQNR integer vs fake quant = {measured:.1f} dB")
    assert measured >= 30.0  # conv2 requantizes conv1's kept fake quant on the same grid: same codes
