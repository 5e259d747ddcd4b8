"""IntQAT under Lightning's ModelParallelStrategy (FSDP2), 2 CPU processes (gloo), and its distributed checkpoints.

The module shards itself in `configure_model` (Lightning's way); IntQAT runs the schedule on the sharded
model: prepare at epoch 1, observers frozen at 2, integer modules from 3. Checked:
- every step's loss (averaged over the ranks) equals a one-process run of the same schedule on the same
  global batches within 1e-5;
- the checkpoints are distributed (a directory of shards) and record the quantized structure; a fresh float
  model resumed from the epoch-3 checkpoint starts with the very weights and quantizer state the first run
  had at the end of epoch 3 (its float model got the integer layers, then their state from the shards),
  and ends epoch 4 where the first run ended it.

This file is also the script each rank runs (Lightning relaunches `python <this file> ...` per rank).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

EPOCHS = 5
SCHEDULE = dict(prepare_at=1, freeze_observers_at=2, integer_at=3)
LOSS_TOL = 1e-5
RESUME_FROM = "epoch=3-step=16.ckpt"  # saved at the end of epoch 3: the first integer epoch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 32, generator=g), torch.randint(0, 8, (256,), generator=g)


def _full_state(module: nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}


# -- what each rank runs ---------------------------------------------------------------------------


def _run(out: str) -> None:
    import lightning as L
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from intqat import IntQAT

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def configure_model(self):
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.model, FSDPModule):
                return  # (Lightning calls it again for validate / test)
            mesh = self.device_mesh["data_parallel"]
            for m in self.model:
                if isinstance(m, nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Record(L.Callback):
        """Every step's loss averaged over the ranks; the whole state at the points the test compares."""

        def __init__(self):
            self.losses, self.states = [], {}

        def on_train_start(self, trainer, pl_module):
            self.states["start"] = _full_state(pl_module)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"].detach().clone()
            dist.all_reduce(loss)
            self.losses.append(float(loss) / trainer.world_size)

        def on_train_epoch_end(self, trainer, pl_module):
            self.states[f"epoch{trainer.current_epoch}"] = _full_state(pl_module)

    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=32)

    def fit(ckpt: str | None) -> dict:
        record = Record()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            max_epochs=EPOCHS, callbacks=[IntQAT("w8a8", **SCHEDULE), record,
                                          ModelCheckpoint(dirpath=Path(out) / "ckpt", save_top_k=-1, every_n_epochs=1)],
            logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            default_root_dir=out)
        module = Module()  # float: resuming, IntQAT gives it the checkpoint's integer layers
        trainer.fit(module, loader, loader, ckpt_path=ckpt)
        kinds = {n: type(m).__name__ for n, m in module.model.named_children()}
        return {"losses": record.losses, "states": record.states, "kinds": kinds, "rank": trainer.global_rank}

    first = fit(None)  # (the same processes run both: one start-up)
    resumed = fit(str(Path(out) / "ckpt" / RESUME_FROM))
    if first["rank"] == 0:
        torch.save({"first": first, "resumed": resumed}, Path(out) / "runs.pt")


# -- the test --------------------------------------------------------------------------------------


def _launch(tmp_path: Path) -> dict:
    r = subprocess.run([sys.executable, __file__, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(tmp_path / "runs.pt", weights_only=False)


def _global_batches(epoch: int) -> list[torch.Tensor]:
    """The indices of each step's global batch: Lightning's DistributedSampler (shuffle, seed 0, set_epoch) hands
    rank r the permutation's r::2 samples, 32 a step."""
    g = torch.Generator().manual_seed(epoch)
    perm = torch.randperm(256, generator=g)
    return [torch.cat([perm[r::2][i:i + 32] for r in range(2)]) for i in range(0, 128, 32)]


def _one_process_losses() -> list[float]:
    """The same schedule by hand, one process, global batches of 64 (the two ranks' 32 + 32)."""
    import intqat

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()
    losses = []
    for epoch in range(EPOCHS):
        if epoch == SCHEDULE["prepare_at"]:
            intqat.prepare_qat(model, "w8a8")
        if epoch == SCHEDULE["freeze_observers_at"]:
            intqat.freeze_observers(model)
        if epoch == SCHEDULE["integer_at"]:
            intqat.to_integer(model)
        for idx in _global_batches(epoch):
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    return losses


def test_intqat_schedule_and_distributed_checkpoints_under_model_parallel_strategy(tmp_path):
    runs = _launch(tmp_path)
    first, resumed = runs["first"], runs["resumed"]
    assert set(first["kinds"].values()) == {"FSDPIntLinear", "ReLU"}, first["kinds"]
    reference = _one_process_losses()
    assert len(first["losses"]) == len(reference) == 4 * EPOCHS
    diffs = [abs(a - b) for a, b in zip(first["losses"], reference)]
    assert max(diffs) <= LOSS_TOL, list(zip(first["losses"], reference))

    ckpt = tmp_path / "ckpt" / RESUME_FROM
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    meta = torch.load(ckpt / "meta.pt", weights_only=False)
    assert {r["kind"] for r in meta["intqat"]["modules"].values()} == {"integer"}

    assert set(resumed["kinds"].values()) == {"FSDPIntLinear", "ReLU"}
    start, saved = resumed["states"]["start"], first["states"]["epoch3"]
    assert start.keys() == saved.keys() and any("input_quantizer.scale" in k for k in start)
    for k in saved:
        assert torch.equal(start[k], saved[k]), k
    end, first_end = resumed["states"]["epoch4"], first["states"]["epoch4"]
    for k in first_end:
        assert torch.equal(end[k], first_end[k]), k


if __name__ == "__main__":
    _run(sys.argv[1])
