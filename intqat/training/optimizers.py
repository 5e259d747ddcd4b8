"""The optimizer the training recipes build (conf/train.yaml `module.optimizer`), shared with
`intqat-bench modules` so the benchmark times the step users run.

Fused by default: torch's fused Adam / AdamW / SGD update every parameter in one kernel. On this
2-core CPU, Adam's default per-parameter loop takes ~6.4 ms per step for the 4.2 M parameters of the
bench MLP (a third of an intqat step), the fused kernel ~2.4 ms; same update rule, same state dict.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

__all__ = ["OPTIMIZERS", "build_optimizer", "fused_supported"]

OPTIMIZERS = ("adam", "adamw", "sgd")


def fused_supported(params: list[nn.Parameter]) -> bool:
    """torch's fused optimizers take float parameters on one supported device type (CPU, CUDA, ...)."""
    devices = {p.device.type for p in params}
    return (len(devices) == 1 and next(iter(devices)) in _get_fused_kernels_supported_devices()
            and all(p.is_floating_point() for p in params))


def build_optimizer(params: Iterable[nn.Parameter], name: str = "adam", lr: float = 1e-3, weight_decay: float = 0.0,
                    momentum: float = 0.9, fused: bool = True) -> torch.optim.Optimizer:
    """Adam / AdamW / SGD (nesterov when momentum > 0); fused when asked and the parameters allow
    it (`fused_supported`), else torch's default implementation."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r}: use one of {OPTIMIZERS}, e.g. optimizer='adam'")
    params = [p for p in params]
    extra = {"fused": True} if fused and params and fused_supported(params) else {}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=momentum > 0,
                               **extra)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, weight_decay=weight_decay, **extra)
