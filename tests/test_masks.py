"""Clip masks saved as bits (intqat/ops/masks.py): an exact round trip, and 1/8 of the bytes."""

import pytest
import torch

from intqat.bench.saved import saved_bytes
from intqat.ops import int_linear
from intqat.ops.masks import pack_mask, unpack_mask


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (8,), (9,), (3, 5), (64, 17), (2, 3, 11)])
def test_pack_unpack_round_trip(shape):
    for p in (0.0, 0.3, 1.0):
        mask = torch.rand(shape) < p
        packed = pack_mask(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-mask.numel() // 8)
        assert torch.equal(unpack_mask(packed, mask.shape), mask)
    # bit order: element 8 j + i is bit i of byte j
    assert pack_mask(torch.tensor([True] + [False] * 7 + [False, True])).tolist() == [1, 2]


def _static_layer(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3).requires_grad_()
    W = (torch.randn(N, K, generator=g) * 0.05).requires_grad_()
    b = torch.zeros(N, requires_grad=True)
    s_x, z_x = torch.tensor([0.02]), torch.tensor([3.0])  # some activations clip
    s_w = W.detach().abs().amax(1) / 127 * 0.8  # some weights clip: the weight mask is kept too
    return x, W, b, s_x, z_x, s_w


def test_saved_bytes_of_a_static_w8a8_layer_are_under_0_3x_a_lean_fake_quant_layer():
    """#16: M=512, K=N=256. The lean fake-quant reference keeps fp32 x and W plus bool masks."""
    M, K, N = 512, 256, 256
    x, W, b, s_x, z_x, s_w = _static_layer(M, K, N)
    nbytes, y = saved_bytes(lambda: int_linear(x, W, b, s_x, z_x, s_w), exclude=[W, b])
    lean_fake_quant = 4 * (M * K + N * K) + (M * K + N * K)
    assert nbytes <= 0.3 * lean_fake_quant, (nbytes, lean_fake_quant)
    # codes (1 byte an element) + masks (1 bit an element) + scales: nothing else is kept
    assert nbytes <= (M * K + N * K) * (1 + 1 / 8) + 4 * N + 64


def _assert_gradients_follow_the_bool_masks(M, K, N, seed):
    """grad_x = (g @ w_hat) * mask_x, grad_w = (gᵀ @ x_hat) * mask_w, the masks from quantize_with_mask."""
    from intqat.ops import dequantize, quantize_with_mask

    x, W, b, s_x, z_x, s_w = _static_layer(M, K, N, seed=seed)
    y = int_linear(x, W, b, s_x, z_x, s_w, grad_gemm="fp32")
    g = torch.randn(M, N)
    gx, gw = torch.autograd.grad(y, [x, W], g)
    q_x, mask_x = quantize_with_mask(x.detach(), s_x, z_x.to(torch.int32), -128, 127)
    q_w, mask_w = quantize_with_mask(W.detach(), s_w, 0, -127, 127, axis=0)
    assert not mask_x.all() and not mask_w.all()  # both masks clip somewhere
    w_hat = dequantize(q_w, s_w, 0, axis=0)
    x_hat = dequantize(q_x, s_x, z_x.to(torch.int32))
    assert torch.equal(gx, torch.where(mask_x, g @ w_hat, 0.0))
    assert torch.equal(gw, torch.where(mask_w, g.t() @ x_hat, 0.0))


def test_gradients_with_packed_masks_equal_the_bool_mask_formula():
    _assert_gradients_follow_the_bool_masks(64, 96, 48, seed=1)


def test_the_c_pass_packs_the_same_bits_as_torch():
    from intqat.ops import backends
    from intqat.ops.masks import pack_mask_torch, unpack_mask_torch

    if backends.unavailable("cpu_fused") is not None:
        pytest.skip(f"cpu_fused cannot run here: {backends.unavailable('cpu_fused')}")
    for shape in [(0,), (5,), (64,), (33, 65), (3, 7, 9)]:
        mask = torch.rand(shape) < 0.4
        with backends.use_backend("cpu_fused"), backends.recording() as ran:
            packed = pack_mask(mask)
            back = unpack_mask(packed, shape)
        assert ran[("pack_mask", "cpu_fused")] == 1 and ran[("unpack_mask", "cpu_fused")] == 1
        assert torch.equal(packed, pack_mask_torch(mask)) and torch.equal(back, unpack_mask_torch(packed, shape))
        assert torch.equal(back, mask)


@pytest.mark.parametrize("n", [0, 5, 8, 16, 17, 33 * 65])
def test_the_mask_applied_from_its_bits_equals_torch_where(n):
    """The backward's mask pass straight from the bits (primitive mask_zero_packed_): where(mask, g, 0)
    bit for bit, cleared NaN / inf / -0.0 included, at every tail length (n % 8, n % 16)."""
    from intqat.ops import backends

    g = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=g)
    grad[:: 7] = float("nan")
    grad[3:: 11] = float("inf")
    grad[5:: 13] = -0.0
    mask = torch.rand(n, generator=g) < 0.5
    packed = pack_mask(mask)
    want = torch.where(mask, grad, 0.0)
    names = ["reference"] + ([] if backends.unavailable("cpu_fused") else ["cpu_fused"])
    for name in names:
        with backends.use_backend(name), backends.recording() as ran:
            got = backends.select("mask_zero_packed_", grad, packed).mask_zero_packed_(grad.clone(), packed)
        assert ran[("mask_zero_packed_", name)] == 1
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name  # the bits, NaN and -0.0 too


def test_odd_shaped_layer_gradients_with_packed_masks_equal_the_bool_mask_formula():
    """Rows whose length is not a multiple of 8 or 16: the bits straddle rows, the gradients do not notice."""
    _assert_gradients_follow_the_bool_masks(7, 13, 5, seed=2)
