"""The optimizer the recipes (and `intqat-bench modules`) build: torch's fused step by default."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from intqat.cli.bench import _modules_settings, _parser
from intqat.training import ClassificationModule
from intqat.training.optimizers import build_optimizer, fused_supported


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_fused_step_is_the_default_and_updates_like_the_loop(name):
    """Same update rule: after a few steps on the same gradients, fused and per-parameter loop
    parameters agree to fp32 rounding (the fused kernel orders its float operations differently)."""
    fused_model, loop_model = _model(), _model()
    fused = build_optimizer(fused_model.parameters(), name, lr=1e-2, weight_decay=1e-3)
    loop = build_optimizer(loop_model.parameters(), name, lr=1e-2, weight_decay=1e-3, fused=False)
    assert fused.defaults["fused"] is True and not loop.defaults.get("fused")
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(3):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_parameters_the_fused_kernels_cannot_take_fall_back_to_the_loop():
    cpu, meta = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3, device="meta"))
    assert fused_supported([cpu]) and not fused_supported([cpu, meta])
    assert not build_optimizer([cpu, meta], "adam").defaults.get("fused")


def test_an_unknown_optimizer_is_named_in_the_error():
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        build_optimizer(_model().parameters(), "lamb")


@pytest.mark.parametrize("fused", [True, False])
def test_the_lightning_module_builds_it_from_its_hyperparameters(fused):
    module = ClassificationModule(_model(), num_classes=4, scheduler=None, fused_optimizer=fused)
    opt = module.configure_optimizers()
    assert isinstance(opt, torch.optim.Adam) and bool(opt.defaults.get("fused")) is fused


@pytest.mark.parametrize("argv,fused", [(["modules"], True), (["modules", "--loop-optimizer"], False),
                                        (["all", "--loop-optimizer"], False)])
def test_the_bench_times_the_recipes_optimizer_unless_told(argv, fused):
    assert _modules_settings(_parser().parse_args(argv)).fused_optimizer is fused
