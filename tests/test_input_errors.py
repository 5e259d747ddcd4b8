"""Bad input to the public ops gets a ValueError that names what was wrong, never a silently wrong number.

The cases come from a review that fed the ops what users get wrong: a conv bias of the wrong length (the C
epilogue read past its end), a Python float where a tensor scale goes, string padding, a kernel larger than
the input, a fractional zero point (truncated toward zero: off by one on one side only), an axis out of
range (wrapped silently), a float qmin. Also the edge cases that crashed: an empty batch with per-token
scales, a float64 bias (float64 output on one backend only).
"""

from __future__ import annotations

import pytest
import torch

from intqat.ops import backends, dequantize, int_linear, int_linear_grouped, quantize
from intqat.ops.int_conv2d import int_conv2d


def _conv_args(**over):
    args = dict(x=torch.randn(2, 3, 6, 6), weight=torch.randn(4, 3, 3, 3), bias=torch.randn(4),
                x_scale=torch.tensor([0.05]), x_zero_point=torch.tensor([0.0]), w_scale=torch.full((4,), 0.02))
    args.update(over)
    return args


@pytest.mark.parametrize("over,kw,match", [
    (dict(bias=torch.randn(5)), {}, r"bias must have shape \(4,\) for weight \(4, 3, 3, 3\), got \(5,\)"),
    (dict(bias=torch.randn(3)), {}, r"bias must have shape \(4,\)"),  # (read past the end in C before)
    (dict(bias=torch.randn(1)), {}, r"bias must have shape \(4,\)"),  # (channel 0 only on the fused paths)
    (dict(w_scale=None), {}, r"w_scale must be a tensor of one scale per output channel, shape \(4,\), got None"),
    (dict(x_scale=0.05), {}, r"x_scale as a tensor of shape \(1,\), got 0.05"),
    ({}, dict(padding="same"), r"padding must be an int or a pair.*'same'.*resolved by IntConv2d"),
    ({}, dict(stride=0), r"stride must be an int or a pair of ints >= 1, got 0"),
    ({}, dict(dilation=(1, 2, 3)), r"dilation must be"),
    ({}, dict(groups=0), r"groups must be a positive int"),
    (dict(x=torch.randn(2, 3, 2, 2)), {}, r"kernel's height 3 .* exceeds the padded input's 2 \+ 2 \* 0"),
])
def test_int_conv2d_names_what_is_wrong(over, kw, match):
    a = _conv_args(**over)
    with pytest.raises(ValueError, match=match):
        int_conv2d(a["x"], a["weight"], a["bias"], a["x_scale"], a["x_zero_point"], a["w_scale"], **kw)


def test_int_conv2d_still_takes_what_nn_conv2d_gives():
    a = _conv_args()
    y = int_conv2d(a["x"], a["weight"], a["bias"], a["x_scale"], a["x_zero_point"], a["w_scale"],
                   stride=(2, 1), padding=(1, 0), dilation=[1, 1])
    assert y.shape == (2, 4, 3, 4)


@pytest.mark.parametrize("kw,match", [
    (dict(x_scale=0.02), r"x_scale must be a tensor \(or None\), got float 0.02"),
    (dict(x_zero_point=3), r"x_zero_point must be a tensor \(or None\), got int 3"),
    (dict(x_qmin=-128.0), r"qmin must be an int, got float -128.0"),
])
def test_int_linear_names_what_is_wrong(kw, match):
    args = dict(x_scale=torch.tensor([0.02]), x_zero_point=torch.tensor([3.0]))
    x_qmin = kw.pop("x_qmin", -128)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        int_linear(torch.randn(4, 8), torch.randn(3, 8), None, args["x_scale"], args["x_zero_point"], None,
                   x_qmin=x_qmin)


def test_quantize_refuses_a_fractional_zero_point_and_an_axis_out_of_range():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"zero_point must hold integers, got \[2.5\]"):
        quantize(x, 0.1, torch.tensor([2.5]), -128, 127)
    with pytest.raises(ValueError, match=r"zero_point must hold integers"):
        dequantize(torch.zeros(4, 8, dtype=torch.int8), 0.1, 0.5)
    with pytest.raises(ValueError, match=r"axis 5 is out of range for input of shape \(4, 8\)"):
        quantize(x, torch.full((4,), 0.1), torch.zeros(4), -128, 127, axis=5)
    # integral float zero points (an observer's) and negative axes still work
    q = quantize(x, torch.full((4,), 0.1), torch.full((4,), 3.0), -128, 127, axis=-2)
    assert torch.equal(q, quantize(x, torch.full((4,), 0.1), torch.full((4,), 3), -128, 127, axis=0))


@pytest.mark.parametrize("backend", ["default", "reference"])
def test_an_empty_batch_with_per_token_scales_trains(backend):
    """M = 0 gives 0 per-token scales: neither one scale nor per-row by the old `numel() > 1` test."""
    ctx = backends.use_backend("reference") if backend == "reference" else torch.enable_grad()
    with ctx:
        w = torch.randn(5, 64, requires_grad=True)
        y = int_linear_grouped(torch.randn(0, 64, requires_grad=True), w, None, None, None, None, group_size=32)
        y.sum().backward()
        assert y.shape == (0, 5) and torch.equal(w.grad, torch.zeros_like(w))
        w2 = torch.randn(3, 8, requires_grad=True)
        y = int_linear(torch.randn(0, 8, requires_grad=True), w2, None, None, None, None, x_dynamic=True)
        y.sum().backward()
        assert y.shape == (0, 3) and torch.equal(w2.grad, torch.zeros_like(w2))


def test_a_float64_bias_gives_float32_output_on_every_backend():
    x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3, dtype=torch.float64)
    s, z = torch.tensor([0.02]), torch.tensor([3.0])
    y = int_linear(x, w, b, s, z, None)
    with backends.use_backend("reference"):
        y_ref = int_linear(x, w, b, s, z, None)
    assert y.dtype == y_ref.dtype == torch.float32 and torch.equal(y, y_ref)


def test_a_layer_refusing_its_input_names_itself():
    import intqat
    from torch import nn

    model = intqat.prepare_qat(nn.Sequential(nn.Linear(8, 4), nn.Conv2d(3, 2, 3)), "w8a8")
    intqat.calibrate(model[0:1], [torch.randn(4, 8)])
    intqat.calibrate(model[1:2], [torch.randn(1, 3, 5, 5)])
    model = intqat.to_integer(model).train()
    with pytest.raises(ValueError, match=r"integer layer '0': int_linear: K mismatch: x is \(4, 7\)"):
        model[0](torch.randn(4, 7))
    with pytest.raises(ValueError, match=r"integer layer '1': int_conv2d: weight \(2, 3, 3, 3\)"):
        model[1](torch.randn(1, 4, 5, 5))


def test_calibrate_takes_a_dict_batch_as_keyword_arguments():
    import intqat
    from torch import nn

    class TakesKeywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, input_ids, attention_mask=None):
            return self.proj(input_ids * attention_mask[..., None])

    model = intqat.prepare_qat(TakesKeywords(), "w8a8")
    intqat.calibrate(model, [{"input_ids": torch.randn(2, 5, 8), "attention_mask": torch.ones(2, 5)}])
    assert bool(model.proj.input_quantizer.initialized)


@pytest.mark.parametrize("scale", [0.0, -0.05, float("nan"), float("inf")])
def test_set_qparams_refuses_a_scale_that_is_not_positive(scale):
    from intqat import QuantSpec
    from intqat.nn import ActivationQuantizer

    aq = ActivationQuantizer(QuantSpec(bits=8, symmetric=False))
    with pytest.raises(ValueError, match="scale must be one positive finite number"):
        aq.set_qparams(scale, 3.0)
    aq.set_qparams(0.05, 3.0)
    assert aq.scale.item() == pytest.approx(0.05)


def test_to_integer_of_a_model_that_never_saw_data_says_which_layers():
    import intqat
    from torch import nn

    model = intqat.prepare_qat(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)), "w8a8")
    with pytest.warns(UserWarning, match=r"input quantizers of 0, 2 never observed data"):
        model = intqat.to_integer(model)
    with pytest.raises(RuntimeError, match=r"activation quantizer of layer '0' has no scale yet"):
        model.eval()(torch.randn(3, 8))
