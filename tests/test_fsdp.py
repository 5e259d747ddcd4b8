"""The IntQAT schedule on models already sharded with FSDP2's fully_shard (2 CPU processes, gloo).

Each rank trains its half of a global batch; a one-process twin (plain Parameters) trains on the whole
batch in the same process (SGD with momentum: Adam would amplify the rounding of the reduce-scatter). prepare_qat / freeze_observers / to_integer run on the sharded model between
steps, as IntQAT runs them. Checked at every step: the sharded loss (averaged over ranks) equals the
twin's within 1e-5 (the reduce-scatter averages gradients in another order: float rounding); the model
keeps its Parameter objects, each still a DTensor sharded on dim 0, with the optimizer's state on them;
learned (LSQ) scales made on the sharded model stay whole on every rank, their gradients averaged.
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
# learned scales: their gradients sum in another order too, and a scale one ulp apart moves a code (~1e-5 in the loss)
LSQ_LOSS_TOL = 1e-4


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
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)  # (Adam would amplify the reduce-scatter's rounding)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g)
    target = torch.randint(0, 8, (16,), generator=g)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    where = f"{config}, {'per-layer' if per_layer else 'root-only'} fully_shard"
    tol = LSQ_LOSS_TOL if "lsq" in config else LOSS_TOL

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
            assert abs(float(mean) - float(twin_loss)) <= tol, (where, float(mean), float(twin_loss))

    def same_parameters() -> None:
        now = list(model.parameters())
        assert [id(p) for p in now if isinstance(p, DTensor)] == [id(p) for p in params], \
            f"{where}: the swap changed the Parameters"
        for p in params:
            assert p.placements == (Shard(0),), (where, p.placements)
            assert isinstance(opt.state[p]["momentum_buffer"], DTensor), where
        for p in now:  # learned scales made by the swap: whole on every rank, gradients averaged
            assert isinstance(p, DTensor) or p._intqat_grads_averaged, where

    step(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        intqat.prepare_qat(model, config)
    left = [str(w.message) for w in caught if "left these modules" in str(w.message)]
    assert not left, f"{where}: {left}"
    intqat.prepare_qat(twin, config)
    for o, m, before in ((opt, model, params), (twin_opt, twin, [p for g in twin_opt.param_groups for p in g["params"]])):
        new = [p for p in m.parameters() if all(p is not q for q in before)]
        if new:  # learned scales join the optimizer, as IntQAT adds them
            o.add_param_group({"params": new})
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
    fp32 = [str(w.message) for w in caught if "fp32" in str(w.message)]
    assert len(fp32) == (3 if "lsq" in config else 0), (where, fp32)  # named, one warning per weight
    intqat.to_integer(twin)
    same_parameters()
    model.float()  # nn.Module._apply: FSDP2 takes new local shards (Lightning moves models so); still int8 on the wire
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    int8 = [gathered_as_int8(fp) for _, fp in fsdp_params_of(model).values()]
    lsq = "lsq" in config  # learned weight scales need W in backward: fp32 all-gathers
    assert int8 == [not lsq, False] * 3, (where, int8)
    counter.reset()
    step(1)
    if lsq:  # fp32 weights, all-gathered for the backward too (LSQ's scale gradient reads W)
        assert counter.bytes_out == fp32_bytes, (where, counter.bytes_out, fp32_bytes)
    else:
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


def _check_learned_scales_sharded_with_the_model(rank: int, world: int) -> None:
    """LSQ prepared before fully_shard: FSDP2 shards the learned scales too. The observers set their first values
    during a forward, on the unsharded copies; the shards must get them (else every later step starts from 1.0)."""
    import intqat

    torch.manual_seed(0)
    twin = intqat.prepare_qat(_mlp(), "w8a8_lsq")
    model = copy.deepcopy(twin)
    _shard(model, per_layer=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    rows = slice(rank * 8, rank * 8 + 8)
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x[rows]), target[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        twin_loss = nn.functional.cross_entropy(twin(x), target)
        twin_loss.backward()
        twin_opt.step()
        twin_opt.zero_grad()
        dist.all_reduce(loss := loss.detach().clone())
        assert abs(float(loss) / world - float(twin_loss)) <= LSQ_LOSS_TOL, (float(loss) / world, float(twin_loss))
    # without the shard's copy of the observed value, the sharded scale would have gone on from 1.0
    scale = _full_state(model)["0.input_quantizer.scale"]
    assert torch.allclose(scale, twin[0].input_quantizer.scale.detach(), rtol=1e-3), (scale.item(), twin[0].input_quantizer.scale.item())


def _check_batchnorm_broadcast(rank: int, world: int) -> None:
    """IntQAT broadcasts rank 0's BatchNorm statistics under FSDP2 (which syncs no buffer): one model on every rank."""
    from intqat.distributed.shards import broadcast_batchnorm_stats

    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    for i, bn in enumerate((model[1], model[3])):
        bn.running_mean.fill_(rank + i)
        bn.running_var.fill_(10 * rank + i + 1)
    assert broadcast_batchnorm_stats(model) == 4
    for i, bn in enumerate((model[1], model[3])):
        assert torch.equal(bn.running_mean, torch.full((4,), float(i)))
        assert torch.equal(bn.running_var, torch.full((4,), float(i + 1)))


def _schedules(rank: int, world: int) -> None:
    for config in ("w8a8", "w8a8_dynamic", "8da4w", "w8a8_lsq"):
        for per_layer in (True, False):
            _check_schedule(rank, world, config, per_layer)
    _check_uneven_rows(rank, world)
    _check_learned_scales_sharded_with_the_model(rank, world)
    _check_batchnorm_broadcast(rank, world)


def test_schedule_on_a_sharded_model_matches_one_process():
    run_processes(_schedules, world_size=2, timeout=180)
