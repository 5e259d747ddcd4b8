"""A validation pass between integer training steps, as Lightning runs it (eval mode, torch.inference_mode): the
integer layers validate through the training op (convs always, linear layers up to FUSED_NO_GRAD_MAX_WEIGHTS), whose
reused buffers must stay writable by the next training step, and validation must change nothing that training sees.
Real Lightning, a small MBConv-like net (stem, depthwise, squeeze-excite, a 1x1 project, two linear layers: one
above the bound, one below) on generated images."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import intqat
from intqat import IntQAT
from intqat.nn.linear import FUSED_NO_GRAD_MAX_WEIGHTS

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]


class _SE(nn.Module):
    def __init__(self, c: int, r: int):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(c, r, 1), nn.Conv2d(r, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.expand(F.relu(self.reduce(x.mean((2, 3), keepdim=True)))))


class _Net(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU(),
            nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.SiLU(), _SE(16, 4),
            nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32),
            nn.Flatten(), nn.Linear(32 * 8 * 8, 48), nn.ReLU(), nn.Linear(48, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(_images(64, 0), batch_size=16)

    def val_dataloader(self):  # a larger batch than training's: its buffers are (re)made inside inference_mode
        return DataLoader(_images(64, 1), batch_size=32)


def _images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 3, 16, 16, generator=g) + y.reshape(-1, 1, 1, 1)
    return TensorDataset(x, y)


def _fit(tmp_path, validate: bool) -> _Net:
    torch.manual_seed(0)
    model = _Net()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=3, enable_progress_bar=False,
                      enable_model_summary=False, logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
                      limit_val_batches=2 if validate else 0, num_sanity_val_steps=0,
                      callbacks=[IntQAT("w8a8", integer_at=1)])
    trainer.fit(model)
    return model


def test_validation_between_integer_steps_changes_nothing_training_sees(tmp_path):
    big, small = 32 * 8 * 8 * 48, 48 * 3
    assert small <= FUSED_NO_GRAD_MAX_WEIGHTS < big  # one linear layer on each side of the bound
    validated = _fit(tmp_path / "a", validate=True)
    assert len(intqat.quantized_modules(validated)) == 7  # 5 convs, 2 linear layers: all integer
    plain = _fit(tmp_path / "b", validate=False)
    # the same weights, BN statistics and observer buffers after 2 integer epochs, bit for bit
    for (k, t), u in zip(validated.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(t, u), k
