"""The 8x8 handwritten digits of scikit-learn (1,797 images shipped inside the package: no download).

    dm = DigitsDataModule(batch_size=64, seed=0)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))   # x (64, 1, 8, 8) float32 in [0, 1], y (64,) int64

The train / val / test split is stratified and depends only on `seed`, so every run of a recipe
(and every rank under DDP) sees the very same test images.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

from intqat.data.split import SplitDataModule

__all__ = ["DigitsDataModule", "split_indices"]


def split_indices(
    labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stratified (train, val, test) index arrays; fractions are of the whole set."""
    n = len(labels)
    n_test, n_val = round(test_fraction * n), round(val_fraction * n)
    idx = np.arange(n)
    rest, test = train_test_split(idx, test_size=n_test, stratify=labels, random_state=seed)
    train, val = train_test_split(rest, test_size=n_val, stratify=labels[rest], random_state=seed)
    return np.sort(train), np.sort(val), np.sort(test)


class DigitsDataModule(SplitDataModule):
    """sklearn digits as (N, 1, 8, 8) float32 tensors in [0, 1] and int64 labels."""

    num_classes = 10
    dims = (1, 8, 8)

    def __init__(
        self,
        batch_size: int = 64,
        seed: int = 0,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        num_workers: int = 0,
    ):
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"DigitsDataModule(batch_size={batch_size}): must be positive, e.g. batch_size=64")
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"DigitsDataModule(val_fraction={val_fraction}, test_fraction={test_fraction}): each in (0, 1) "
                "and their sum below 1, e.g. val_fraction=0.15, test_fraction=0.15"
            )
        self.save_hyperparameters()
        self.train_set = self.val_set = self.test_set = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        digits = load_digits()
        # pixel values are 0..16 counts of set pixels in 4x4 blocks of the original 32x32 bitmaps
        x = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
        y = torch.from_numpy(digits.target.astype(np.int64))
        hp = self.hparams
        train, val, test = split_indices(digits.target, hp.val_fraction, hp.test_fraction, hp.seed)
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])
        self.test_set = TensorDataset(x[test], y[test])
