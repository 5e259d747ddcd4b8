"""Byte-level text from Python's own standard library: the source files (code, comments, docstrings)
of the interpreter running intqat, read at run time. Nothing is downloaded.

    dm = StdlibTextDataModule(context=128, batch_size=32)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))   # x, y (32, 128) int64 bytes; y is x shifted by one

Split: the top-level `*.py` files of the stdlib directory, sorted by name; every `val_every`-th file
(starting with the first) is validation and test text, the rest training text, so the split is
deterministic for a given Python version (another version ships other files: compare runs on one).
Validation and test windows are fixed, non-overlapping (the first `eval_windows` of each half of the
held-out text); training windows start at random offsets drawn once with `seed`.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from intqat.data.split import SplitDataModule

__all__ = ["StdlibTextDataModule", "stdlib_text", "ByteWindows"]


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The top-level *.py files of the standard library directory, sorted by name."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no *.py files in the standard library directory {root}")
    return files


def stdlib_text(val_every: int = 10, root: str | Path | None = None) -> tuple[Tensor, Tensor]:
    """(train bytes, held-out bytes) as uint8 tensors; files joined with a blank line."""
    train, held = [], []
    for i, path in enumerate(stdlib_files(root)):
        (held if i % val_every == 0 else train).append(path.read_bytes() + b"\n\n")
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(held)


class ByteWindows(Dataset):
    """(x, y) = (data[s : s + T], data[s + 1 : s + T + 1]) as int64 for each start s."""

    def __init__(self, data: Tensor, starts: Tensor, context: int):
        self.data, self.starts, self.context = data, starts, context

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        s = int(self.starts[i])
        chunk = self.data[s : s + self.context + 1].to(torch.int64)
        return chunk[:-1], chunk[1:]


class StdlibTextDataModule(SplitDataModule):
    """Byte-level language modelling on the stdlib's source; vocabulary 256 (bytes)."""

    vocab_size = 256

    def __init__(self, context: int = 128, batch_size: int = 32, seed: int = 0, train_windows: int = 32768,
                 eval_windows: int = 256, val_every: int = 10, num_workers: int = 0):
        super().__init__()
        if context <= 0 or batch_size <= 0 or train_windows <= 0 or eval_windows <= 0:
            raise ValueError(f"StdlibTextDataModule(context={context}, batch_size={batch_size}, train_windows="
                             f"{train_windows}, eval_windows={eval_windows}): all must be positive")
        if val_every < 2:
            raise ValueError(f"StdlibTextDataModule(val_every={val_every}): must be >= 2 (1 leaves no training text)")
        self.save_hyperparameters()
        self.train_set = self.val_set = self.test_set = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        train, held = stdlib_text(hp.val_every)
        T = hp.context
        gen = torch.Generator().manual_seed(hp.seed)
        starts = torch.randint(0, len(train) - T - 1, (hp.train_windows,), generator=gen)
        self.train_set = ByteWindows(train, starts, T)
        # held-out text: first half validation, second half test; fixed non-overlapping windows
        half = len(held) // 2
        for name, lo, hi in (("val_set", 0, half), ("test_set", half, len(held))):
            n = min(hp.eval_windows, (hi - lo - 1) // T)
            if n <= 0:
                raise ValueError(f"the held-out text ({hi - lo} bytes) is shorter than one window of {T + 1}")
            setattr(self, name, ByteWindows(held, torch.arange(n) * T + lo, T))
