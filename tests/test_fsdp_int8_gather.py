"""The int8 all-gather's arithmetic in one process (intqat.distributed.int8_gather): what each rank puts on
the wire (codes, row absmax) and the weight every rank rebuilds from what the others sent.

The rebuilt W_hat must make the integer layers compute exactly what they compute from W: the same
min-max scale (each (row, group)'s absmax kept exactly), the same codes, so the same outputs bit for bit.
The 2-process runs (tests/test_fsdp.py) check it under FSDP2 itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat.distributed.int8_gather import GatherSpec, Int8GatherShard, dequantize_keeping_absmax
from intqat.ops.int_linear_grouped import quantize_weight_grouped
from intqat.ops.qparams import SCALE_EPS, row_absmax


def _awkward_rows(n: int, k: int) -> torch.Tensor:
    """Rows of every kind the wire meets: normal, negative maximum, all zero, tiny (scale clamped to eps),
    huge, a single non-zero value."""
    w = torch.randn(n, k)
    w[1] = -w[1].abs()
    w[2] = 0.0
    w[3] = torch.randn(k) * 1e-12
    w[4] = torch.randn(k) * 1e30
    w[5] = 0.0
    w[5, k // 2] = -3.0
    return w


def _wire(w: torch.Tensor, spec: GatherSpec, ranks: int = 2) -> torch.Tensor:
    """What FSDP2 does with Int8GatherShard: each rank's rows through fsdp_pre_all_gather, the outputs concatenated
    (the all-gather), fsdp_post_all_gather on them. -> W_hat in w's shape."""
    shards = [Int8GatherShard(part.contiguous(), spec) for part in w.chunk(ranks)]
    outs = [s.fsdp_pre_all_gather(None, w.shape, None, None, None) for s in shards]
    gathered = tuple(torch.cat([o[0][i] for o in outs]) for i in range(2))
    assert gathered[0].dtype == torch.int8 and gathered[1].dtype == torch.float32
    w_hat, inner = shards[0].fsdp_post_all_gather(gathered, outs[0][1], torch.float32)
    out = torch.empty_like(w)  # the later unshards write into the Parameter the first one made
    assert shards[0].fsdp_post_all_gather(gathered, None, torch.float32, out=out) is None
    assert torch.equal(out.view(-1), w_hat)
    return w_hat.view(w.shape)


@pytest.mark.parametrize("group_size, qmax", [(64, 127), (16, 7), (64, 7), (16, 127)])
def test_rebuilt_weight_keeps_each_absmax_and_codes(group_size, qmax):
    w = _awkward_rows(64, 64)
    spec = GatherSpec(group_size, qmax)
    w_hat = _wire(w, spec)
    amax = row_absmax(w.reshape(-1, group_size), dim=1)
    unclamped = amax / qmax > SCALE_EPS  # (below, the scale is eps and every code 0 whatever the absmax)
    assert unclamped.sum() > 50
    assert torch.equal(row_absmax(w_hat.reshape(-1, group_size), dim=1)[unclamped], amax[unclamped])  # exactly
    q, _, s = quantize_weight_grouped(w, None, group_size, -qmax, qmax)
    q_hat, _, s_hat = quantize_weight_grouped(w_hat, None, group_size, -qmax, qmax)
    assert torch.equal(s_hat, s) and torch.equal(q_hat, q)


def test_codes_times_scale_alone_would_lose_absmax():
    """Why the ends of the grid carry the absmax: codes * scale rounds it away in some rows (here, int8 rows of
    random weights), and a scale recomputed from it could move by an ulp."""
    w = torch.randn(4096, 64)
    q, _, s = quantize_weight_grouped(w, None, 64, -127, 127)
    naive = q.to(torch.float32) * s
    assert not torch.equal(row_absmax(naive, dim=1), row_absmax(w, dim=1))
    assert torch.equal(row_absmax(_wire(w, GatherSpec(64, 127)), dim=1), row_absmax(w, dim=1))


def _integer(module: nn.Module, config: str) -> nn.Module:
    intqat.prepare_qat(module, config)
    return intqat.to_integer(module)


@pytest.mark.parametrize("config", ["w8a8", "w8a8_dynamic", "w4a8", "8da4w"])
def test_integer_linear_on_the_rebuilt_weight_is_bit_identical(config):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 32))
    layer[0].weight.data = _awkward_rows(32, 64)
    x = torch.randn(16, 64)
    layer = _integer(layer, config)
    layer(x)  # observes the input range (static configs)
    intqat.freeze_observers(layer)
    wq = layer[0].weight_quantizer
    spec = GatherSpec(getattr(wq, "group_size", 64), wq.qmax)
    y = layer(x)
    y.sum().backward()
    grad = layer[0].weight.grad.clone()
    layer[0].weight.grad = None
    w = layer[0].weight.data.clone()
    layer[0].weight.data = _wire(w, spec)
    y_hat = layer(x)
    y_hat.sum().backward()
    assert torch.equal(y_hat, y)
    assert torch.equal(layer[0].weight.grad, grad)  # straight-through: the codes and scales, never W


def test_integer_conv_on_the_rebuilt_weight_is_bit_identical():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1))
    x = torch.randn(2, 4, 6, 6)
    model = _integer(model, "w8a8")
    model(x)
    w = model[0].weight.data.clone()
    y = model(x)
    model[0].weight.data = _wire(w, GatherSpec(w[0].numel(), 127))
    assert torch.equal(model(x), y)


def test_the_shard_is_a_plain_tensor_to_everything_else():
    """The optimizer, state_dict and checkpoints see the fp32 shard: ops on it are plain tensor ops on its storage."""
    local = torch.randn(4, 8)
    shard = Int8GatherShard(local, GatherSpec(8, 127))
    assert shard.data_ptr() == local.data_ptr()
    shard.add_(1.0)  # an optimizer step, in place
    assert torch.equal(local, shard.as_subclass(torch.Tensor))
    assert type(shard.detach()) is torch.Tensor and type(shard * 2) is torch.Tensor
    assert type(F.linear(torch.ones(1, 8), shard)) is torch.Tensor
