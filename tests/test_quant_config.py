"""QuantSpec / QuantConfig: validation, presets, and configs given as strings or dicts.

Every ValueError branch is triggered by the input it guards against, and the message is checked
for the fragment that tells the user how to fix it. Presets are checked for what they promise
(bits, ranges, granularity, dynamic / learnable), and a preset name or a dict is accepted by every
entry point that takes a config.
"""

import dataclasses

import pytest
import torch
from torch import nn

import intqat
from intqat import PRESETS, QuantConfig, QuantSpec, resolve_config
from intqat.nn import FakeQuantConv2d, FakeQuantLinear, IntLinear

PRESET_NAMES = ("w8a8", "w8a8_sym", "w8a8_dynamic", "w4a8", "w8a8_lsq", "8da4w", "w8a8_g128")


# ---------------------------------------------------------------------------------------------
# QuantSpec: one test per ValueError branch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 9, 0, -8, 8.0, "8", None])
def test_spec_bits_out_of_range_or_not_int(bits):
    with pytest.raises(ValueError, match=r"bits must be an int in 2\.\.8, e\.g\. QuantSpec\(bits=8\)"):
        QuantSpec(bits=bits)


@pytest.mark.parametrize("bits", range(2, 9))
def test_spec_bits_in_range_accepted_with_documented_ranges(bits):
    sym, asym = QuantSpec(bits=bits, symmetric=True), QuantSpec(bits=bits, symmetric=False)
    half = 2 ** (bits - 1)
    # symmetric: narrow range, zero exact and +/- saturate alike; asymmetric: full range
    assert (sym.qmin, sym.qmax) == (-(half - 1), half - 1)
    assert (asym.qmin, asym.qmax) == (-half, half - 1)


@pytest.mark.parametrize("granularity", ["row", "per_channel", "Tensor", "", None])
def test_spec_unknown_granularity(granularity):
    with pytest.raises(ValueError, match="use 'tensor', 'channel', 'token' or 'group'"):
        QuantSpec(granularity=granularity)


@pytest.mark.parametrize("group_size", [None, 0, -32, 32.0, "32"])
def test_spec_group_needs_positive_int_group_size(group_size):
    with pytest.raises(ValueError, match=r"give a positive group_size, e\.g\. QuantSpec\(granularity='group', group_size=32\)"):
        QuantSpec(granularity="group", group_size=group_size)


def test_spec_group_with_group_size_accepted():
    assert QuantSpec(granularity="group", group_size=32).group_size == 32


@pytest.mark.parametrize("granularity", ["tensor", "channel", "token"])
def test_spec_group_size_without_group_granularity(granularity):
    with pytest.raises(ValueError, match="drop group_size or set granularity='group'"):
        QuantSpec(granularity=granularity, group_size=32)


@pytest.mark.parametrize("observer", ["histogram", "min_max", "", None])
def test_spec_unknown_observer(observer):
    with pytest.raises(ValueError, match="use 'minmax', 'moving_average' or 'percentile'"):
        QuantSpec(observer=observer)


@pytest.mark.parametrize("c", [0.0, -0.1, 1.0000001, 2.0, float("nan")])
def test_spec_averaging_constant_outside_unit_interval(c):
    with pytest.raises(ValueError, match=r"averaging_constant=.*must be in \(0, 1\]"):
        QuantSpec(averaging_constant=c)


@pytest.mark.parametrize("c", [1e-6, 0.01, 1.0])
def test_spec_averaging_constant_bounds_accepted(c):
    assert QuantSpec(averaging_constant=c).averaging_constant == c


@pytest.mark.parametrize("p", [50.0, 10.0, 100.01, 0.0, float("nan")])
def test_spec_percentile_outside_range(p):
    with pytest.raises(ValueError, match=r"percentile=.*must be in \(50, 100\]"):
        QuantSpec(percentile=p)


@pytest.mark.parametrize("p", [50.001, 99.99, 100.0])
def test_spec_percentile_bounds_accepted(p):
    assert QuantSpec(percentile=p).percentile == p


def test_spec_dynamic_and_learnable_exclusive():
    with pytest.raises(ValueError, match=r"choose one, e\.g\. QuantSpec\(dynamic=True\)"):
        QuantSpec(dynamic=True, learnable=True)


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QuantSpec().bits = 4


# ---------------------------------------------------------------------------------------------
# QuantConfig: one test per ValueError branch
# ---------------------------------------------------------------------------------------------


def test_config_asymmetric_weights_rejected():
    with pytest.raises(ValueError, match=r"use weight=QuantSpec\(symmetric=True"):
        QuantConfig(weight=QuantSpec(symmetric=False, granularity="channel"))


@pytest.mark.parametrize("spec", [QuantSpec(granularity="token")])  # per-group weights: test_grouped_linear.py
def test_config_weight_granularity_unsupported(spec):
    with pytest.raises(ValueError, match=r"use weight=QuantSpec\(granularity='channel'\)"):
        QuantConfig(weight=spec)


def test_config_dynamic_weights_rejected():
    with pytest.raises(ValueError, match="drop dynamic=True from the weight spec"):
        QuantConfig(weight=QuantSpec(granularity="channel", dynamic=True))


@pytest.mark.parametrize(
    "spec", [QuantSpec(granularity="channel", symmetric=False), QuantSpec(granularity="group", group_size=8)]
)
def test_config_activation_granularity_unsupported(spec):
    with pytest.raises(ValueError, match=r"use 'tensor' \(static or dynamic\) or 'token' \(dynamic\)"):
        QuantConfig(activation=spec)


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(granularity="token", dynamic=False),  # per-token scales must be dynamic
        QuantSpec(granularity="tensor", dynamic=True, symmetric=True),  # dynamic must be per token
        QuantSpec(granularity="token", dynamic=True, symmetric=False),  # dynamic must be symmetric
    ],
    ids=["token-static", "tensor-dynamic", "token-dynamic-asym"],
)
def test_config_dynamic_activation_rules(spec):
    with pytest.raises(ValueError, match=r"use activation=QuantSpec\(granularity='token', dynamic=True"):
        QuantConfig(activation=spec)


def test_config_specs_given_as_dicts_are_built_and_validated():
    cfg = QuantConfig(weight={"bits": 4, "granularity": "channel"}, activation={"symmetric": False})
    assert isinstance(cfg.weight, QuantSpec) and isinstance(cfg.activation, QuantSpec)
    assert (cfg.weight.bits, cfg.weight.qmin, cfg.weight.qmax) == (4, -7, 7)
    with pytest.raises(ValueError, match="bits must be an int in 2..8"):
        QuantConfig(weight={"bits": 12})
    with pytest.raises(ValueError, match=r"use weight=QuantSpec\(symmetric=True"):
        QuantConfig(weight={"symmetric": False})


def test_config_to_dict_round_trips():
    for name in PRESET_NAMES:
        cfg = PRESETS[name]
        assert QuantConfig(**cfg.to_dict()) == cfg
        assert resolve_config(cfg.to_dict()) == cfg


def test_config_replace_is_validated():
    base = QuantConfig()
    assert base.replace(weight=QuantSpec(bits=4, granularity="channel")).weight.bits == 4
    with pytest.raises(ValueError, match="weights must be symmetric"):
        base.replace(weight=QuantSpec(symmetric=False))


# Regression: a weight / activation that is neither a QuantSpec nor a dict (QuantConfig(weight=4)) used to
# die in an AttributeError far from the call; it is refused with what is expected.
@pytest.mark.parametrize("field, value", [("weight", 4), ("activation", "w8a8")])
def test_config_spec_of_wrong_type_says_what_is_expected(field, value):
    with pytest.raises((TypeError, ValueError), match="QuantSpec"):
        QuantConfig(**{field: value})


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


def test_presets_are_exactly_the_documented_ones():
    assert set(PRESETS) == set(PRESET_NAMES)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_resolves_by_name_everywhere(name):
    cfg = QuantConfig.from_preset(name)
    assert isinstance(cfg, QuantConfig)
    assert resolve_config(name) == cfg == PRESETS[name]
    # every preset satisfies the integer-kernel rules: symmetric per-channel or per-group weights
    assert cfg.weight.symmetric and cfg.weight.granularity in ("channel", "group") and not cfg.weight.dynamic


def test_preset_w8a8_meaning():
    cfg = resolve_config("w8a8")
    assert (cfg.weight.qmin, cfg.weight.qmax) == (-127, 127)
    a = cfg.activation
    assert (a.qmin, a.qmax, a.granularity, a.dynamic, a.learnable) == (-128, 127, "tensor", False, False)
    assert resolve_config(None) == cfg  # None means the default preset


def test_preset_w8a8_dynamic_meaning():
    a = resolve_config("w8a8_dynamic").activation
    assert (a.granularity, a.dynamic, a.symmetric, a.qmin, a.qmax) == ("token", True, True, -127, 127)


def test_preset_w4a8_meaning():
    cfg = resolve_config("w4a8")
    assert (cfg.weight.bits, cfg.weight.qmin, cfg.weight.qmax) == (4, -7, 7)
    assert (cfg.activation.bits, cfg.activation.dynamic) == (8, False)


def test_preset_w8a8_lsq_meaning():
    cfg = resolve_config("w8a8_lsq")
    assert cfg.weight.learnable and cfg.activation.learnable
    assert not cfg.activation.symmetric  # LSQ+ learns the activation zero point


@pytest.mark.parametrize("bad", ["w8a16", "W8A8", "", "w8a8 "])
def test_unknown_preset_lists_available(bad):
    for call in (QuantConfig.from_preset, resolve_config):
        with pytest.raises(ValueError, match="unknown QuantConfig preset") as ei:
            call(bad)
        for name in PRESET_NAMES:
            assert name in str(ei.value)


def test_unknown_preset_inside_dict_lists_available():
    with pytest.raises(ValueError, match="available: ") as ei:
        resolve_config({"preset": "int4"})
    assert all(name in str(ei.value) for name in PRESET_NAMES)


# ---------------------------------------------------------------------------------------------
# Dicts
# ---------------------------------------------------------------------------------------------


def test_dict_preset_with_partial_override_merges_into_the_preset():
    cfg = resolve_config({"preset": "w8a8", "weight": {"bits": 4}})
    base = PRESETS["w8a8"]
    assert cfg.weight == dataclasses.replace(base.weight, bits=4)  # only bits changed, still per channel
    assert cfg.activation == base.activation
    assert resolve_config({"preset": "w8a8_lsq", "activation": {"bits": 6}}).activation == dataclasses.replace(
        PRESETS["w8a8_lsq"].activation, bits=6
    )
    assert resolve_config({"preset": "w4a8"}) == PRESETS["w4a8"]
    assert resolve_config({"preset": "w8a8", "weight": None}) == base


def test_dict_without_preset_builds_specs():
    cfg = resolve_config({"weight": {"bits": 6, "granularity": "channel"}, "activation": {"symmetric": False}})
    assert cfg == QuantConfig(weight=QuantSpec(bits=6, granularity="channel"), activation=QuantSpec(symmetric=False))


def test_dict_overrides_are_validated():
    with pytest.raises(ValueError, match="bits must be an int in 2..8"):
        resolve_config({"preset": "w8a8", "weight": {"bits": 16}})
    with pytest.raises(ValueError, match=r"use weight=QuantSpec\(symmetric=True"):
        resolve_config({"preset": "w8a8", "weight": {"symmetric": False}})
    with pytest.raises(ValueError, match="choose one"):
        resolve_config({"preset": "w8a8_dynamic", "activation": {"learnable": True}})


@pytest.mark.parametrize("d", [{"preset": "w8a8", "wieght": {"bits": 4}}, {"weights": {"bits": 4}}, {"bits": 4}])
def test_dict_unknown_top_level_keys_list_valid_ones(d):
    with pytest.raises(ValueError, match=r"unknown QuantConfig keys \[.*\]; valid: preset, weight, activation"):
        resolve_config(d)


# Regression: an unknown key inside a weight / activation dict ({"weight": {"bitz": 4}}) used to raise
# QuantSpec's bare TypeError; the message lists the valid keys, as at the top level.
@pytest.mark.parametrize(
    "make",
    [
        lambda: resolve_config({"preset": "w8a8", "weight": {"bitz": 4}}),
        lambda: resolve_config({"activation": {"dynamc": True}}),
        lambda: QuantConfig(weight={"bitz": 4}),
    ],
    ids=["preset+weight", "activation", "QuantConfig-dict"],
)
def test_dict_unknown_spec_keys_list_valid_ones(make):
    with pytest.raises((ValueError, TypeError)) as ei:
        make()
    msg = str(ei.value)
    for valid in ("bits", "symmetric", "granularity", "group_size", "dynamic", "learnable", "observer"):
        assert valid in msg.replace("bitz", ""), f"{valid!r} not listed in: {msg}"


def test_omegaconf_dictconfig_accepted():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = resolve_config(omegaconf.OmegaConf.create({"preset": "w8a8", "weight": {"bits": 4}}))
    assert cfg == resolve_config({"preset": "w8a8", "weight": {"bits": 4}})


def test_wrong_config_type_rejected():
    with pytest.raises(TypeError, match="expected a QuantConfig, a preset name or a dict, got int"):
        resolve_config(8)


# ---------------------------------------------------------------------------------------------
# A string or dict is accepted wherever a config is
# ---------------------------------------------------------------------------------------------

CONFIG_FORMS = {
    "object": QuantConfig(weight=QuantSpec(bits=4, granularity="channel")),
    "dict": {"preset": "w8a8", "weight": {"bits": 4}},
    "dict-no-preset": {"weight": {"bits": 4, "granularity": "channel"},
                       "activation": dataclasses.asdict(PRESETS["w8a8"].activation)},
}


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def _check_w4a8_like(model):
    qm = intqat.quantized_modules(model)
    assert len(qm) == 2
    for m in qm.values():
        assert (m.weight_quantizer.qmin, m.weight_quantizer.qmax) == (-7, 7)
        assert (m.input_quantizer.qmin, m.input_quantizer.qmax) == (-128, 127)


@pytest.mark.parametrize("form", CONFIG_FORMS)
def test_prepare_qat_accepts_every_config_form(form):
    model = intqat.prepare_qat(_net(), CONFIG_FORMS[form])
    _check_w4a8_like(model)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_prepare_qat_accepts_preset_names(name):
    model = intqat.prepare_qat(_net(), name)
    for m in intqat.quantized_modules(model).values():
        assert m.input_quantizer.spec == PRESETS[name].activation
        assert m.weight_quantizer.spec == PRESETS[name].weight


@pytest.mark.parametrize("form", CONFIG_FORMS)
def test_to_integer_accepts_every_config_form(form):
    model = intqat.to_integer(_net(), config=CONFIG_FORMS[form])
    assert isinstance(model[2], IntLinear)
    _check_w4a8_like(model)


def test_entry_points_reject_unknown_preset():
    for call in (lambda: intqat.prepare_qat(_net(), "w3a3"), lambda: intqat.to_integer(_net(), config="w3a3")):
        with pytest.raises(ValueError, match="available: .*w8a8"):
            call()


# Regression: FakeQuantLinear.from_linear / FakeQuantConv2d.from_conv take a preset name or a dict, as
# every entry point does (they once read config.activation directly).
@pytest.mark.parametrize("form", ["w4a8", {"preset": "w8a8", "weight": {"bits": 4}}], ids=["str", "dict"])
def test_module_constructors_accept_string_and_dict_configs(form):
    lin = FakeQuantLinear.from_linear(nn.Linear(8, 4), form)
    conv = FakeQuantConv2d.from_conv(nn.Conv2d(3, 4, 3), form)
    for m in (lin, conv):
        assert (m.weight_quantizer.qmin, m.weight_quantizer.qmax) == (-7, 7)
        assert torch.isfinite(m.train()(torch.randn(2, 8) if m is lin else torch.randn(2, 3, 5, 5))).all()
