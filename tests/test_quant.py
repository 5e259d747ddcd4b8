"""quantize / dequantize follow torch's fake-quant formula bit for bit; qparams helpers."""

import pytest
import torch

from intqat.ops import choose_qparams, dequantize, fake_quantize, qrange, quantize, quantize_with_mask


def _ties(n=4096):
    # values that land exactly on .5 after scaling: the round-half-to-even cases
    return (torch.arange(n, dtype=torch.float32) - n / 2) * 0.5


@pytest.mark.parametrize("qmin,qmax", [(-128, 127), (-127, 127), (-8, 7), (0, 15)])
def test_per_tensor_matches_torch_fake_quantize_bitwise(qmin, qmax):
    x = torch.cat([torch.randn(10_000) * 3, _ties() * 0.01])
    for scale, zp in [(0.0123, 0), (0.05, 3), (0.01, -5), (1 / 3, 1)]:
        s = torch.tensor([scale], dtype=torch.float32)
        z = max(qmin, min(qmax, zp))
        ref = torch.fake_quantize_per_tensor_affine(x, s, torch.tensor([z], dtype=torch.int32), qmin, qmax)
        ours = dequantize(quantize(x, s, z, qmin, qmax), s, z)
        assert torch.equal(ours, ref), (scale, zp)


def test_per_channel_matches_torch_fake_quantize_bitwise():
    x = torch.randn(16, 33) * torch.logspace(-2, 1, 16)[:, None]
    s = x.abs().amax(1) / 127 * torch.linspace(0.5, 1.0, 16)  # some clipping
    z = torch.randint(-4, 5, (16,), dtype=torch.int32)
    ref = torch.fake_quantize_per_channel_affine(x, s, z, 0, -128, 127)
    assert torch.equal(fake_quantize(x, s, z, -128, 127, axis=0), ref)
    # along the last axis as well
    ref1 = torch.fake_quantize_per_channel_affine(x, s[:1].expand(33).contiguous(), z[:1].expand(33).contiguous(), 1, -128, 127)
    assert torch.equal(fake_quantize(x, s[:1].expand(33), z[:1].expand(33), -128, 127, axis=1), ref1)


def test_clip_mask_is_torch_cachemask():
    x = torch.randn(5000) * 4
    s, z = torch.tensor([0.02]), 7
    _, ref_mask = torch.fake_quantize_per_tensor_affine_cachemask(x, 0.02, z, -128, 127) if hasattr(
        torch, "fake_quantize_per_tensor_affine_cachemask") else torch.ops.aten.fake_quantize_per_tensor_affine_cachemask(x, 0.02, z, -128, 127)
    q, mask = quantize_with_mask(x, s, z, -128, 127)
    assert q.dtype == torch.int8
    assert torch.equal(mask, ref_mask)
    assert 0 < (~mask).sum() < x.numel()  # the case exercises clipping on both sides


@pytest.mark.parametrize("bits,sym,expected", [(8, True, (-127, 127)), (8, False, (-128, 127)), (4, True, (-7, 7)), (4, False, (-8, 7))])
def test_qrange(bits, sym, expected):
    assert qrange(bits, sym) == expected


def test_qrange_rejects_widths():
    with pytest.raises(ValueError, match="bits must be between 2 and 8"):
        qrange(9, True)


@pytest.mark.parametrize("granularity,shape", [("tensor", (1,)), ("channel", (6,)), ("token", (6,)), ("group", (6, 4))])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_choose_qparams_covers_range_without_clipping(granularity, shape, sym, bits):
    x = torch.randn(6, 32) * 2 + 0.5
    scale, zp = choose_qparams(x, bits=bits, symmetric=sym, granularity=granularity, group_size=8)
    assert tuple(scale.shape) == shape and scale.dtype == torch.float32 and zp.dtype == torch.int32
    qmin, qmax = qrange(bits, sym)
    if sym:
        assert torch.all(zp == 0)
    # min-max scales never clip: every value is representable within half a step
    if granularity == "tensor":
        xs, s, z = x, scale, zp
        _, mask = quantize_with_mask(xs, s, z, qmin, qmax)
    elif granularity in ("channel", "token"):
        _, mask = quantize_with_mask(x, scale, zp, qmin, qmax, axis=0)
    else:
        g = x.reshape(6, 4, 8)
        r = torch.round(g * torch.reciprocal(scale)[..., None]) + zp[..., None]
        mask = (r >= qmin) & (r <= qmax)
    assert mask.all()


def test_choose_qparams_errors():
    with pytest.raises(ValueError, match="group_size"):
        choose_qparams(torch.randn(4, 10), granularity="group", group_size=3)
    with pytest.raises(ValueError, match="floating-point"):
        choose_qparams(torch.ones(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="granularity"):
        choose_qparams(torch.randn(4, 4), granularity="row")


def test_quantize_errors_name_shapes_and_dtypes():
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        quantize(x, torch.ones(3), 0, -128, 127, axis=0)
    with pytest.raises(ValueError, match="one element"):
        quantize(x, torch.ones(4), 0, -128, 127)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(x.to(torch.int32), 1.0, 0, -128, 127)
    with pytest.raises(ValueError, match="qmin"):
        quantize(x, 1.0, 0, -200, 127)
    with pytest.raises(ValueError, match="integer codes"):
        dequantize(x, 1.0, 0)


@pytest.mark.parametrize("axis", [None, 0])
def test_fake_quantize_keeps_nan_on_every_backend(axis):
    """The fused pass and the traced (reference) path agree on NaN: it stays NaN, so a diverged batch reaches the
    loss under torch.compile too (the reference used to return the finite -z*s of the code 0)."""
    from intqat.ops import backends

    x = torch.tensor([[float("nan"), 1.0, float("inf")], [0.25, float("-inf"), -3.0]])
    s = torch.tensor([0.1, 0.2]) if axis == 0 else 0.1
    z = torch.tensor([3, -2]) if axis == 0 else 3
    eager = fake_quantize(x, s, z, -128, 127, axis)
    with backends.use_backend("reference"):
        traced = fake_quantize(x, s, z, -128, 127, axis)
    assert torch.isnan(eager[0, 0]) and torch.equal(eager.view(torch.int32), traced.view(torch.int32))
