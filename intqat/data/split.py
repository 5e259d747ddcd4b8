"""The loaders every intqat data module shares: train / val / test sets made in `setup`."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader


class SplitDataModule(L.LightningDataModule):
    """Subclasses set `train_set`, `val_set`, `test_set` in setup(); hparams hold batch_size, seed, num_workers."""

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        # A private generator: the batch order depends on `seed` only, not on who drew from torch's RNG.
        generator = torch.Generator().manual_seed(self.hparams.seed) if shuffle else None
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            generator=generator,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
