"""CIFAR-10 from the standard python batches in a local directory (intqat never downloads).

    dm = Cifar10DataModule(data_dir="~/data/cifar-10-batches-py", batch_size=128)

`data_dir` holds data_batch_1 .. data_batch_5 and test_batch (pickled dicts: b"data" uint8
(N, 3072) in CHW order, b"labels" list of ints), i.e. the extracted "CIFAR-10 python version";
its parent (the directory you extracted the archive in) works too. The validation set is a
seeded, stratified slice of the 50,000 training images; the test set is test_batch.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset

from intqat.data.split import SplitDataModule

__all__ = ["Cifar10DataModule", "load_cifar10_batches", "CIFAR10_MEAN", "CIFAR10_STD"]

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
ARCHIVE_DIR = "cifar-10-batches-py"
# per-channel statistics of the 50,000 training images (the values the literature uses)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

_HOW_TO_GET = (
    "intqat never downloads data. Get the 'CIFAR-10 python version' from "
    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extract it "
    "(tar xzf cifar-10-python.tar.gz) and pass data.data_dir=/path/to/cifar-10-batches-py"
)


def resolve_data_dir(data_dir: str | os.PathLike) -> Path:
    """The directory holding the batch files: data_dir itself or data_dir/cifar-10-batches-py."""
    root = Path(data_dir).expanduser()
    for candidate in (root, root / ARCHIVE_DIR):
        if all((candidate / f).is_file() for f in (*TRAIN_FILES, TEST_FILE)):
            return candidate
    if not root.is_dir():
        raise FileNotFoundError(f"CIFAR-10 directory {str(root)!r} does not exist. {_HOW_TO_GET}")
    base = root / ARCHIVE_DIR if (root / ARCHIVE_DIR).is_dir() else root
    missing = [f for f in (*TRAIN_FILES, TEST_FILE) if not (base / f).is_file()]
    raise FileNotFoundError(f"CIFAR-10 files {missing} not found in {str(base)!r}. {_HOW_TO_GET}")


def load_cifar10_batches(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 3, 32, 32) uint8, labels (N,) int64) from pickled CIFAR-10 batch files."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        assert data.ndim == 2 and data.shape[1] == 3 * 32 * 32, f"{path}: b'data' has shape {data.shape}"
        images.append(data.reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


class _Cifar10Set(Dataset):
    """uint8 images kept as they are (150 MB for 50k), normalized per item; optional flip + crop."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, augment: bool):
        self.images = torch.from_numpy(images)
        self.labels = torch.from_numpy(labels)
        self.augment = augment
        self.mean = torch.tensor(CIFAR10_MEAN).reshape(3, 1, 1)
        self.std = torch.tensor(CIFAR10_STD).reshape(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i].to(torch.float32).div_(255.0)
        x = (x - self.mean) / self.std
        if self.augment:
            # the standard CIFAR augmentation: random crop from a 4-pixel zero-padded image, h-flip
            if torch.rand(()) < 0.5:
                x = x.flip(-1)
            x = torch.nn.functional.pad(x, (4, 4, 4, 4))
            top, left = torch.randint(0, 9, (2,)).tolist()
            x = x[:, top : top + 32, left : left + 32]
        return x, self.labels[i]


class Cifar10DataModule(SplitDataModule):
    """CIFAR-10 as (N, 3, 32, 32) float32 tensors normalized per channel, int64 labels."""

    num_classes = 10
    dims = (3, 32, 32)

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 128,
        seed: int = 0,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        augment: bool = True,
    ):
        super().__init__()
        if data_dir is None or str(data_dir) in ("", "???"):
            raise FileNotFoundError(f"Cifar10DataModule needs data_dir. {_HOW_TO_GET}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"Cifar10DataModule(val_fraction={val_fraction}): must be in (0, 1), e.g. 0.1")
        self.save_hyperparameters()
        self.train_set = self.val_set = self.test_set = None

    def prepare_data(self) -> None:
        resolve_data_dir(self.hparams.data_dir)  # fail before any process starts training

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        root = resolve_data_dir(hp.data_dir)
        x, y = load_cifar10_batches([root / f for f in TRAIN_FILES])
        x_test, y_test = load_cifar10_batches([root / TEST_FILE])
        train, val = train_test_split(
            np.arange(len(y)), test_size=round(hp.val_fraction * len(y)), stratify=y, random_state=hp.seed
        )
        train, val = np.sort(train), np.sort(val)
        self.train_set = _Cifar10Set(x[train], y[train], augment=hp.augment)
        self.val_set = _Cifar10Set(x[val], y[val], augment=False)
        self.test_set = _Cifar10Set(x_test, y_test, augment=False)
