"""Activation observers: the Python-float fast path equals the tensor path bit for bit, and both
follow torch.ao's observers (same range update, same scale / zero-point rule)."""

from __future__ import annotations

import warnings

import pytest
import torch

from intqat.config import QuantSpec
from intqat.nn.quantizers import ActivationQuantizer

SPECS = {
    "asym8 moving average": QuantSpec(bits=8, symmetric=False, granularity="tensor", observer="moving_average"),
    "asym8 minmax": QuantSpec(bits=8, symmetric=False, granularity="tensor", observer="minmax"),
    "sym8 moving average": QuantSpec(bits=8, symmetric=True, granularity="tensor", observer="moving_average",
                                     averaging_constant=0.1),
    "asym4 moving average": QuantSpec(bits=4, symmetric=False, granularity="tensor", observer="moving_average",
                                      averaging_constant=0.3),
}


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    yield torch.randn(64, 32, generator=g) * 3
    yield torch.randn(64, 32, generator=g).relu()  # all >= 0: lo clamps to 0
    yield -torch.rand(64, 32, generator=g)  # all <= 0
    yield torch.zeros(64, 32)
    yield torch.randn(64, 32, generator=g) * 1e-6
    yield torch.randn(64, 32, generator=g) * 1e4
    for _ in range(20):
        yield torch.randn(64, 32, generator=g) * (1 + torch.rand((), generator=g) * 5) + torch.randn((), generator=g)


def _state(q):
    return [t.clone() for t in (q.min_val, q.max_val, q.scale.data, q.zero_point.data)]


@pytest.mark.parametrize("name", list(SPECS))
def test_fast_path_equals_tensor_path(name, monkeypatch):
    fast, slow = ActivationQuantizer(SPECS[name]), ActivationQuantizer(SPECS[name])
    taken = []
    original = ActivationQuantizer._observe_scalar

    def spy(self, x):
        if self is slow:
            return None  # "take the tensor path"
        taken.append(original(self, x))
        return taken[-1]

    monkeypatch.setattr(ActivationQuantizer, "_observe_scalar", spy)
    for x in _batches():
        fast.observe(x)
        slow.observe(x)
        for a, b in zip(_state(fast), _state(slow)):
            assert torch.equal(a, b), (name, a, b)
    assert taken and all(taken)  # the fast path really ran


@pytest.mark.parametrize("name", ["asym8 moving average", "asym8 minmax", "sym8 moving average"])
def test_observers_follow_torch_ao(name):
    from torch.ao.quantization.observer import MinMaxObserver, MovingAverageMinMaxObserver

    spec = SPECS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = dict(dtype=torch.qint8, quant_min=spec.qmin, quant_max=spec.qmax,
                      qscheme=torch.per_tensor_symmetric if spec.symmetric else torch.per_tensor_affine)
        ref = (MinMaxObserver(**kwargs) if spec.observer == "minmax"
               else MovingAverageMinMaxObserver(averaging_constant=spec.averaging_constant, **kwargs))
    ours = ActivationQuantizer(spec)
    for x in _batches(seed=1):
        if not x.any():
            continue  # an all-zero first range: torch.ao and intqat pick different placeholder scales
        ours.observe(x)
        ref(x)
        scale, zero_point = ref.calculate_qparams()
        assert torch.equal(ours.min_val, ref.min_val.reshape(1)) and torch.equal(ours.max_val, ref.max_val.reshape(1))
        assert torch.equal(ours.scale.data, scale.reshape(1).float())
        if not spec.symmetric:
            assert torch.equal(ours.zero_point.data, zero_point.reshape(1).float())


BAD = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("path", ["fast", "tensor"])
@pytest.mark.parametrize("name", ["asym8 moving average", "asym8 minmax", "percentile"])
def test_non_finite_batches_are_ignored_and_warned_once(name, path, monkeypatch):
    spec = SPECS.get(name) or QuantSpec(bits=8, symmetric=False, observer="percentile", percentile=99.0)
    if path == "tensor":
        monkeypatch.setattr(ActivationQuantizer, "_observe_scalar", lambda self, x: None)
    q, twin = ActivationQuantizer(spec), ActivationQuantizer(spec)  # twin never sees the bad batches
    q.layer_name = "net.3"
    good = list(_batches(seed=2))[:6]
    with pytest.warns(UserWarning, match=r"observer of layer 'net.3' ignored a batch holding NaN / inf") as record:
        for i, x in enumerate(good):
            for value in BAD if i in (1, 4) else []:
                bad = x.clone()
                bad[3, 5] = value
                q.observe(bad)
                if name == "percentile" and value != value:
                    continue  # NaN anywhere makes a percentile NaN: ignored
                if name == "percentile":  # a lone inf falls outside the 99th percentile: a fine batch
                    twin.observe(bad)
            q.observe(x)
            twin.observe(x)
            for a, b in zip(_state(q), _state(twin)):
                assert torch.equal(a, b), (i, a, b)
    assert len([w for w in record if "NaN / inf" in str(w.message)]) == 1  # once per layer
    assert all(torch.isfinite(t).all() for t in _state(q))


def test_a_non_finite_first_batch_leaves_the_quantizer_uninitialised():
    q = ActivationQuantizer(SPECS["asym8 minmax"])
    with pytest.warns(UserWarning, match=r"a layer built outside prepare_qat \(unnamed\)"):
        q.observe(torch.tensor([[float("nan"), 1.0]]))
    assert not q.initialized and not q._initialized
    with pytest.raises(RuntimeError, match="no scale yet"):
        q.eval().fake_quant(torch.ones(2, 2))


def test_traced_observers_keep_their_range_without_a_host_sync(monkeypatch):
    """Compiled programs take the tensor path and cannot branch on values: torch.where keeps the
    current range, a fixed point of every update rule."""
    q = ActivationQuantizer(SPECS["asym8 moving average"])
    q.observe(torch.randn(8, 4))
    before = _state(q)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for value in BAD:
        assert q._observe(torch.tensor([[value, 1.0]])) is None
    for a, b in zip(before, _state(q)):
        assert torch.equal(a, b)


def _cpp_observer_runs_here():
    from intqat.ops import backends, cpp_step

    reason = cpp_step.unavailable_reason() or backends.unavailable("cpu_fused")
    if reason is not None:
        pytest.skip(f"C++ training op cannot run here: {reason}")


@pytest.mark.parametrize("name", list(SPECS))
def test_the_cpp_observer_equals_the_python_paths(name, monkeypatch):
    """integer_input's C++ fast path (kernels/cpu/observe.cpp) against the Python scalar path and the
    tensor path: the same min / max / scale / zero point bits after every batch, first batch included."""
    from intqat.ops import cpp_step

    _cpp_observer_runs_here()
    calls = []
    real = cpp_step.observe_minmax_
    monkeypatch.setattr(cpp_step, "observe_minmax_", lambda *a: calls.append(real(*a)) or calls[-1])
    cpp, scalar, tensor = (ActivationQuantizer(SPECS[name]) for _ in range(3))
    for x in _batches(seed=4):
        cpp.integer_input(x)
        with cpp_step.disabled():
            scalar.integer_input(x)
        assert tensor._observe_tensor(x) is not False
        for a, b, c in zip(_state(cpp), _state(scalar), _state(tensor)):
            assert torch.equal(a, b) and torch.equal(a, c), (name, a, b, c)
    assert calls and all(status == 1 for status in calls)  # the C++ path really ran, every time
    assert cpp._initialized and bool(cpp.initialized)


def test_the_cpp_observer_hands_non_finite_cases_to_the_general_path():
    """A batch holding NaN / inf: nothing changes, and integer_input refuses it in training as before; a
    kept range that is not finite (a loaded state): the tensor path runs, as without the C++ op."""
    from intqat.nn.quantizers import NonFiniteInputError
    from intqat.ops import cpp_step

    _cpp_observer_runs_here()
    q, ref = ActivationQuantizer(SPECS["asym8 moving average"]), ActivationQuantizer(SPECS["asym8 moving average"])
    x = next(_batches())
    q.integer_input(x)
    with cpp_step.disabled():
        ref.integer_input(x)
    before = _state(q)
    for value in BAD:
        bad = x.clone()
        bad[2, 3] = value
        with pytest.raises(NonFiniteInputError):
            q.integer_input(bad)
        for a, b in zip(before, _state(q)):
            assert torch.equal(a, b)
    for m in (q, ref):
        m.max_val.fill_(float("inf"))
    q.integer_input(x * 2)
    with cpp_step.disabled():
        ref.integer_input(x * 2)
    for a, b in zip(_state(q), _state(ref)):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), (a, b)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_without_observing_twice(reentrant):
    """The backward's recompute of a checkpointed block must not update the observers again: the same
    gradients and the same observer state as the step without checkpointing (they differed by ~1%)."""
    import copy

    import intqat
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    intqat.prepare_qat(block, "w8a8")
    block.train()(torch.randn(8, 16))  # observers have a range; the next batch moves it
    ckpt = copy.deepcopy(block)
    x = (torch.randn(8, 16) * 3).requires_grad_()
    plain_loss = block(x).square().sum()
    ckpt_loss = checkpoint(ckpt, x, use_reentrant=reentrant).square().sum()
    plain_loss.backward()
    ckpt_loss.backward()
    for p, q in zip(block.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    for (k, a), b in zip(block.state_dict().items(), ckpt.state_dict().values()):
        assert torch.equal(a, b), k
