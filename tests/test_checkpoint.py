"""Self-describing checkpoints (intqat.checkpoint): LightningModule.load_from_checkpoint rebuilds the
quantized layers of a plain module with no intqat code in it, and every QuantConfig field survives
a checkpoint. Real Trainer, real checkpoint files, real load_from_checkpoint."""

import os
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from intqat import IntQAT, QuantConfig, QuantSpec
from intqat.callback import restore_quant_structure
from intqat.checkpoint import INSTANTIATOR, layer_record
from intqat.nn import FakeQuantLinear, IntLinear

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
]

ROOT = Path(__file__).resolve().parents[1]
# every QuantSpec field away from its default, and grad_gemm too (#13: it resumed as "int8x3")
ODD = QuantConfig(
    weight=QuantSpec(bits=6, symmetric=True, granularity="tensor", observer="minmax", averaging_constant=0.2,
                     percentile=99.0),
    activation=QuantSpec(bits=7, symmetric=False, granularity="tensor", observer="percentile",
                         averaging_constant=0.05, percentile=99.5),
    grad_gemm="fp32",
)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    y = torch.arange(n) % 3
    return TensorDataset(centers[y] + torch.randn(n, 32, generator=g), y)


class PlainClassifier(LightningModule):
    """A 3-layer classifier that knows nothing of intqat (no hooks, no imports)."""

    def __init__(self, hidden: int = 16, lr: float = 1e-2, save_hparams: bool = True):
        super().__init__()
        if save_hparams:
            self.save_hyperparameters()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(_data(64, 1), batch_size=16)


class NoHparamsClassifier(PlainClassifier):
    def __init__(self):
        super().__init__(save_hparams=False)


def _trainer(tmp_path, callbacks, **kw) -> Trainer:
    opts = dict(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=3, enable_progress_bar=False,
                enable_model_summary=False, logger=False, default_root_dir=tmp_path, num_sanity_val_steps=0)
    return Trainer(callbacks=callbacks, **{**opts, **kw})


def _fit_and_save(tmp_path, model, config="w8a8", integer_at=1):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, [IntQAT(config, prepare_at=0, integer_at=integer_at), ckpt])
    trainer.fit(model)
    return ckpt.last_model_path


def _kinds(model) -> dict[str, str]:
    return {f: type(m).__name__ for f, m in model.named_modules() if isinstance(m, (nn.Linear, FakeQuantLinear, IntLinear))}


@pytest.mark.parametrize("cls", [PlainClassifier, NoHparamsClassifier], ids=["save_hyperparameters", "no_hparams"])
def test_load_from_checkpoint_rebuilds_a_plain_module(tmp_path, cls):
    model = cls()
    path = _fit_and_save(tmp_path, model)
    x = _data(32, 2).tensors[0]
    expected = model.eval()(x)

    loaded = cls.load_from_checkpoint(path)  # no Trainer, no callback, no hook in the class
    assert _kinds(loaded) == {"net.0": "IntLinear", "net.2": "IntLinear", "net.4": "IntLinear"}
    assert torch.equal(loaded.eval()(x), expected)
    # the user's hyper-parameters are as they were: the instantiator is the checkpoint's business
    assert "_instantiator" not in loaded.hparams
    saved = torch.load(path, weights_only=True)  # (and loads with weights_only: plain data only)
    assert saved["hyper_parameters"]["_instantiator"] == INSTANTIATOR

    # training goes on from there, integer all the way
    before = loaded.train().net[0].weight.detach().clone()
    _trainer(tmp_path, [], max_epochs=1, enable_checkpointing=False).fit(loaded)
    assert _kinds(loaded)["net.0"] == "IntLinear" and not torch.equal(loaded.net[0].weight, before)
    assert torch.isfinite(loaded.eval()(x)).all()


def test_load_from_checkpoint_boring_model_fake_quant_stage(tmp_path):
    model = BoringModel()
    path = _fit_and_save(tmp_path, model, integer_at=None)  # saved in the fake-quant stage
    x = torch.randn(8, 32)
    expected = model.eval()(x)
    loaded = BoringModel.load_from_checkpoint(path)
    assert type(loaded.layer) is FakeQuantLinear
    assert torch.equal(loaded.eval()(x), expected)


def test_every_quant_config_field_survives_a_checkpoint(tmp_path):
    model = PlainClassifier()
    path = _fit_and_save(tmp_path, model, config=ODD)
    want = {"kind": "integer", **ODD.to_dict()}
    assert set(want) == {"kind"} | {f.name for f in fields(QuantConfig)}
    # load_from_checkpoint, and restore_quant_structure outside Lightning, both rebuild every field
    loaded = PlainClassifier.load_from_checkpoint(path)
    by_hand = PlainClassifier()
    ckpt = torch.load(path, weights_only=True)
    restore_quant_structure(by_hand, ckpt)
    by_hand.load_state_dict(ckpt["state_dict"])
    for m in (loaded, by_hand):
        for fqn in ("net.0", "net.2", "net.4"):
            assert layer_record(m.get_submodule(fqn)) == want, fqn
        assert m.net[0].grad_gemm == "fp32" and m.net[0].input_quantizer.spec == ODD.activation
    x = _data(16, 3).tensors[0]
    assert torch.equal(loaded.eval()(x), model.eval()(x)) and torch.equal(by_hand.eval()(x), model.eval()(x))

    # a checkpoint of an older intqat (format 1: no grad_gemm) still loads, with QuantConfig's default
    old = {**ckpt, "intqat": {"format": 1, "modules": {
        f: {k: v for k, v in r.items() if k != "grad_gemm"} for f, r in ckpt["intqat"]["modules"].items()}}}
    fresh = PlainClassifier()
    restore_quant_structure(fresh, old)
    assert fresh.net[0].grad_gemm == QuantConfig().grad_gemm and fresh.net[0].weight_quantizer.spec == ODD.weight


def test_resume_in_the_trainer_keeps_grad_gemm(tmp_path):
    path = _fit_and_save(tmp_path, PlainClassifier(), config=ODD)
    fresh = PlainClassifier()
    _trainer(tmp_path, [IntQAT(ODD, prepare_at=0, integer_at=1)], max_epochs=3, enable_checkpointing=False).fit(
        fresh, ckpt_path=path)
    assert {m.grad_gemm for m in fresh.modules() if isinstance(m, IntLinear)} == {"fp32"}
    with pytest.raises(ValueError, match=r"'grad_gemm': 'fp32'.*'grad_gemm': 'int8x3'.*pass the checkpoint's config"):
        restore_quant_structure(_quantized(PlainClassifier(), ODD.replace(grad_gemm="int8x3")), torch.load(path))


def _quantized(model, config):
    from intqat import prepare_qat, to_integer

    return to_integer(prepare_qat(model, config))


def test_unknown_config_field_and_newer_format_are_named(tmp_path):
    path = _fit_and_save(tmp_path, PlainClassifier())
    ckpt = torch.load(path, weights_only=True)
    ckpt["intqat"]["modules"]["net.2"]["rounding"] = "stochastic"
    with pytest.raises(ValueError, match=r"layer 'net.2' records QuantConfig field\(s\) \['rounding'\]"):
        restore_quant_structure(PlainClassifier(), ckpt)
    ckpt["intqat"]["format"] = 99
    with pytest.raises(ValueError, match=r"format 99 .* upgrade intqat"):
        restore_quant_structure(PlainClassifier(), ckpt)


class PackedHparams(LightningModule):
    """save_hyperparameters(one dict): Lightning hands the hparams back as one argument."""

    def __init__(self, hparams: dict):
        super().__init__()
        self.save_hyperparameters(hparams)
        self.layer = nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_data(32, 0), batch_size=16)


def test_a_module_the_instantiator_cannot_serve_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match=r"PackedHparams.load_from_checkpoint cannot rebuild .* one argument \('hparams'\)"):
        path = _fit_and_save(tmp_path, PackedHparams({"a": 1}))
    assert "_instantiator" not in torch.load(path, weights_only=True)["hyper_parameters"]


def test_a_fresh_process_that_imports_intqat_before_lightning_loads_it(tmp_path):
    """The loading script imports intqat first (alphabetical), then Lightning: the allowlist that
    Lightning >= 2.6.6 keeps for instantiators still admits intqat's."""
    model = PlainClassifier()
    path = _fit_and_save(tmp_path, model)
    x = _data(8, 4).tensors[0]
    torch.save({"x": x, "y": model.eval()(x)}, tmp_path / "io.pt")
    (tmp_path / "plain.py").write_text(textwrap.dedent("""
        import torch, torch.nn.functional as F
        from lightning.pytorch import LightningModule
        from torch import nn

        class PlainClassifier(LightningModule):
            def __init__(self, hidden=16, lr=1e-2, save_hparams=True):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                         nn.Linear(hidden, 3))

            def forward(self, x):
                return self.net(x)
    """))
    script = (
        "import intqat, sys, torch\n"
        "assert 'lightning.pytorch' not in sys.modules\n"
        "from plain import PlainClassifier\n"
        f"m = PlainClassifier.load_from_checkpoint({str(path)!r}).eval()\n"
        f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
        "print(type(m.net[0]).__name__, torch.equal(m(io['x']), io['y']))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["IntLinear", "True"], out.stdout
