"""The IntQAT schedule on models already sharded with FSDP2's fully_shard (2 CPU processes, gloo).

Each rank trains its half of a global batch; a one-process twin (plain Parameters) trains on the whole
batch in the same process. prepare_qat / freeze_observers / to_integer run on the sharded model between
steps, as IntQAT runs them. Checked at every step: the sharded loss (averaged over ranks) equals the
twin's within 1e-5 (the reduce-scatter averages gradients in another order: float rounding); the model
keeps its Parameter objects, each still a DTensor sharded on dim 0, with the optimizer's state on them.
In the integer stage the twin takes the sharded model's weights and quantizer state, and the sharded
forward equals the twin's bit for bit (int8 codes, int32 accumulators, the same epilogue), while FSDP2
all-gathers the integer weights as int8 codes plus row absmax (intqat.distributed.int8_gather): under
0.35x the bytes of the fp32 all-gathers of the fake-quant stage on these small layers (biases stay fp32).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from intqat.distributed.launch import run_processes

LOSS_TOL = 1e-5


def _mlp(out_features: int = 8) -> nn.Module:
    # in_features multiples of 32: the per-group (8da4w) layers take them
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, out_features))


def _shard(model: nn.Module, per_layer: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    if per_layer:
        for m in model:
            if any(True for _ in m.parameters()):
                fully_shard(m)
    fully_shard(model)


def _full_state(model: nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def _gathered(y_local: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(y_local) for _ in range(world)]
    dist.all_gather(parts, y_local.contiguous())
    return torch.cat(parts)


def _check_schedule(rank: int, world: int, config: str, per_layer: bool) -> None:
    import intqat
    from intqat.distributed.fsdp import fsdp_params_of
    from intqat.distributed.int8_gather import gathered_as_int8
    from intqat.distributed.traffic import count_all_gathers
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(0)
    twin = _mlp()
    model = copy.deepcopy(twin)
    _shard(model, per_layer)
    counter = count_all_gathers(model)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g)
    target = torch.randint(0, 8, (16,), generator=g)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    where = f"{config}, {'per-layer' if per_layer else 'root-only'} fully_shard"

    def step(n: int) -> None:
        for _ in range(n):
            loss = nn.functional.cross_entropy(model(x[rows]), target[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            twin_loss = nn.functional.cross_entropy(twin(x), target)
            twin_loss.backward()
            twin_opt.step()
            twin_opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            assert abs(float(mean) - float(twin_loss)) <= LOSS_TOL, (where, float(mean), float(twin_loss))

    def same_parameters() -> None:
        now = list(model.parameters())
        assert [id(p) for p in now] == [id(p) for p in params], f"{where}: the swap changed the Parameters"
        for p in now:
            assert isinstance(p, DTensor) and p.placements == (Shard(0),), (where, type(p), getattr(p, "placements", None))
            assert isinstance(opt.state[p]["exp_avg"], DTensor), where

    step(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        intqat.prepare_qat(model, config)
    left = [str(w.message) for w in caught if "left these modules" in str(w.message)]
    assert not left, f"{where}: {left}"
    intqat.prepare_qat(twin, config)
    assert len(intqat.quantized_modules(model)) == 3, where
    if per_layer:
        assert all(isinstance(m, FSDPModule) for m in intqat.quantized_modules(model).values()), where
    same_parameters()
    step(2)
    intqat.freeze_observers(model)
    intqat.freeze_observers(twin)
    counter.reset()
    step(1)
    fp32_bytes = counter.bytes_out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        intqat.to_integer(model)
    assert not [str(w.message) for w in caught if "fp32" in str(w.message)], where
    intqat.to_integer(twin)
    same_parameters()
    model.float()  # nn.Module._apply: FSDP2 takes new local shards (Lightning moves models so); still int8 on the wire
    params = list(model.parameters())
    assert [gathered_as_int8(fp) for _, fp in fsdp_params_of(model).values()] == [True, False] * 3, where
    counter.reset()
    step(1)
    assert counter.bytes_out < 0.35 * fp32_bytes, (where, counter.bytes_out, fp32_bytes)
    for _ in range(2):
        twin.load_state_dict(_full_state(model))  # the same weights and scales, bit for bit
        y = _gathered(model(x[rows]), world)
        y_twin = twin(x)
        assert torch.equal(y, y_twin), f"{where}: integer forward differs: max |diff| {(y - y_twin).abs().max()}"
        with torch.no_grad():  # eval: the layers' cached codes must follow the weights FSDP2 gathers
            model.eval()
            twin.eval()
            y, y_twin = _gathered(model(x[rows]), world), twin(x)
            assert torch.equal(y, y_twin), f"{where}: eval forward differs: max |diff| {(y - y_twin).abs().max()}"
            model.train()
            twin.train()
        step(1)


def _check_uneven_rows(rank: int, world: int) -> None:
    """5 output rows over 2 ranks: FSDP2 pads the last shard, so that weight crosses in fp32, named in a
    warning; its layer still computes the one-process bits."""
    import intqat

    torch.manual_seed(0)
    twin = _mlp(out_features=5)
    model = copy.deepcopy(twin)
    _shard(model, per_layer=True)
    x = torch.randn(8, 32)
    rows = slice(rank * 4, rank * 4 + 4)
    for m in (model, twin):
        intqat.prepare_qat(m, "w8a8_dynamic")
        m(x[rows] if m is model else x)
    with pytest.warns(UserWarning, match=r"all-gathers 4\.weight in fp32, not as int8 codes: 5 rows do not split evenly "
                                         r"over 2 ranks") as caught:
        intqat.to_integer(model)
    assert len([w for w in caught if "fp32" in str(w.message)]) == 1  # the other two weights cross as codes
    intqat.to_integer(twin)
    twin.load_state_dict(_full_state(model))
    assert torch.equal(_gathered(model(x[rows]), world), twin(x))


def _schedules(rank: int, world: int) -> None:
    for config in ("w8a8", "w8a8_dynamic", "8da4w"):
        for per_layer in (True, False):
            _check_schedule(rank, world, config, per_layer)
    _check_uneven_rows(rank, world)


def test_schedule_on_a_sharded_model_matches_one_process():
    run_processes(_schedules, world_size=2, timeout=180)
