"""The IntQAT callback with attention: a transformer encoder layer's nn.MultiheadAttention goes fake-quant
at prepare_at and integer at integer_at like its linear layers, and a checkpoint saved after the swap
loads into a plain module (load_from_checkpoint, no intqat code) with the same outputs bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from intqat import IntQAT
from intqat.nn import FakeQuantMultiheadAttention, IntLinear, IntMultiheadAttention

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*enable_nested_tensor.*"),
]


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, 16, generator=g)
    return TensorDataset(x, (x.sum(dim=(1, 2)) > 0).long())


class TinyEncoder(LightningModule):
    """An encoder layer and a head; nothing of intqat in it."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(_data(48, 1), batch_size=16)


def test_callback_swaps_attention_and_the_checkpoint_loads_without_intqat_code(tmp_path):
    torch.manual_seed(0)
    model = TinyEncoder()
    stages = []

    class Spy(IntQAT):
        def on_train_epoch_start(self, trainer, pl_module):
            super().on_train_epoch_start(trainer, pl_module)
            stages.append(type(pl_module.encoder.self_attn).__name__)

    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=3, enable_progress_bar=False, logger=False,
                      enable_model_summary=False, callbacks=[Spy("w8a8", prepare_at=0, freeze_observers_at=2,
                                                                 integer_at=2), ckpt])
    trainer.fit(model)
    assert stages == ["FakeQuantMultiheadAttention", "FakeQuantMultiheadAttention", "IntMultiheadAttention"]
    assert isinstance(model.encoder.linear1, IntLinear) and isinstance(model.head, IntLinear)
    attn = model.encoder.self_attn
    assert not attn.q_input_quantizer.observer_enabled  # freeze_observers reached the attention's quantizers

    loaded = TinyEncoder.load_from_checkpoint(tmp_path / "last.ckpt")
    assert isinstance(loaded.encoder.self_attn, IntMultiheadAttention)
    x = _data(8, 2).tensors[0]
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert not isinstance(loaded.encoder.self_attn, FakeQuantMultiheadAttention)
