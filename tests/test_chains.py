"""int8 -> int8 chains: producers requantize onto the consumer's grid; deployed layers pass codes."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import intqat


def _trained_integer_mlp(steps=8):
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    intqat.prepare_qat(m)
    x, y = torch.randn(128, 16), torch.randint(0, 4, (128,))
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    for _ in range(steps):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    intqat.to_integer(m)
    return m, opt, x, y


def test_chaining_needs_fixed_ranges():
    m, *_ = _trained_integer_mlp()
    with pytest.raises(ValueError, match="freeze_observers"):
        intqat.chain_int8(m)


def test_chain_folds_relu_and_trains():
    m, opt, x, y = _trained_integer_mlp()
    intqat.freeze_observers(m)
    assert intqat.chain_int8(m) == [("0", "2"), ("2", "3")]
    assert isinstance(m[1], nn.Identity) and m[0].output_relu and not m[2].output_relu
    assert m[0].output_quantizer is m[2].input_quantizer  # the consumer's grid, shared
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (m[0].weight, m[2].weight, m[3].weight))
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5])


def test_chained_training_forward_is_the_deployed_int8_pipeline():
    m, _, x, _ = _trained_integer_mlp()
    intqat.freeze_observers(m)
    intqat.chain_int8(m)
    m.eval()
    with torch.no_grad():
        y_eval = m(x)
    y_train_fwd = m(x.requires_grad_())  # the differentiable op path
    deployed = intqat.to_deployed(m)
    with torch.no_grad():
        codes = deployed[0](x)
        y_deployed = deployed(x)
    assert codes.dtype == torch.int8  # int8 leaves the producer...
    assert torch.all(codes >= deployed[0].out_zero_point.to(torch.int8))  # ...with the ReLU applied on codes
    with pytest.raises(ValueError, match="int8 codes"):
        deployed[2](torch.randn(3, 32))  # ...and the consumer takes codes only
    program = torch.export.export(deployed, (x.detach(),))
    assert torch.equal(y_eval, y_deployed)
    assert torch.equal(y_train_fwd.detach(), y_eval)
    assert torch.equal(program.module()(x.detach()), y_eval)


def test_chained_state_dict_round_trip():
    m, _, x, _ = _trained_integer_mlp()
    intqat.freeze_observers(m)
    intqat.chain_int8(m)
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    intqat.prepare_qat(fresh)
    intqat.to_integer(fresh)
    fresh.load_state_dict(m.state_dict(), strict=False)  # chain_int8 needs the ranges loaded first
    intqat.freeze_observers(fresh)
    intqat.chain_int8(fresh)
    fresh.load_state_dict(m.state_dict(), strict=True)
    m.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(m(x), fresh(x))
