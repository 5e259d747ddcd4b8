"""int_linear: integer forward (exact against an int64 reference), STE / LSQ backward (against
torch's learnable fake-quant kernels), one opaque node for torch.compile / export, no fp32 input saved."""

import pytest
import torch
import torch.nn.functional as F

from intqat.ops import backends, int_linear, lsq_grad_factor, quantize, rounded_zero_point


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _problem(M=48, K=80, N=24, learn=False, clip=0.8):
    x = (torch.randn(M, K) * 1.5 + 0.2).requires_grad_()
    W = (torch.randn(N, K) * 0.1).requires_grad_()
    b = torch.randn(N).requires_grad_()
    # scales that clip a little on both sides, so the masks matter
    s_x = torch.tensor([(x.detach().max() - x.detach().min()).item() / 255 * clip], requires_grad=learn)
    # a positive zero point: torch's learnable fake-quant backward truncates z + 0.5 toward zero,
    # which turns a negative zero point such as -3 into -2 (its forward rounds correctly)
    z_x = torch.tensor([3.0], requires_grad=learn)
    s_w = (W.detach().abs().amax(1) / 127 * clip).requires_grad_(learn)
    return x, W, b, s_x, z_x, s_w


def _grads(out, tensors):
    g = torch.randn_like(out)
    return torch.autograd.grad(out, tensors, g, allow_unused=True), g


def _reference(x, W, b, s_x, z_x, s_w):
    """The fake-quant model built from torch's own learnable fake-quant kernels."""
    M, K = x.shape
    x_hat = torch._fake_quantize_learnable_per_tensor_affine(x, s_x, z_x, -128, 127, lsq_grad_factor(M * K, 127))
    w_hat = torch._fake_quantize_learnable_per_channel_affine(
        W, s_w, torch.zeros(W.shape[0]), 0, -127, 127, lsq_grad_factor(K, 127)
    )
    return F.linear(x_hat, w_hat, b)


def _integer_reference(x, W, b, s_x, z_x, s_w):
    """Pure integer reference: int64 accumulation of the codes, then the float epilogue."""
    z = int(rounded_zero_point(z_x, -128, 127))
    q_x = quantize(x.detach(), s_x.detach(), z, -128, 127)
    q_w = quantize(W.detach(), s_w.detach(), 0, -127, 127, axis=0)
    acc = ((q_x.long() - z) @ q_w.long().t()).to(torch.int32)
    return acc.to(torch.float32) * (s_x.detach().reshape(1, 1) * s_w.detach().reshape(1, -1)) + b.detach()


@pytest.mark.parametrize("learn", [False, True])
def test_forward_is_the_integer_arithmetic_exactly(learn):
    args = _problem(learn=learn)
    y = int_linear(*args)
    assert torch.equal(y, _integer_reference(*args))
    with torch.no_grad():
        assert torch.equal(int_linear(*args), y)


@pytest.mark.parametrize("learn", [False, True])
def test_gradients_equal_torch_learnable_fake_quant(learn):
    x, W, b, s_x, z_x, s_w = _problem(learn=learn)
    tensors = [x, W, b] + ([s_x, z_x, s_w] if learn else [])
    y = int_linear(x, W, b, s_x, z_x, s_w)
    y_ref = _reference(x, W, b, s_x, z_x, s_w)
    # forward: the two differ only by fp32 accumulation order
    sqnr = 10 * torch.log10(y_ref.pow(2).sum() / (y - y_ref).pow(2).sum())
    assert sqnr > 60
    g = torch.randn_like(y)
    ours = torch.autograd.grad(y, tensors, g)
    ref = torch.autograd.grad(y_ref, tensors, g)
    for name, a, r in zip(["x", "W", "b", "s_x", "z_x", "s_w"], ours, ref):
        assert _rel(a, r) < 1e-5, name


def test_dynamic_per_token_matches_per_row_fake_quant():
    x, W, b, _, _, s_w = _problem()
    y = int_linear(x, W, b, None, None, s_w, x_dynamic=True)
    s_row = torch.clamp(x.detach().abs().amax(1) / 127, min=torch.finfo(torch.float32).eps)
    x_hat = torch.fake_quantize_per_channel_affine(x, s_row, torch.zeros(x.shape[0], dtype=torch.int32), 0, -128, 127)
    w_hat = torch._fake_quantize_learnable_per_channel_affine(W, s_w, torch.zeros(W.shape[0]), 0, -127, 127, 1.0)
    y_ref = F.linear(x_hat, w_hat, b)
    g = torch.randn_like(y)
    for a, r in zip(torch.autograd.grad(y, [x, W, b], g), torch.autograd.grad(y_ref, [x, W, b], g)):
        assert _rel(a, r) < 1e-5
    # exact forward: per-row codes, int64 accumulation, epilogue with per-row scales
    q_x = quantize(x.detach(), s_row, 0, -128, 127, axis=0)
    q_w = quantize(W.detach(), s_w.detach(), 0, -127, 127, axis=0)
    acc = (q_x.long() @ q_w.long().t()).to(torch.int32)
    assert torch.equal(y.detach(), acc.float() * (s_row[:, None] * s_w.detach()[None, :]) + b.detach())


def test_leading_dims_and_no_bias():
    x, W, _, s_x, z_x, s_w = _problem()
    x3 = x.detach().reshape(4, 12, 80).requires_grad_()
    y = int_linear(x3, W, None, s_x, z_x, s_w)
    assert y.shape == (4, 12, 24)
    y.sum().backward()
    assert x3.grad.shape == x3.shape


def test_saves_int8_codes_not_the_fp32_input():
    x, W, b, s_x, z_x, s_w = _problem(M=64, K=96, N=32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        int_linear(x, W, b, s_x, z_x, s_w)
    big = [t for t in saved if t.numel() >= x.numel() // 2]
    assert big, "the codes must be saved"
    assert all(t.dtype in (torch.int8, torch.bool) for t in big), [(t.dtype, tuple(t.shape)) for t in big]
    assert not any(t is x for t in saved)


@pytest.mark.parametrize("M,K,N", [(8, 16, 4), (32, 512, 1024)])  # the second takes the digit GEMM backward
def test_custom_op_passes_opcheck(M, K, N):
    x, W, b, s_x, z_x, s_w = _problem(M=M, K=K, N=N, learn=True)
    op = torch.ops.intqat.int_linear.default
    for dynamic in (False, True):
        for grad_gemm in ("int8x3", "fp32"):
            args = (x, W, b, s_x, z_x, s_w, -128, 127, -127, 127, dynamic, not dynamic, True, grad_gemm)
            torch.library.opcheck(op, args)
        torch.library.opcheck(op, args[:-1])  # grad_gemm has a default in the schema


def test_compiles_as_one_opaque_node_without_graph_breaks():
    x, W, b, s_x, z_x, s_w = _problem(M=16, K=32, N=8)

    def step(x, W, b):
        return int_linear(x, W, b, s_x, z_x, s_w).relu().sum()

    explained = torch._dynamo.explain(step)(x, W, b)
    assert explained.graph_break_count == 0
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out_c = compiled(x, W, b)
    gc = torch.autograd.grad(out_c, [x, W, b])
    out_e = step(x, W, b)
    ge = torch.autograd.grad(out_e, [x, W, b])
    assert torch.equal(out_c, out_e)
    for a, r in zip(gc, ge):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-6)


def test_inductor_compiles_a_norm_feeding_an_integer_layer():
    """torch.compile (inductor, CPU) of a LayerNorm -> static-activation IntLinear training step: the fused kernel
    of the norm's backward and the unpacked clip mask did not compile (a uint8 -> bool bit cast: 'Vectorized<bool>
    has no member cast'), i.e. no transformer block compiled. Eager and compiled steps agree to rounding."""
    import intqat
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 16))
    x = torch.randn(4, 6, 32)
    intqat.prepare_qat(model, "w8a8")
    intqat.calibrate(model, [x])
    intqat.freeze_observers(model)
    model = intqat.to_integer(model).train()
    compiled = torch.compile(model)
    loss_c = compiled(x).square().mean()
    grads_c = torch.autograd.grad(loss_c, list(model.parameters()))
    loss_e = model(x).square().mean()
    grads_e = torch.autograd.grad(loss_e, list(model.parameters()))
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-2, atol=1e-3)  # (inductor's LayerNorm may move a code)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=torch.randn(4, 7)), r"K mismatch.*\(4, 7\).*\(3, 5\)"),
        (dict(x=torch.randint(0, 3, (4, 5))), "floating-point"),
        (dict(bias=torch.randn(4)), r"bias must have shape \(3,\)"),
        (dict(w_scale=torch.ones(2)), r"w_scale .*\(3,\)"),
        (dict(x_scale=torch.ones(2)), "x_scale of shape"),
        (dict(weight=torch.randn(3, 5, 1)), "weight must be a 2-D"),
    ],
)
def test_bad_inputs(kwargs, match):
    args = dict(x=torch.randn(4, 5), weight=torch.randn(3, 5), bias=torch.randn(3), x_scale=torch.ones(1),
                x_zero_point=torch.zeros(1), w_scale=torch.ones(3))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        int_linear(**args)


def test_bad_ranges():
    with pytest.raises(ValueError, match="qmin"):
        int_linear(torch.randn(2, 3), torch.randn(2, 3), None, torch.ones(1), torch.zeros(1), torch.ones(2), x_qmin=-300)


def test_triton_backend_matches_cpu():
    """The Triton forward + backward kernels (interpreter here) against the CPU path."""
    x, W, b, s_x, z_x, s_w = _problem(M=20, K=40, N=12, learn=True)
    tensors = [x, W, b, s_x, z_x, s_w]
    y_cpu = int_linear(x, W, b, s_x, z_x, s_w)
    g = torch.randn_like(y_cpu)
    grads_cpu = torch.autograd.grad(y_cpu, tensors, g)
    with backends.use_backend("triton"), backends.recording() as ran:
        y_tri = int_linear(x, W, b, s_x, z_x, s_w)
        grads_tri = torch.autograd.grad(y_tri, tensors, g)
    assert ran[("linear", "triton")] == 1 and ran[("ste_grad_input", "triton")] == 1
    # epilogue: within 1 ulp (a Triton epilogue may contract the multiply-add into an FMA)
    ulp = torch.nextafter(y_cpu.abs(), torch.tensor(float("inf"))) - y_cpu.abs()
    assert torch.all((y_tri - y_cpu).abs() <= ulp)
    for name, a, r in zip(["x", "W", "b", "s_x", "z_x", "s_w"], grads_tri, grads_cpu):
        assert _rel(a, r) < 1e-5, name


def test_rounded_zero_point_eager_shortcut_equals_the_tensor_formula():
    """The eager CPU path computes the zero point in Python floats: the same int32 as round -> clamp in torch
    (ties to even, infinities and out-of-range values clamped, float64 input rounded to fp32 first)."""
    from intqat.ops.int_linear import rounded_zero_point

    values = [0.5, 1.5, 2.5, -0.5, -1.5, 127.5, -128.5, 300.0, -300.0, 3.0, float("inf"), float("-inf"),
              float("nan"), 0.49999997, -2.5000002, 2.5000000001]
    for v in values:
        for dtype in (torch.float32, torch.float64, torch.int32):
            if dtype == torch.int32 and (v != v or abs(v) == float("inf") or v != int(v)):
                continue
            t = torch.tensor([v], dtype=dtype)
            want = torch.round(t.to(torch.float32)).clamp_(-128, 127).to(torch.int32)
            got = rounded_zero_point(t, -128, 127)
            assert got.dtype == torch.int32 and got.shape == (1,) and torch.equal(got, want), (v, dtype, got, want)
