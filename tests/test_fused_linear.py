"""The observer and the C++ linear step in one op call (intqat.nn.eager_step.fused_linear,
intqat_train::observed_int_linear in kernels/cpu/train_linear.cpp) against the two calls it replaces
(ActivationQuantizer.integer_input, then eager_step.linear_step) and against the plain-torch path (every C++ op
off): outputs, gradients, parameters after optimizer steps and the observers' buffers, bit for bit.

The comparison model runs `fused_linear` switched off (it returns None, so the layer takes its previous path);
every test also checks that the fused op really ran (or really handed the call back)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat.nn import eager_step
from intqat.nn.linear import FakeQuantLinear, IntLinear
from intqat.nn.quantizers import NonFiniteInputError
from intqat.ops import backends, cpp_step

ACTIVATIONS = {  # observer flavours of the static activation quantizer (w8a8's per-channel min-max weights)
    "asym8 moving average": {},
    "asym8 minmax": {"observer": "minmax"},
    "sym8 moving average": {"symmetric": True, "averaging_constant": 0.1},
    "asym4 moving average": {"bits": 4, "averaging_constant": 0.3},
}


def _runs_here():
    reason = cpp_step.unavailable_reason() or backends.unavailable("cpu_fused")
    if reason is not None:
        pytest.skip(f"C++ training op cannot run here: {reason}")


@pytest.fixture
def fused_count(monkeypatch):
    """Counts fused_linear's calls that returned y; `off()` makes it hand every call back (the previous path)."""
    real = eager_step.fused_linear
    state = {"ran": 0, "on": True}

    def spy(*args):
        if not state["on"]:
            return None
        y = real(*args)
        state["ran"] += y is not None
        return y

    monkeypatch.setattr(eager_step, "fused_linear", spy)
    return state


class _Encoder(nn.Module):
    """A small post-norm encoder layer (batch_first: the attention's input is a transposed view) and a head."""

    def __init__(self, d=32, ffn=64):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, 2, ffn, dropout=0.0, activation="gelu", batch_first=True)
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        return self.head(self.layer(x).mean(dim=1))


def _integer_encoder(activation: dict, calibrate: bool = True) -> nn.Module:
    torch.manual_seed(0)
    m = _Encoder()
    intqat.prepare_qat(m, {"preset": "w8a8", "activation": activation})
    if calibrate:
        intqat.calibrate(m, [torch.randn(4, 8, 32)])
        intqat.to_integer(m)
    else:
        with pytest.warns(UserWarning, match="never observed data"):  # (said so; the first batch sets the scales)
            intqat.to_integer(m)
    return m.train()


def _batches(n=4):
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        yield torch.randn(4, 8, 32, generator=g) * (1 + i), torch.randint(0, 5, (4,), generator=g)


def _train(model, batches):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _assert_same(a: nn.Module, b: nn.Module, grads_a, grads_b):
    assert list(a.state_dict()) == list(b.state_dict())  # the same keys: nothing saved or renamed
    for (k, t), u in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(t, u), k  # weights after the steps and every observer buffer (min / max, scale, ...)
    for step_a, step_b in zip(grads_a, grads_b):
        for g, h in zip(step_a, step_b):
            assert torch.equal(g, h)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_training_steps_equal_the_two_calls_and_the_python_path(name, fused_count):
    """Four Adam steps of an encoder block (attention projections, FFN, head): the same gradients, weights and
    observer buffers as integer_input + linear_step, and as the path with every C++ op off."""
    _runs_here()
    fused = _integer_encoder(ACTIVATIONS[name])
    two_calls, python = copy.deepcopy(fused), copy.deepcopy(fused)
    grads = _train(fused, _batches())
    assert fused_count["ran"] == 4 * 5  # a step: the attention's qkv projection, out_proj, linear1, linear2, head
    fused_count["on"] = False
    _assert_same(fused, two_calls, grads, _train(two_calls, _batches()))
    with cpp_step.disabled():
        _assert_same(fused, python, grads, _train(python, _batches()))


def test_the_first_batch_initialises_the_observer(fused_count):
    """An integer layer that never saw data: the fused op's first update sets the range and `initialized`, as
    integer_input does (and the Python flag, so the next batch averages)."""
    _runs_here()
    fused = _integer_encoder({}, calibrate=False)
    ref = copy.deepcopy(fused)
    assert not fused.layer.linear1.input_quantizer._initialized
    grads = _train(fused, _batches(2))
    assert fused_count["ran"] == 2 * 5 and fused.layer.linear1.input_quantizer._initialized
    fused_count["on"] = False
    _assert_same(fused, ref, grads, _train(ref, _batches(2)))


def test_observer_off_and_eval_mode_use_the_kept_scale(fused_count):
    """Training with the observer off (the op checks the batch only) and eval-mode training (nothing observed):
    the same bits as the previous path, and the buffers do not move."""
    _runs_here()
    for mode in ("observer off", "eval"):
        fused = _integer_encoder({})
        if mode == "eval":
            fused.eval()
        else:
            fused.apply(lambda m: m.enable_observer(False) if hasattr(m, "enable_observer") else None)
        before = copy.deepcopy(fused.state_dict())
        ref = copy.deepcopy(fused)
        fused_count["on"], fused_count["ran"] = True, 0
        grads = _train(fused, _batches(2))
        assert fused_count["ran"] == 2 * 5, mode
        for k, t in fused.state_dict().items():
            if "quantizer" in k:
                assert torch.equal(t, before[k]), (mode, k)
        fused_count["on"] = False
        _assert_same(fused, ref, grads, _train(ref, _batches(2)))


@pytest.mark.parametrize("observer_on", [True, False])
def test_a_batch_with_nan_or_inf_is_refused_and_changes_nothing(observer_on, fused_count):
    """The op hands the batch back untouched; the general path refuses it (NonFiniteInputError)."""
    _runs_here()
    torch.manual_seed(0)
    fq = FakeQuantLinear.from_linear(nn.Linear(16, 24), "w8a8")
    fq.train()(torch.randn(40, 16))
    layer = IntLinear.from_fake_quant(fq).train()
    layer.input_quantizer.enable_observer(observer_on)
    layer(torch.randn(40, 16))
    assert fused_count["ran"] == 1
    before = copy.deepcopy(layer.state_dict())
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = torch.randn(40, 16)
        bad[3, 5] = value
        with pytest.raises(NonFiniteInputError):
            layer(bad)
        for k, t in layer.state_dict().items():
            assert torch.equal(t, before[k]), k
    assert fused_count["ran"] == 1


def _observed_layer_and_copy() -> tuple[IntLinear, IntLinear]:
    """A 16 -> 24 w8a8 IntLinear in training mode after one observed batch (seed 0), and a deep copy of it."""
    torch.manual_seed(0)
    fq = FakeQuantLinear.from_linear(nn.Linear(16, 24), "w8a8")
    fq.train()(torch.randn(40, 16))
    layer = IntLinear.from_fake_quant(fq).train()
    return layer, copy.deepcopy(layer)


def test_a_kept_range_that_is_not_finite_takes_the_general_path(fused_count):
    """A loaded state holding inf: the op changes nothing and hands the call back; the result is the previous
    path's (the tensor observer), NaN where it is NaN."""
    _runs_here()
    layer, ref = _observed_layer_and_copy()
    x = torch.randn(40, 16)
    for m in (layer, ref):
        m.input_quantizer.max_val.fill_(float("inf"))
    y = layer(x)
    assert fused_count["ran"] == 0
    fused_count["on"] = False
    y_ref = ref(x)
    assert torch.equal(y, y_ref) or (y.isnan() == y_ref.isnan()).all()
    for (k, t), u in zip(layer.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(t, u) or (t.isnan() == u.isnan()).all(), k


@pytest.mark.parametrize("shape", [(40, 16), (5, 8, 16), "transposed"])
def test_input_layouts(shape, fused_count):
    """2-D, 3-D and a transposed (non-contiguous) input: the op makes the rows contiguous once, for the observer and
    the step; y keeps the leading dims; x's gradient flows back through that copy."""
    _runs_here()
    layer, ref = _observed_layer_and_copy()
    x = torch.randn(8, 5, 16).transpose(0, 1) if shape == "transposed" else torch.randn(*shape)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    if shape == "transposed":
        xa, xb = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(), x.clone().requires_grad_()
        assert not xa.is_contiguous()
    ya = layer(xa)
    assert fused_count["ran"] == 1 and ya.shape == (*x.shape[:-1], 24)
    fused_count["on"] = False
    yb = ref(xb)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(layer.weight.grad, ref.weight.grad)
    for (k, t), u in zip(layer.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(t, u), k


class _Doubled(nn.Module):
    def forward(self, w):
        return w * 2  # (exact in float32: the doubled copy below is the same numbers)


def test_a_parametrized_weight_is_read_through_its_parametrization(fused_count):
    """IntLinear reads its Parameters from nn.Module's dicts (_QuantLinearBase._parts) only where they are there:
    under torch.nn.utils.parametrize `weight` is a class property (the Parameter moved to `original`), and the step
    must use the parametrized weight, as `self.weight` gives it: the same output and gradients as a layer holding
    that weight."""
    _runs_here()
    layer, ref = _observed_layer_and_copy()
    torch.nn.utils.parametrize.register_parametrization(layer, "weight", _Doubled())
    with torch.no_grad():
        ref.weight.mul_(2)
    x = torch.randn(40, 16)
    ya, yb = layer(x), ref(x)
    assert fused_count["ran"] == 2 and torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(layer.parametrizations.weight.original.grad, 2 * ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_gradient_checkpointing_checks_without_observing_again(fused_count):
    """The backward's recompute runs the op in its check mode (no second observer update): the same gradients
    and observer buffers as the step without checkpointing."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    _runs_here()
    plain = _integer_encoder({})
    ckpt = copy.deepcopy(plain)
    x = torch.randn(4, 8, 32) * 3
    plain(x).square().sum().backward()
    with set_checkpoint_early_stop(False):  # (recompute every layer: the head's too)
        checkpoint(ckpt, x, use_reentrant=False).square().sum().backward()
    assert fused_count["ran"] == 3 * 5  # the plain step, the checkpointed forward, its recompute (check mode)
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    for (k, a), b in zip(plain.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), k


def test_the_table_records_what_the_two_calls_record(fused_count):
    """backends.recording() counts the same (primitive, backend) pairs: the bench's `backends` column is unchanged."""
    _runs_here()
    fused = _integer_encoder({})
    ref = copy.deepcopy(fused)
    x, y = next(_batches(1))
    with backends.recording() as got:
        F.cross_entropy(fused(x), y).backward()
    fused_count["on"] = False
    with backends.recording() as want:
        F.cross_entropy(ref(x), y).backward()
    assert got == want and got[("linear_step", "cpp_step")] == 5


def test_not_taken_while_tracing(fused_count):
    """torch.export sees the layer's traced path (the custom op), never the fused eager op."""
    _runs_here()
    torch.manual_seed(0)
    fq = FakeQuantLinear.from_linear(nn.Linear(16, 24), "w8a8")
    fq.train()(torch.randn(40, 16))
    layer = IntLinear.from_fake_quant(fq).eval()
    program = torch.export.export(layer, (torch.randn(40, 16),))
    assert fused_count["ran"] == 0
    assert "observed_int_linear" not in str(program.graph)


@pytest.mark.parametrize("M,K", [(4, 16), (3, 5), (1, 7), (1, 8), (3, 3), (5, 5), (5, 31), (600, 256)])
def test_static_codes_and_mask_bits_in_one_pass_equal_the_two_passes(M, K):
    """kernels/cpu/quantize_bits.h (the C++ step's static activation codes and clip-mask bits) against fused.c's
    quantize + pack passes (the Python path's): ties, values on and past the clip edges, NaN / inf, ragged tails
    (M * K not a multiple of 16 or 8), and a threaded size (600 x 256). y and grad_x (which reads the bits)."""
    from intqat.ops.int_linear import int_linear

    _runs_here()
    g = torch.Generator().manual_seed(M * 1000 + K)
    s, zp = 0.05, 3.0
    x = torch.randn(M, K, generator=g) * 4
    flat = x.view(-1)
    specials = [(torch.arange(-140, 140, dtype=torch.float32) + 0.5 - zp) * s,  # ties around every code
                torch.tensor([(-128 - zp) * s, (127 - zp) * s, (-128.5 - zp) * s, (127.5 - zp) * s, 1e9, -1e9,
                              float("nan"), float("inf"), -float("inf"), 0.0, -0.0])]
    vals = torch.cat(specials)
    vals = vals[torch.randperm(vals.numel(), generator=g)]  # (a small x gets some of each kind)
    idx = torch.randperm(flat.numel(), generator=g)[: min(flat.numel(), vals.numel())]
    flat[idx] = vals[: idx.numel()]
    w = torch.randn(6, K, generator=g)
    args = (torch.tensor([s]), torch.tensor([zp]), None)
    kw = dict(x_qmin=-128, x_qmax=127, w_qmin=-127, w_qmax=127, x_dynamic=False, w_clip_mask=False,
              grad_gemm="fp32")
    out = []
    for off in (False, True):
        xa = x.clone().requires_grad_()
        with backends.recording() as ran:
            if off:
                with cpp_step.disabled():
                    y = int_linear(xa, w, None, *args, **kw)
            else:
                y = int_linear(xa, w, None, *args, **kw)
        y.backward(torch.ones_like(y))
        out.append((y.detach(), xa.grad, ran[("linear_step", "cpp_step")]))
    (y_cpp, gx_cpp, n_cpp), (y_py, gx_py, n_py) = out
    assert n_cpp == 1 and n_py == 0
    assert torch.equal(y_cpp.isnan(), y_py.isnan()) and torch.equal(y_cpp.nan_to_num(), y_py.nan_to_num())
    assert torch.equal(gx_cpp, gx_py)
