"""Helpers shared by tests that need an integer model the way a user gets one (no fixtures: plain functions)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import intqat


def integer(model: nn.Module, config, batches) -> nn.Module:
    """prepare_qat(config), the observers fed with batches (train mode, no grad), to_integer; eval mode. Warnings
    (the census of what each preset leaves float) are silenced: tests assert on the census themselves."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        intqat.prepare_qat(model, config)
        model.train()
        with torch.no_grad():
            for b in batches:
                model(*b)
        intqat.to_integer(model)
    return model.eval()
