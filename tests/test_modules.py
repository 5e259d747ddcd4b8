"""Quantized modules and the model-level swaps, held to docs/numerics.md.

Numeric intent, stated once:
- Integer modules in eval (and in training, forward) equal a pure integer reference exactly
  (torch.equal): int64 accumulation of the centred codes, then float32(acc) * (s_x * s_w[n]) + b[n].
  The reference quantizes with the docs/numerics.md formula written out here, not with intqat's code.
- torch.export programs (saved and reloaded) of integer / deployed modules: torch.equal.
- Training gradients of integer vs fake-quant modules holding the same Parameters: relative
  error (||a - b|| / ||b||) < 1e-5: the two differ only in fp32 rounding order of the STE GEMMs.
- Integer vs fake-quant outputs after to_integer: SQNR >= 40 dB (fp32 accumulation order only).
- state_dict round trip of an integer model: torch.equal.
"""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat import QuantConfig, QuantSpec
from intqat.nn import (
    DeployedIntConv2d,
    DeployedIntLinear,
    FakeQuantConv2d,
    FakeQuantLinear,
    IntConv2d,
    IntLinear,
)

EPS = torch.finfo(torch.float32).eps
PER_TENSOR_W = QuantConfig(weight=QuantSpec(bits=8, granularity="tensor"))
PER_TENSOR_W_LSQ = QuantConfig(
    weight=QuantSpec(bits=8, granularity="tensor", learnable=True),
    activation=QuantSpec(bits=8, symmetric=False, learnable=True),
)
CONFIGS = {
    "w8a8": "w8a8",  # per-channel weights, static per-tensor asymmetric activations
    "w8a8_dynamic": "w8a8_dynamic",
    "w4a8": "w4a8",
    "w8a8_lsq": "w8a8_lsq",
    "per_tensor_w": PER_TENSOR_W,
}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    # These shapes are tiny: one thread is as fast on an idle machine, and on a busy 2-core one
    # OpenMP's spinning threads made a training step ~20x slower. Restored for other modules.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Helpers: the reference arithmetic of docs/numerics.md, written independently of intqat
# ---------------------------------------------------------------------------------------------


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    noise = (ref.double() - out.double()).pow(2).sum()
    return math.inf if noise == 0 else 10 * math.log10(ref.double().pow(2).sum() / noise)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def ref_codes(x, s, z, qmin, qmax):
    """q = clamp(nearbyint(x * float32(1/s)) + z, qmin, qmax) as int64; s broadcasts against x."""
    inv_s = 1.0 / s.to(torch.float32)  # IEEE division: the correctly rounded float32 reciprocal
    return (torch.round(x.to(torch.float32) * inv_s) + z).clamp(qmin, qmax).to(torch.int64)


def ref_zero_point(aq) -> int:
    return int(torch.round(aq.zero_point.detach().float()).clamp(aq.qmin, aq.qmax).item())


def ref_weight_scale(wq, w):
    """(N,) weight scales: the learned ones, else max|W| / qmax per channel (or for the tensor)."""
    n = w.shape[0]
    if wq.spec.learnable:
        return wq.scale.detach().float().reshape(-1).expand(n).clone()
    w2 = w.detach().float().reshape(n, -1)
    amax = w2.abs().amax(1) if wq.spec.granularity == "channel" else w2.abs().amax().expand(n)
    return torch.clamp(amax / wq.qmax, min=EPS)


def ref_int_linear(mod, x):
    aq, wq = mod.input_quantizer, mod.weight_quantizer
    x2 = x.reshape(-1, x.shape[-1]).float()
    if aq.dynamic:  # symmetric per-token scales from each row
        s_x, z = torch.clamp(x2.abs().amax(1, keepdim=True) / aq.qmax, min=EPS), 0
    else:
        s_x, z = aq.scale.detach().float().reshape(1, 1), ref_zero_point(aq)
    q_x = ref_codes(x2, s_x, z, aq.qmin, aq.qmax)
    s_w = ref_weight_scale(wq, mod.weight)
    q_w = ref_codes(mod.weight.detach(), s_w[:, None], 0, wq.qmin, wq.qmax)
    acc = (q_x - z) @ q_w.t()  # int64: exact
    y = acc.to(torch.float32) * (s_x * s_w[None, :])
    if mod.bias is not None:
        y = y + mod.bias.detach()
    return y.reshape(*x.shape[:-1], -1)


def ref_int_conv(mod, x, padding):
    """Integer conv reference; `padding` as the nn.Conv2d had it (ints or 'same' / 'valid')."""
    aq, wq = mod.input_quantizer, mod.weight_quantizer
    w, b = mod.folded()  # == (weight, bias) without BN
    x = x.float()
    if aq.dynamic:  # the integer conv takes one dynamic symmetric scale per tensor
        s_x, z = torch.clamp(x.abs().amax() / aq.qmax, min=EPS).reshape(1), 0
    else:
        s_x, z = aq.scale.detach().float().reshape(1), ref_zero_point(aq)
    q_x = ref_codes(x, s_x, z, aq.qmin, aq.qmax)
    s_w = ref_weight_scale(wq, w)
    q_w = ref_codes(w.detach().reshape(w.shape[0], -1), s_w[:, None], 0, wq.qmin, wq.qmax).reshape(w.shape)
    # float64 holds these integer sums exactly (|acc| < 2^53); zero padding of centred codes = code z_x
    acc = F.conv2d((q_x - z).double(), q_w.double(), None, mod.stride, padding, mod.dilation, mod.groups)
    y = acc.to(torch.float32) * (s_x * s_w).reshape(1, -1, 1, 1)
    if b is not None:
        y = y + b.detach().reshape(1, -1, 1, 1)
    return y


def observe(model, x):
    """One training forward so static activation quantizers see data, then freeze them."""
    model.train()
    with torch.no_grad():
        model(x)
    intqat.freeze_observers(model)
    return model


def perturb_lsq(model):
    """Learned qparams drift off the observer's values: non-integer zero point, smaller scale (clips)."""
    with torch.no_grad():
        for m in intqat.quantized_modules(model).values():
            aq = m.input_quantizer
            if aq.spec.learnable:
                aq.scale.mul_(0.8)
                if isinstance(aq.zero_point, nn.Parameter):
                    aq.zero_point.add_(0.37)
            if m.weight_quantizer.spec.learnable:
                m.weight_quantizer.scale.mul_(0.9)


def act_input(*shape, scale=1.0):
    # asymmetric activations (non-zero zero point)
    return torch.randn(*shape) * scale + 0.6


def int_linear_module(cfg, K=40, N=12, bias=True):
    model = intqat.prepare_qat(nn.Sequential(nn.Linear(K, N, bias=bias)), cfg)
    observe(model, act_input(64, K))
    perturb_lsq(model)
    return intqat.to_integer(model)


CONV_CASES = {
    "stride2-pad1": dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1),
    "dilation2": dict(in_channels=4, out_channels=6, kernel_size=3, padding=2, dilation=2),
    "groups2": dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2),
    "depthwise": dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4),
    "depthwise-x2": dict(in_channels=4, out_channels=8, kernel_size=3, padding=1, groups=4),
    "no-bias-rect": dict(in_channels=4, out_channels=6, kernel_size=(3, 5), stride=(1, 2), padding=(1, 2), bias=False),
    "same-dilation2": dict(in_channels=4, out_channels=6, kernel_size=3, padding="same", dilation=2),
    "valid": dict(in_channels=4, out_channels=6, kernel_size=3, padding="valid"),
    "all": dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, dilation=2, groups=2),
}
CONV_X = (2, 4, 9, 9)


def int_conv_module(cfg, case, bn=False):
    kw = CONV_CASES[case]
    layers = [nn.Conv2d(**kw)]
    if bn:
        layers.append(randomized_bn(kw["out_channels"]))
    model = intqat.prepare_qat(nn.Sequential(*layers), cfg)
    observe(model, act_input(*CONV_X))
    perturb_lsq(model)
    return intqat.to_integer(model)


def randomized_bn(c):
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.3, 0.3)
    return bn


def export_roundtrip(module, x_export, tmp_path):
    ep = torch.export.export(module, (x_export,))
    path = tmp_path / "program.pt2"
    torch.export.save(ep, path)
    return torch.export.load(path).module()


# ---------------------------------------------------------------------------------------------
# (a) integer modules == pure integer reference, exactly
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_int_linear_equals_integer_reference(cfg, bias):
    model = int_linear_module(CONFIGS[cfg], bias=bias)
    mod = model[0]
    assert isinstance(mod, IntLinear)
    x = act_input(33, 40, scale=1.5)  # wider than the observed range: codes clip
    ref = ref_int_linear(mod, x)
    mod.eval()
    assert torch.equal(mod(x), ref)
    # training: the same arithmetic with autograd attached
    mod.train()
    y_train = mod(x.clone().requires_grad_())
    assert y_train.requires_grad and torch.equal(y_train.detach(), ref)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a8_dynamic"])
def test_int_linear_3d_input_equals_reference(cfg):
    mod = int_linear_module(cfg)[0].eval()
    x = act_input(3, 7, 40, scale=1.3)
    y = mod(x)
    assert y.shape == (3, 7, 12)
    assert torch.equal(y, ref_int_linear(mod, x))


def test_int_linear_reference_exercises_zero_point_and_clipping():
    # guard on the test data: a non-zero activation zero point and codes at both ends of the range
    mod = int_linear_module("w8a8")[0]
    aq = mod.input_quantizer
    assert ref_zero_point(aq) != 0
    q = ref_codes(act_input(33, 40, scale=1.5), aq.scale.detach(), ref_zero_point(aq), aq.qmin, aq.qmax)
    assert (q == aq.qmin).any() and (q == aq.qmax).any()


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_int_conv2d_equals_integer_reference(cfg, case):
    model = int_conv_module(CONFIGS[cfg], case)
    mod = model[0]
    assert isinstance(mod, IntConv2d)
    x = act_input(*CONV_X, scale=1.5)
    ref = ref_int_conv(mod, x, CONV_CASES[case]["padding"])
    mod.eval()
    assert torch.equal(mod(x), ref)
    mod.train()
    y_train = mod(x.clone().requires_grad_())
    assert y_train.requires_grad and torch.equal(y_train.detach(), ref)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a8_lsq"])
def test_int_conv2d_with_folded_bn_equals_integer_reference(cfg):
    mod = int_conv_module(cfg, "stride2-pad1", bn=True)[0].eval()
    assert mod.bn is not None
    x = act_input(*CONV_X, scale=1.5)
    assert torch.equal(mod(x), ref_int_conv(mod, x, 1))


# ---------------------------------------------------------------------------------------------
# (b) == the torch.export program (saved, reloaded), for the module and for to_deployed(model)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS)
def test_int_linear_export_roundtrip_equal(cfg, tmp_path):
    model = int_linear_module(CONFIGS[cfg]).eval()
    x_export, x = act_input(5, 40), act_input(5, 40, scale=1.5)
    expected = model(x)
    loaded = export_roundtrip(model[0], x_export, tmp_path)
    assert torch.equal(loaded(x), expected)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_deployed_linear_export_roundtrip_equal(cfg, tmp_path):
    model = int_linear_module(CONFIGS[cfg]).eval()
    x_export, x = act_input(5, 40), act_input(5, 40, scale=1.5)
    expected = model(x)
    deployed = intqat.to_deployed(model)
    assert isinstance(deployed[0], DeployedIntLinear)
    assert torch.equal(deployed(x), expected)
    loaded = export_roundtrip(deployed, x_export, tmp_path)
    assert torch.equal(loaded(x), expected)


EXPORT_CONV = [("all", "w8a8"), ("same-dilation2", "w8a8_dynamic"), ("depthwise-x2", "w4a8"),
               ("no-bias-rect", "w8a8_lsq"), ("valid", "per_tensor_w")]


# Regression: IntConv2d's eval forward under torch.export once built a DeployedIntConv2d whose padding
# value came from .item() on a traced buffer (GuardOnDataDependentSymNode).
@pytest.mark.parametrize("case, cfg", EXPORT_CONV)
def test_int_conv2d_export_roundtrip_equal(case, cfg, tmp_path):
    model = int_conv_module(CONFIGS[cfg], case).eval()
    x_export, x = act_input(*CONV_X), act_input(*CONV_X, scale=1.5)
    expected = model(x)
    loaded = export_roundtrip(model[0], x_export, tmp_path)
    assert torch.equal(loaded(x), expected)


@pytest.mark.parametrize("case, cfg", EXPORT_CONV)
def test_deployed_conv2d_export_roundtrip_equal(case, cfg, tmp_path):
    model = int_conv_module(CONFIGS[cfg], case).eval()
    x_export, x = act_input(*CONV_X), act_input(*CONV_X, scale=1.5)
    expected = model(x)
    deployed = intqat.to_deployed(model)
    assert isinstance(deployed[0], DeployedIntConv2d)
    assert torch.equal(deployed(x), expected)
    loaded = export_roundtrip(deployed, x_export, tmp_path)
    assert torch.equal(loaded(x), expected)


class SmallNet(nn.Module):
    def __init__(self, bn=True):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8) if bn else nn.Identity(), nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x):
        return self.head(self.features(x))


def net_input(n=8):
    return torch.randn(n, 3, 8, 8)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a8_dynamic"])
def test_deployed_model_export_roundtrip_equal(cfg, tmp_path):
    model = intqat.prepare_qat(SmallNet(), cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_var.uniform_(0.5, 2.0)
    observe(model, net_input(16))
    intqat.to_integer(model).eval()
    x = net_input(4) * 1.3
    expected = model(x)
    loaded = export_roundtrip(intqat.to_deployed(model), net_input(4), tmp_path)
    assert torch.equal(loaded(x), expected)


# ---------------------------------------------------------------------------------------------
# (c) training gradients: integer module == fake-quant module holding the same Parameters
# ---------------------------------------------------------------------------------------------


def fq_and_int(make, cfg, x_obs, freeze_bn=False):
    fq_model = intqat.prepare_qat(make(), cfg)
    observe(fq_model, x_obs)
    perturb_lsq(fq_model)
    if freeze_bn:
        intqat.freeze_bn_stats(fq_model)
    int_model = intqat.to_integer(copy.deepcopy(fq_model))
    return fq_model.train(), int_model.train()


def backward_grads(model, x, g):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = model(x)
    (y * g).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return y.detach(), x.grad, grads


def assert_same_grads(fq_model, int_model, x, expect_qparam_grads):
    g = torch.randn_like(fq_model(x).detach())
    y_fq, gx_fq, grads_fq = backward_grads(fq_model, x, g)
    y_int, gx_int, grads_int = backward_grads(int_model, x, g)
    assert sqnr_db(y_fq, y_int) >= 40
    assert rel_err(gx_int, gx_fq) < 1e-5, "input grad"
    assert grads_fq.keys() == grads_int.keys()
    qparam_names = [n for n in grads_fq if "quantizer" in n]
    assert bool(qparam_names) == expect_qparam_grads
    for name, g_fq in grads_fq.items():
        g_int = grads_int[name]
        assert g_fq is not None and g_int is not None, name
        assert g_fq.abs().sum() > 0, f"{name}: zero gradient would make the comparison vacuous"
        assert rel_err(g_int, g_fq) < 1e-5, f"{name}: {rel_err(g_int, g_fq):.3g}"


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("cfg", list(CONFIGS) + ["per_tensor_w_lsq"])
def test_int_linear_grads_equal_fake_quant(cfg, bias):
    spec = PER_TENSOR_W_LSQ if cfg == "per_tensor_w_lsq" else CONFIGS[cfg]
    fq_model, int_model = fq_and_int(lambda: nn.Sequential(nn.Linear(40, 12, bias=bias)), spec, act_input(64, 40))
    assert isinstance(int_model[0], IntLinear) and isinstance(fq_model[0], FakeQuantLinear)
    assert_same_grads(fq_model, int_model, act_input(3, 11, 40, scale=1.5), cfg in ("w8a8_lsq", "per_tensor_w_lsq"))


# Regression: with dynamic activations FakeQuantConv2d once fake-quantized per row of the last dim while the
# integer conv uses one symmetric scale per tensor: forward and weight gradient differed.
@pytest.mark.parametrize("case", ["all", "depthwise-x2", "no-bias-rect", "same-dilation2"])
@pytest.mark.parametrize("cfg", list(CONFIGS) + ["per_tensor_w_lsq"])
def test_int_conv2d_grads_equal_fake_quant(cfg, case):
    spec = PER_TENSOR_W_LSQ if cfg == "per_tensor_w_lsq" else CONFIGS[cfg]
    fq_model, int_model = fq_and_int(lambda: nn.Sequential(nn.Conv2d(**CONV_CASES[case])), spec, act_input(*CONV_X))
    assert isinstance(int_model[0], IntConv2d) and isinstance(fq_model[0], FakeQuantConv2d)
    assert_same_grads(fq_model, int_model, act_input(*CONV_X, scale=1.5), cfg in ("w8a8_lsq", "per_tensor_w_lsq"))


@pytest.mark.parametrize("cfg", ["w8a8", "w8a8_lsq"])
def test_int_conv2d_bn_grads_equal_fake_quant_with_frozen_bn(cfg):
    make = lambda: nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), randomized_bn(6))  # noqa: E731
    fq_model, int_model = fq_and_int(make, CONFIGS[cfg], act_input(*CONV_X), freeze_bn=True)
    assert {"0.bn.weight", "0.bn.bias"} <= {n for n, _ in int_model.named_parameters()}
    assert_same_grads(fq_model, int_model, act_input(*CONV_X, scale=1.5), cfg == "w8a8_lsq")


def _lsq_factor(n, qmax):
    return 1.0 / math.sqrt(n * qmax)


# Regression: a learned per-tensor weight scale once got LSQ's gradient scale for one row (1/sqrt(K qmax))
# instead of all the elements that share it (1/sqrt(N K qmax), docs/numerics.md "Learned scales").
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fake_quant_linear_lsq_grads_equal_torch_learnable_kernels(granularity):
    cfg = QuantConfig(weight=QuantSpec(granularity=granularity, learnable=True),
                      activation=QuantSpec(symmetric=False, learnable=True))
    model = intqat.prepare_qat(nn.Sequential(nn.Linear(40, 12)), cfg)
    # Inputs skewed negative give a POSITIVE zero point: torch's learnable backward takes the zero
    # point as int64(z + 0.5) (truncation), which is off by one for negative z, while its forward
    # (and intqat, and docs/numerics.md) round it. For z > 0 (here z = k + 0.37) both mean round(z).
    observe(model, -act_input(64, 40))
    perturb_lsq(model)
    fql = model[0]
    aq, wq = fql.input_quantizer, fql.weight_quantizer
    assert aq.zero_point.item() > 0
    x = -act_input(16, 40, scale=1.5)
    g = torch.randn(16, 12)
    _, _, grads = backward_grads(model, x, g)

    s_x = aq.scale.detach().clone().requires_grad_()
    z_x = aq.zero_point.detach().clone().requires_grad_()
    s_w = wq.scale.detach().clone().requires_grad_()
    w = fql.weight.detach().clone().requires_grad_()
    x_hat = torch._fake_quantize_learnable_per_tensor_affine(
        x, s_x, z_x, aq.qmin, aq.qmax, _lsq_factor(x.numel(), aq.qmax))
    if granularity == "channel":
        w_hat = torch._fake_quantize_learnable_per_channel_affine(
            w, s_w, torch.zeros(12), 0, wq.qmin, wq.qmax, _lsq_factor(40, wq.qmax))
    else:
        w_hat = torch._fake_quantize_learnable_per_tensor_affine(
            w, s_w, torch.zeros(1), wq.qmin, wq.qmax, _lsq_factor(w.numel(), wq.qmax))
    (F.linear(x_hat, w_hat, fql.bias.detach()) * g).sum().backward()
    assert rel_err(grads["0.input_quantizer.scale"], s_x.grad) < 1e-5
    assert rel_err(grads["0.input_quantizer.zero_point"], z_x.grad) < 1e-5
    assert rel_err(grads["0.weight"], w.grad) < 1e-5
    assert rel_err(grads["0.weight_quantizer.scale"], s_w.grad) < 1e-5


# ---------------------------------------------------------------------------------------------
# (d) after to_integer, outputs match the fake-quant model they came from
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS)
def test_to_integer_matches_fake_quant_model(cfg):
    model = intqat.prepare_qat(SmallNet(), CONFIGS[cfg])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(3):  # a little QAT so BN statistics, observers and learned scales move
        opt.zero_grad()
        model(net_input(16)).pow(2).mean().backward()
        opt.step()
    fq_model = copy.deepcopy(model).eval()
    int_model = intqat.to_integer(model).eval()
    assert len([m for m in int_model.modules() if isinstance(m, (IntLinear, IntConv2d))]) == 4
    x = net_input(16)
    with torch.no_grad():
        assert sqnr_db(fq_model(x), int_model(x)) >= 40


# ---------------------------------------------------------------------------------------------
# (e) training continues after the swap and the loss keeps falling
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, cfg", [("mlp", "w8a8"), ("mlp", "w8a8_dynamic"), ("mlp", "w8a8_lsq"), ("conv", "w8a8_lsq")]
)
def test_training_continues_after_to_integer(arch, cfg):
    if arch == "mlp":
        teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        data = torch.randn(256, 16)
    else:
        teacher = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))
        model = SmallNet()
        model.head[-1] = nn.Linear(16, 4)
        data = net_input(256)[:, :, :8, :8]
    with torch.no_grad():
        target = teacher(data)
    intqat.prepare_qat(model, cfg)
    # LSQ scales (~1e-2) get a smaller step than the weights, as one would set them up in practice
    scales = [p for n, p in model.named_parameters() if n.endswith(("scale", "zero_point"))]
    weights = [p for n, p in model.named_parameters() if not n.endswith(("scale", "zero_point"))]
    groups = [{"params": weights}] + ([{"params": scales, "lr": 3e-4}] if scales else [])
    opt = torch.optim.Adam(groups, lr=3e-3)
    model.train()

    def step(i):
        xb, yb = data[(i * 32) % 256:][:32], target[(i * 32) % 256:][:32]
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(5):  # fake-quant warm-up
        step(i)
    intqat.to_integer(model)
    assert len([m for m in model.modules() if isinstance(m, (IntLinear, IntConv2d))]) >= 2
    losses = [step(i) for i in range(30)]
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses


# ---------------------------------------------------------------------------------------------
# (f) state_dict round trip of a trained integer model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", ["w8a8", "w8a8_dynamic", "w8a8_lsq", "w4a8"])
def test_state_dict_round_trip(cfg, tmp_path):
    torch.manual_seed(1)
    model = intqat.prepare_qat(SmallNet(), cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for i in range(4):
        if i == 2:
            intqat.to_integer(model)
        opt.zero_grad()
        model(net_input(16)).pow(2).mean().backward()
        opt.step()
    path = tmp_path / "int_model.pt"
    torch.save(model.state_dict(), path)

    torch.manual_seed(2)  # different float weights: everything must come from the state_dict
    fresh = intqat.to_integer(intqat.prepare_qat(SmallNet(), cfg))
    fresh.load_state_dict(torch.load(path, weights_only=True), strict=True)
    model.eval(), fresh.eval()
    x = net_input(8) * 1.2
    with torch.no_grad():
        y, y_fresh = model(x), fresh(x)
    assert torch.equal(y_fresh, y)
    assert not torch.equal(SmallNet()(x), y)  # guard: a float model is not the same function


# ---------------------------------------------------------------------------------------------
# prepare_qat / to_integer / to_deployed: the model-level contract
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CONV_CASES)
def test_prepare_qat_swaps_conv_keeping_its_geometry(case):
    kw = CONV_CASES[case]
    conv = nn.Conv2d(**kw)
    model = intqat.prepare_qat(nn.Sequential(conv), "w8a8")
    fq = model[0]
    assert type(fq) is FakeQuantConv2d
    assert fq.weight is conv.weight and fq.bias is conv.bias
    assert (fq.stride, fq.dilation, fq.groups) == (conv.stride, conv.dilation, conv.groups)
    observe(model, act_input(*CONV_X))
    model.eval()
    x = act_input(*CONV_X, scale=1.5)
    aq = fq.input_quantizer
    x_hat = torch.fake_quantize_per_tensor_affine(x, aq.scale.item(), ref_zero_point(aq), aq.qmin, aq.qmax)
    s_w = ref_weight_scale(fq.weight_quantizer, conv.weight)
    w_hat = torch.fake_quantize_per_channel_affine(conv.weight.detach(), s_w, torch.zeros(s_w.shape, dtype=torch.int32),
                                                   0, -127, 127)
    ref = F.conv2d(x_hat, w_hat, None if conv.bias is None else conv.bias.detach(), conv.stride, kw["padding"],
                   conv.dilation, conv.groups)
    with torch.no_grad():
        assert torch.equal(fq(x), ref)


@pytest.mark.parametrize("bias", [True, False])
def test_prepare_qat_swaps_linear(bias):
    lin = nn.Linear(20, 7, bias=bias)
    model = intqat.prepare_qat(nn.Sequential(lin), "w8a8")
    fq = model[0]
    assert type(fq) is FakeQuantLinear
    assert fq.weight is lin.weight and fq.bias is lin.bias
    observe(model, act_input(32, 20))
    model.eval()
    x = act_input(9, 20, scale=1.5)
    aq = fq.input_quantizer
    x_hat = torch.fake_quantize_per_tensor_affine(x, aq.scale.item(), ref_zero_point(aq), aq.qmin, aq.qmax)
    s_w = ref_weight_scale(fq.weight_quantizer, lin.weight)
    w_hat = torch.fake_quantize_per_channel_affine(lin.weight.detach(), s_w, torch.zeros(7, dtype=torch.int32), 0, -127, 127)
    with torch.no_grad():
        assert torch.equal(fq(x), F.linear(x_hat, w_hat, None if lin.bias is None else lin.bias.detach()))


def test_filter_fn_chooses_by_module_and_fqn():
    model = SmallNet()
    seen = []

    def keep(module, fqn):
        seen.append((fqn, type(module).__name__))
        return fqn != "head.3" and not (isinstance(module, nn.Conv2d) and module.groups > 1)

    intqat.prepare_qat(model, "w8a8", filter_fn=keep)
    assert ("head.3", "Linear") in seen and ("features.3", "Conv2d") in seen and ("features.0", "Conv2d") in seen
    assert type(model.features[0]) is FakeQuantConv2d
    assert type(model.features[3]) is nn.Conv2d
    assert type(model.head[1]) is FakeQuantLinear
    assert type(model.head[3]) is nn.Linear
    observe(model, net_input())
    intqat.to_integer(model, filter_fn=lambda m, fqn: fqn != "head.1")
    assert type(model.features[0]) is IntConv2d
    assert type(model.head[1]) is FakeQuantLinear  # filtered out of to_integer
    assert type(model.head[3]) is nn.Linear


def test_prepare_qat_twice_changes_nothing():
    model = intqat.prepare_qat(SmallNet(), "w8a8_lsq")
    mods, text = dict(model.named_modules()), repr(model)
    params = dict(model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert intqat.prepare_qat(model, "w8a8_lsq") is model
        intqat.prepare_qat(model, "w4a8")  # another config does not re-wrap either
    assert repr(model) == text
    assert dict(model.named_modules()).keys() == mods.keys()
    assert all(m is mods[n] for n, m in model.named_modules())
    assert all(p is params[n] for n, p in model.named_parameters())


def test_to_integer_twice_changes_nothing():
    model = intqat.to_integer(observe(intqat.prepare_qat(SmallNet(), "w8a8"), net_input()))
    mods, text = dict(model.named_modules()), repr(model)
    intqat.to_integer(model)
    intqat.prepare_qat(model)
    assert repr(model) == text and all(m is mods[n] for n, m in model.named_modules())


def test_to_integer_keeps_parameters_and_optimizer_state():
    model = intqat.prepare_qat(SmallNet(), "w8a8_lsq")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(2):
        opt.zero_grad()
        model(net_input()).pow(2).mean().backward()
        opt.step()
    params = dict(model.named_parameters())
    state = {n: {k: v for k, v in opt.state[p].items()} for n, p in params.items()}
    values = {n: {k: v.clone() for k, v in s.items()} for n, s in state.items()}
    assert any("quantizer.scale" in n for n in params)  # LSQ scales are Parameters too

    intqat.to_integer(model)
    assert len([m for m in model.modules() if isinstance(m, (IntLinear, IntConv2d))]) == 4
    after = dict(model.named_parameters())
    assert after.keys() == params.keys()
    assert all(after[n] is params[n] for n in params)
    for n, p in params.items():
        assert opt.state[p].keys() == state[n].keys()
        for k, v in opt.state[p].items():
            assert v is state[n][k] and torch.equal(v, values[n][k])
    # the optimizer keeps working on the integer model
    opt.zero_grad()
    model(net_input()).pow(2).mean().backward()
    opt.step()
    w = params["head.1.weight"]
    assert not torch.equal(opt.state[w]["exp_avg"], values["head.1.weight"]["exp_avg"])
    assert opt.state[w]["step"].item() == values["head.1.weight"]["step"].item() + 1


class MyMHA(nn.MultiheadAttention):
    """A subclass: its forward may differ from MHA's, so intqat leaves it float (nn.MultiheadAttention
    itself converts: tests/test_attention.py)."""


class WithMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attn = MyMHA(8, 2, batch_first=True)

    def forward(self, x):
        h = self.proj(x)
        return self.attn(h, h, h, need_weights=False)[0]


def _mha_warnings(record):
    return [w for w in record if "attn" in str(w.message) and "MultiheadAttention" in str(w.message)]


def test_prepare_qat_leaves_mha_with_one_warning():
    model = WithMHA()
    attn, out_proj, text = model.attn, model.attn.out_proj, repr(model.attn)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        intqat.prepare_qat(model, "w8a8")
    assert len(_mha_warnings(record)) == 1 and len(record) == 1
    assert model.attn is attn and model.attn.out_proj is out_proj and repr(model.attn) == text
    assert type(model.proj) is FakeQuantLinear
    observe(model, torch.randn(2, 5, 8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        intqat.to_integer(model)
    assert len(_mha_warnings(record)) == 1 and len(record) == 1
    assert model.attn is attn and type(model.proj) is IntLinear
    assert model.eval()(torch.randn(2, 5, 8)).shape == (2, 5, 8)


# Regression: to_integer on a float model (which prepares it first) once warned twice about one
# MultiheadAttention; one call, one warning.
def test_to_integer_on_float_model_warns_once_about_mha():
    model = WithMHA()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        intqat.to_integer(model)
    assert type(model.proj) is IntLinear
    assert len(_mha_warnings(record)) == 1, [str(w.message) for w in record]


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), "reflect"),
        (lambda: nn.Conv2d(3, 4, 2, padding="same"), "same"),  # even kernel: torch pads asymmetrically
        (lambda: type("MyLinear", (nn.Linear,), {})(4, 4), "MyLinear"),
    ],
    ids=["reflect", "same-even-kernel", "linear-subclass"],
)
def test_unquantizable_layers_stay_float_with_a_warning(make, why):
    layer = make()
    model = nn.Sequential(layer)
    with pytest.warns(UserWarning, match=why) as record:
        intqat.prepare_qat(model, "w8a8")
    assert len(record) == 1 and "0" in str(record[0].message)
    assert model[0] is layer


# ---------------------------------------------------------------------------------------------
# Conv2d + BatchNorm2d folding
# ---------------------------------------------------------------------------------------------


def conv_bn_relu(bias=True):
    return nn.Sequential(nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=bias), randomized_bn(6), nn.ReLU())


@pytest.mark.parametrize("bias", [True, False])
def test_conv_bn_folded_eval_output(bias):
    model = conv_bn_relu(bias)
    conv, bn = model[0], model[1]
    intqat.prepare_qat(model, "w8a8")
    assert type(model[0]) is FakeQuantConv2d and type(model[1]) is nn.Identity
    assert model[0].bn is bn and model[0].weight is conv.weight
    observe(model, act_input(*CONV_X))
    model.eval()
    x = act_input(*CONV_X, scale=1.5)
    with torch.no_grad():
        y = model[0](x)
        # fold as documented: sf = gamma / sqrt(var + eps), w_fold = W sf, b_fold = beta + (b - mean) sf
        sf = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        w_fold = conv.weight * sf.reshape(-1, 1, 1, 1)
        b = conv.bias if bias else torch.zeros(6)
        b_fold = bn.bias + (b - bn.running_mean) * sf
        aq = model[0].input_quantizer
        x_hat = torch.fake_quantize_per_tensor_affine(x, aq.scale.item(), ref_zero_point(aq), aq.qmin, aq.qmax)
        s_w = torch.clamp(w_fold.abs().amax((1, 2, 3)) / 127, min=EPS)
        w_hat = torch.fake_quantize_per_channel_affine(w_fold, s_w, torch.zeros(6, dtype=torch.int32), 0, -127, 127)
        ref = F.conv2d(x_hat, w_hat, None, 2, 1) + b_fold.reshape(1, -1, 1, 1)
    # rsqrt vs 1 / sqrt and the bias added inside vs after the conv: fp32 rounding only
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # ... and the folded conv + Identity is the model: the BN is not applied a second time
    assert torch.equal(model(x), torch.relu(y))


def test_conv_not_followed_by_matching_bn_is_not_folded():
    model = nn.Sequential(nn.Conv2d(4, 6, 3), nn.ReLU(), nn.BatchNorm2d(6), nn.Conv2d(6, 5, 3), nn.BatchNorm2d(6))
    intqat.prepare_qat(model, "w8a8")
    assert model[0].bn is None and type(model[2]) is nn.BatchNorm2d
    assert model[3].bn is None and type(model[4]) is nn.BatchNorm2d  # 5 channels vs BN(6)


def test_freeze_bn_stats():
    model = intqat.prepare_qat(conv_bn_relu(), "w8a8")
    bn = model[0].bn
    model.train()
    before = [t.clone() for t in (bn.running_mean, bn.running_var)]
    model(act_input(*CONV_X))
    assert not torch.equal(bn.running_mean, before[0]) and not torch.equal(bn.running_var, before[1])

    intqat.freeze_observers(model)
    intqat.freeze_bn_stats(model)
    frozen = [t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    x = act_input(*CONV_X)
    y_train = model(x)
    y_train.sum().backward()
    assert all(torch.equal(a, b) for a, b in zip((bn.running_mean, bn.running_var, bn.num_batches_tracked), frozen))
    assert bn.weight.grad is not None and bn.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(y_train.detach(), model.eval()(x))  # frozen: training folds the running stats too

    model.train()
    intqat.freeze_bn_stats(model, False)
    model(x)
    assert not torch.equal(bn.running_mean, frozen[0])  # un-freezing restarts the updates


def test_integer_conv_never_updates_bn_stats():
    model = observe(intqat.prepare_qat(conv_bn_relu(), "w8a8"), act_input(*CONV_X))
    intqat.to_integer(model)
    bn = model[0].bn
    stats = [t.clone() for t in (bn.running_mean, bn.running_var)]
    model.train()
    model(act_input(*CONV_X)).sum().backward()
    assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])


# ---------------------------------------------------------------------------------------------
# to_deployed
# ---------------------------------------------------------------------------------------------


def _nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd.values())


@pytest.mark.parametrize("cfg", ["w8a8", "w8a8_lsq", "w8a8_dynamic"])
def test_to_deployed_holds_int8_weights_only(cfg):
    float_model = nn.Sequential(
        nn.Conv2d(16, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(256, 384), nn.ReLU(), nn.Linear(384, 256),
    )
    float_bytes = _nbytes(float_model.state_dict())
    model = intqat.to_integer(observe(intqat.prepare_qat(float_model, cfg), torch.randn(4, 16, 6, 6)))
    deployed = intqat.to_deployed(model)
    assert type(model[0]) is IntConv2d and type(model[5]) is IntLinear  # not in place by default
    assert list(deployed.parameters()) == []
    dep = [m for m in deployed.modules() if isinstance(m, (DeployedIntLinear, DeployedIntConv2d))]
    assert len(dep) == 3
    assert all(m.q_w.dtype == torch.int8 for m in dep)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in deployed.modules())  # folded into the conv
    assert not deployed.training
    assert _nbytes(deployed.state_dict()) < 0.35 * float_bytes


# Regressions: DeployedIntConv2d once cached its zero point as a Python int for padding, which
# load_state_dict did not refresh (wrong border outputs); and a per-tensor weight scale was registered as
# an expanded (stride-0) buffer that load_state_dict refused.
@pytest.mark.parametrize("cfg", ["w8a8", "per_tensor_w", "w8a8_dynamic"])
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_deployed_state_dict_round_trip(layer, cfg, tmp_path):
    def build():
        if layer == "linear":
            return intqat.to_deployed(int_linear_module(CONFIGS[cfg]))
        return intqat.to_deployed(int_conv_module(CONFIGS[cfg], "groups2"))

    torch.manual_seed(1)
    deployed = build()
    torch.save(deployed.state_dict(), tmp_path / "deployed.pt")
    torch.manual_seed(2)
    fresh = build()
    fresh.load_state_dict(torch.load(tmp_path / "deployed.pt", weights_only=True), strict=True)
    x = act_input(5, 40) if layer == "linear" else act_input(*CONV_X)
    assert torch.equal(fresh(x), deployed(x))
    assert all(b.numel() == 0 or 0 not in b.stride() for b in fresh.buffers())  # dense buffers


def test_per_tensor_weight_granularity():
    model = int_linear_module(PER_TENSOR_W)
    w = model[0].weight
    dep = intqat.to_deployed(model)[0]
    expected = torch.clamp(w.detach().abs().amax() / 127, min=EPS)
    assert torch.equal(dep.w_scale, expected.expand(12))
    assert dep.q_w.abs().max().item() == 127  # the largest |w| maps to qmax, in one row only
    assert (dep.q_w.abs().amax(1) == 127).sum().item() >= 1


# ---------------------------------------------------------------------------------------------
# An unobserved static quantizer refuses to run in eval
# ---------------------------------------------------------------------------------------------

NO_SCALE = "has no scale yet"


@pytest.mark.parametrize("stage", ["fake_quant", "integer"])
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_unobserved_static_quantizer_raises_in_eval(layer, stage):
    model = nn.Sequential(nn.Linear(8, 4) if layer == "linear" else nn.Conv2d(3, 4, 3))
    x = torch.randn(2, 8) if layer == "linear" else torch.randn(2, 3, 6, 6)
    intqat.prepare_qat(model, "w8a8")
    if stage == "integer":
        with pytest.warns(UserWarning, match="input quantizers of 0 never observed data"):
            intqat.to_integer(model)
    model.eval()
    with pytest.raises(RuntimeError, match=NO_SCALE):
        model(x)
    intqat.freeze_observers(model)  # training with the observer off has no scale either
    with pytest.raises(RuntimeError, match=NO_SCALE):
        model.train()(x)
    intqat.freeze_observers(model, False)
    model.train()(x)  # one observed batch is enough
    assert torch.isfinite(model.eval()(x)).all()


@pytest.mark.parametrize("cfg", ["w8a8_dynamic", "w8a8_lsq"])
def test_dynamic_and_learned_quantizers_need_no_observation(cfg):
    model = intqat.to_integer(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)), config=cfg).eval()
    assert torch.isfinite(model(torch.randn(3, 8))).all()


# Regression: to_deployed once froze an unobserved static quantizer's placeholder scale 1.0 / zero point 0
# without complaint, shipping a model the integer model itself refuses to run.
def test_to_deployed_refuses_unobserved_static_quantizer():
    model = intqat.to_integer(nn.Sequential(nn.Linear(8, 4)), config="w8a8")
    with pytest.raises(RuntimeError, match=NO_SCALE):
        intqat.to_deployed(model)


# Regression: in eval mode with grad enabled IntLinear / IntConv2d once returned an output with no grad_fn
# (FakeQuantLinear and nn.Linear are differentiable in eval): input gradients silently vanished.
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_integer_modules_differentiable_in_eval_mode(layer):
    model = int_linear_module("w8a8") if layer == "linear" else int_conv_module("w8a8", "all")
    x = act_input(5, 40) if layer == "linear" else act_input(*CONV_X)
    g = torch.randn_like(model.eval()(x))
    y_train, gx_train, grads_train = backward_grads(model.train(), x, g)  # observers are frozen
    model.eval()
    x_eval = x.clone().requires_grad_()
    y_eval = model(x_eval)
    assert torch.equal(y_eval.detach(), y_train)
    assert y_eval.requires_grad
    model.zero_grad(set_to_none=True)
    (y_eval * g).sum().backward()
    assert rel_err(x_eval.grad, gx_train) < 1e-5
    for n, p in model.named_parameters():
        assert p.grad is not None and rel_err(p.grad, grads_train[n]) < 1e-5, n


def test_inference_codes_cache_follows_weight_updates(monkeypatch):
    """Eval reuses the weight codes between calls, and recomputes them after every update (the plain-aten path,
    which layers above FUSED_NO_GRAD_MAX_WEIGHTS take without autograd: forced here for small ones)."""
    import intqat.nn.linear as linear_mod

    monkeypatch.setattr(linear_mod, "FUSED_NO_GRAD_MAX_WEIGHTS", 0)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    intqat.prepare_qat(model)
    x = torch.randn(32, 8)
    model(x)  # observe
    intqat.to_integer(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def fresh_eval(m):
        m.eval()
        for layer in m.modules():
            layer.__dict__.pop("_codes_cache", None)
        with torch.no_grad():
            return m(x)

    model.eval()
    with torch.no_grad():
        first = model(x)
        assert torch.equal(model(x), first)  # served from the cache
    assert "_codes_cache" in model[0].__dict__
    model.train()
    F.mse_loss(model(x), torch.randn(32, 4)).backward()
    opt.step()  # in-place update: bumps the weights' version counters
    model.eval()
    with torch.no_grad():
        after = model(x)
    assert not torch.equal(after, first)
    assert torch.equal(after, fresh_eval(copy.deepcopy(model)))
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # any in-place change counts
        assert torch.equal(model(x), fresh_eval(copy.deepcopy(model)))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_small_layers_validate_through_the_training_op(mode, monkeypatch):
    """Without autograd a layer of at most FUSED_NO_GRAD_MAX_WEIGHTS weights runs the training op (no codes cached),
    a larger one the plain-aten path with its cache: the same bits, and in train mode the same observer updates."""
    import intqat.nn.linear as linear_mod

    if intqat.ops.cpp_step.unavailable_reason() is not None:
        pytest.skip(f"C++ training op cannot run here: {intqat.ops.cpp_step.unavailable_reason()}")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 10))
    intqat.prepare_qat(model)
    intqat.calibrate(model, [torch.randn(16, 64)])
    intqat.to_integer(model)
    model.train(mode == "train")
    ref = copy.deepcopy(model)
    big = model[2].weight.numel()
    assert model[0].weight.numel() <= linear_mod.FUSED_NO_GRAD_MAX_WEIGHTS < big
    xs = [torch.randn(16, 64) * (1 + i) for i in range(3)]  # (wider batches: a train-mode call moves the ranges)
    with torch.inference_mode():
        ys = [model(x) for x in xs]
    assert "_codes_cache" not in model[0].__dict__ and "_codes_cache" not in model[4].__dict__  # the op ran
    assert "_codes_cache" in model[2].__dict__  # above the bound: cached codes
    monkeypatch.setattr(linear_mod, "FUSED_NO_GRAD_MAX_WEIGHTS", 0)
    with torch.no_grad():
        for x, y in zip(xs, ys):
            assert torch.equal(ref(x), y)
    for (k, t), u in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(t, u), k


@pytest.mark.parametrize("stage", ["fake_quant", "integer"])
def test_a_learned_scale_stepped_below_zero_is_put_back_to_eps(stage):
    """An optimizer step can push an LSQ scale to <= 0; the next training forward puts it back to SCALE_EPS
    (as torch.ao's learnable fake quant), in place, instead of dividing by zero or saturating every code."""
    from intqat.ops.qparams import SCALE_EPS

    torch.manual_seed(0)
    model = intqat.prepare_qat(nn.Sequential(nn.Linear(8, 4)), "w8a8_lsq")
    x = torch.randn(16, 8)
    intqat.calibrate(model, [x])
    if stage == "integer":
        model = intqat.to_integer(model)
    model.train()
    layer = model[0]
    aq, wq = layer.input_quantizer, layer.weight_quantizer
    with torch.no_grad():
        aq.scale.fill_(-0.05)
        wq.scale[0] = 0.0
    scale_param = aq.scale
    y = model(x)
    assert aq.scale is scale_param and aq.scale.item() == pytest.approx(SCALE_EPS)  # the same Parameter
    assert wq.scale[0].item() == pytest.approx(SCALE_EPS) and bool((wq.scale > 0).all())
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(aq.scale.grad).all() and torch.isfinite(wq.scale.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_integer_layers_return_the_input_dtype(dtype):
    """A bf16 / fp16 model stays in its dtype through the integer layers, as through nn.Linear / nn.Conv2d (they
    returned float32, and a bf16 LayerNorm after them refused the mixed dtypes); the arithmetic inside is the
    deployed float32 epilogue, rounded once to the input dtype: training == eval == deployed, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model = model.to(dtype)
    x = torch.randn(2, 3, 6, 6, dtype=dtype)
    intqat.prepare_qat(model, "w8a8")
    intqat.calibrate(model, [x])
    intqat.freeze_observers(model)
    model = intqat.to_integer(model).train()
    y_train = model(x)
    assert y_train.dtype == dtype and model[2](torch.randn(2, 64, dtype=dtype)).dtype == dtype
    y_train.float().sum().backward()
    assert model[0].weight.grad.dtype == dtype and torch.isfinite(model[4].weight.grad.float()).all()
    model.eval()
    with torch.no_grad():
        y_eval = model(x)
        y_deployed = intqat.to_deployed(model)(x)
    assert torch.equal(y_train.detach(), y_eval) and torch.equal(y_eval, y_deployed)
    grouped = intqat.prepare_qat(nn.Sequential(nn.Linear(64, 8)).to(dtype), "8da4w")
    grouped = intqat.to_integer(grouped)
    assert grouped(torch.randn(3, 64, dtype=dtype)).dtype == dtype
