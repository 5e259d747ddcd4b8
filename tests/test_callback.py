"""IntQAT, the Lightning callback: arguments, schedule, optimizer state, checkpoints, pruning,
non-finite stops, metrics, resume and DDP. Tiny models on synthetic data, real Lightning."""

import csv
import os

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from intqat import IntQAT
from intqat.callback import NonFiniteError, restore_quant_structure
from intqat.nn import ActivationQuantizer, FakeQuantConv2d, IntConv2d, IntLinear

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
]


def _dataset(n: int, seed: int, image: bool) -> TensorDataset:
    centers = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    y = torch.arange(n) % 3
    x = centers[y] + torch.randn(n, 64, generator=torch.Generator().manual_seed(seed + 1))
    return TensorDataset(x.reshape(n, 1, 8, 8) if image else x, y)


class TinyClassifier(LightningModule):
    def __init__(self, conv: bool = False, lr: float = 1e-2, nan_at_step: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        if conv:
            conv_bn = [nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)]
            self.net = nn.Sequential(*conv_bn, nn.ReLU(), nn.Flatten(), nn.Linear(256, 3))
        else:
            self.net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.global_step == self.hparams.nan_at_step:
            loss = loss * float("nan")
        return loss

    def _evaluate(self, batch, prefix):
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, y))
        self.log(f"{prefix}_acc", (logits.argmax(1) == y).float().mean())

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(_dataset(96, 0, self.hparams.conv), batch_size=16)

    def val_dataloader(self):
        return DataLoader(_dataset(32, 1, self.hparams.conv), batch_size=16)

    test_dataloader = val_dataloader


class RestoringClassifier(TinyClassifier):
    """What a LightningModule adds so checkpoints load without the callback (load_from_checkpoint)."""

    def on_load_checkpoint(self, checkpoint):
        restore_quant_structure(self, checkpoint)


def _trainer(tmp_path, callbacks, **kw) -> Trainer:
    opts = dict(
        accelerator="cpu", devices=1, max_epochs=1, enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=False, default_root_dir=tmp_path, limit_val_batches=1,
    )
    return Trainer(callbacks=callbacks, **{**opts, **kw})


def _kinds(model) -> dict[str, str]:
    return {f: type(m).__name__ for f, m in model.net.named_children() if not isinstance(m, (nn.ReLU, nn.Flatten))}


class Recorder(Callback):
    """After IntQAT's hooks (it comes later in `callbacks`): the model as each epoch / step starts."""

    def __init__(self, unit="epoch"):
        self.unit, self.seen = unit, {}

    def _record(self, key, pl_module):
        quantizers = [m for m in pl_module.modules() if isinstance(m, ActivationQuantizer)]
        convs = [m for m in pl_module.modules() if isinstance(m, (FakeQuantConv2d, IntConv2d))]
        self.seen[key] = dict(
            kinds=_kinds(pl_module),
            observing=[bool(q.observer_enabled) for q in quantizers],
            bn_frozen=[bool(c.bn_frozen) for c in convs],
        )

    def on_train_epoch_start(self, trainer, pl_module):
        if self.unit == "epoch":
            self._record(trainer.current_epoch, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.unit == "step":
            self._record(trainer.global_step, pl_module)


# -- __init__ errors: one case per raise ------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(config="w3a3"), ValueError, r"IntQAT\(config='w3a3'\).*available"),
        (dict(config=3), TypeError, r"IntQAT\(config=3\)"),
        (dict(integer_at=1.5), TypeError, r"IntQAT\(integer_at=1.5\).*e.g. IntQAT\(integer_at=2\)"),
        (dict(freeze_bn_at=True), TypeError, r"IntQAT\(freeze_bn_at=True\)"),
        (dict(prepare_at=-1), ValueError, r"IntQAT\(prepare_at=-1\): must be >= 0"),
        (dict(prepare_at=3, integer_at=2), ValueError, r"prepare cannot start after .*IntQAT\(prepare_at=2, integer"),
        (dict(freeze_observers_at=4, integer_at=2), ValueError, r"freeze_observers cannot start after integer"),
        (dict(unit="batch"), ValueError, r"IntQAT\(unit='batch'\): use unit='epoch'"),
        (dict(filter_fn="fc"), TypeError, r"IntQAT\(filter_fn='fc'\)"),
        (dict(export_on_fit_end=True, export_fn=1), TypeError, r"IntQAT\(export_fn=1\)"),
        (dict(export_on_fit_end=True), ValueError, r"export_fn=my_export"),
        (dict(log_quant_metrics="yes"), TypeError, r"log_quant_metrics='yes'"),
        (dict(quant_metrics_every_n_steps=0), ValueError, r"quant_metrics_every_n_steps=0"),
    ],
)
def test_init_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        IntQAT(**kwargs)


def test_init_accepts_names_dicts_and_callables():
    cb = IntQAT({"preset": "w4a8"}, prepare_at=0, integer_at=lambda trainer, pl_module: False, unit="step")
    assert cb.config.weight.bits == 4
    with pytest.warns(UserWarning, match="set freeze_observers_at"):
        IntQAT("w8a8_lsq")
    assert ".. code-block:: python" in IntQAT.__doc__ and "Trainer(" in IntQAT.__doc__
    assert IntQAT(prepare_at=1).state_key != IntQAT(prepare_at=2).state_key


# -- the schedule ---------------------------------------------------------------------------


def test_stages_follow_the_epoch_schedule(tmp_path):
    model = TinyClassifier(conv=True)
    qat = IntQAT("w8a8", prepare_at=1, freeze_bn_at=1, freeze_observers_at=2, integer_at=3)
    rec = Recorder("epoch")
    _trainer(tmp_path, [qat, rec], max_epochs=4, limit_train_batches=2).fit(model)
    seen = rec.seen
    assert seen[0] == dict(kinds={"0": "Conv2d", "1": "BatchNorm2d", "4": "Linear"}, observing=[], bn_frozen=[])
    assert seen[1]["kinds"] == {"0": "FakeQuantConv2d", "1": "Identity", "4": "FakeQuantLinear"}  # BN folded
    assert seen[1]["bn_frozen"] == [True] and seen[1]["observing"] == [True, True]
    assert seen[2]["kinds"] == seen[1]["kinds"] and seen[2]["observing"] == [False, False]
    assert seen[3]["kinds"] == {"0": "IntConv2d", "1": "Identity", "4": "IntLinear"}
    assert qat.boundaries == {
        "prepare": {"epoch": 1, "step": 2}, "freeze_bn": {"epoch": 1, "step": 2},
        "freeze_observers": {"epoch": 2, "step": 4}, "integer": {"epoch": 3, "step": 6},
    }


def test_stages_follow_the_step_schedule_and_callables(tmp_path):
    model = TinyClassifier()
    qat = IntQAT(prepare_at=2, integer_at=lambda trainer, pl_module: trainer.global_step >= 5, unit="step",
                 filter_fn=lambda module, fqn: fqn != "net.2")  # fmt: skip
    rec = Recorder("step")
    _trainer(tmp_path, [qat, rec], max_epochs=2, limit_train_batches=4).fit(model)
    kinds = {step: seen["kinds"]["0"] for step, seen in rec.seen.items()}
    assert kinds == {0: "Linear", 1: "Linear", 2: "FakeQuantLinear", 3: "FakeQuantLinear", 4: "FakeQuantLinear",
                     5: "IntLinear", 6: "IntLinear", 7: "IntLinear"}  # fmt: skip
    assert {seen["kinds"]["2"] for seen in rec.seen.values()} == {"Linear"}  # filtered out
    assert qat.boundaries["integer"] == {"epoch": 1, "step": 5}


def test_sanity_check_after_prepare_in_setup_leaves_no_trace(tmp_path):
    class AtTrainStart(Callback):  # after the sanity check, before the first batch
        def on_train_start(self, trainer, pl_module):
            quantizers = [q for q in pl_module.modules() if isinstance(q, ActivationQuantizer)]
            self.initialized = [bool(q.initialized) for q in quantizers]

    seen = AtTrainStart()
    trainer = _trainer(tmp_path, [IntQAT(prepare_at=0), seen], num_sanity_val_steps=1, limit_train_batches=1)
    trainer.fit(TinyClassifier())  # the sanity check evaluates fake-quant layers that never saw data
    assert seen.initialized == [False, False]


def test_optimizer_state_survives_the_swap(tmp_path):
    class Snapshots(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch > 0:
                return
            opt = trainer.optimizers[0]
            self.before = {id(p): (p, {k: v.clone() for k, v in opt.state[p].items()}) for p in opt.state}

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:  # after IntQAT swapped to integer
                opt = trainer.optimizers[0]
                self.after = {id(p): (p, {k: v.clone() for k, v in opt.state[p].items()}) for p in opt.state}
                self.model_params = {id(p) for p in pl_module.parameters()}
                self.kinds = _kinds(pl_module)

    model = TinyClassifier()
    snaps = Snapshots()
    _trainer(tmp_path, [IntQAT(prepare_at=0, integer_at=1), snaps], max_epochs=2, limit_train_batches=3).fit(model)
    assert snaps.kinds == {"0": "IntLinear", "2": "IntLinear"}
    assert snaps.after.keys() == snaps.before.keys() == snaps.model_params  # same Parameter objects
    for key, (p, state) in snaps.after.items():
        assert p is snaps.before[key][0]
        for name, value in state.items():
            torch.testing.assert_close(value, snaps.before[key][1][name], atol=0, rtol=0)
    opt_step = next(iter(model.trainer.optimizers[0].state.values()))["step"]
    assert int(opt_step) == 6  # Adam went on counting through the integer epoch


# -- checkpoints ---------------------------------------------------------------------------------


class AtTrainStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.kinds, self.step = _kinds(pl_module), trainer.global_step
        self.weight = pl_module.net[0].weight.detach().clone()
        self.scale = pl_module.net[0].input_quantizer.scale.detach().clone()


@pytest.mark.parametrize("prepare_at", [0, 1])  # prepared in setup / rebuilt from the checkpoint's state_dict
def test_checkpoint_after_swap_resumes_in_a_fresh_trainer(tmp_path, prepare_at):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    qat = IntQAT(prepare_at=prepare_at, integer_at=1)
    trainer = _trainer(tmp_path, [qat, ckpt], max_epochs=2, limit_train_batches=3, enable_checkpointing=True)
    trainer.fit(TinyClassifier())
    saved = torch.load(ckpt.last_model_path, weights_only=False)
    assert {f: r["kind"] for f, r in saved["intqat"]["modules"].items()} == {"net.0": "integer", "net.2": "integer"}

    fresh, at_start = TinyClassifier(), AtTrainStart()  # a float model: IntQAT rebuilds it from the checkpoint
    qat2 = IntQAT(prepare_at=prepare_at, integer_at=1)
    trainer = _trainer(tmp_path, [qat2, at_start], max_epochs=3, limit_train_batches=3)
    trainer.fit(fresh, ckpt_path=ckpt.last_model_path)
    assert at_start.kinds == {"0": "IntLinear", "2": "IntLinear"} and at_start.step == 6
    torch.testing.assert_close(at_start.weight, saved["state_dict"]["net.0.weight"], atol=0, rtol=0)
    torch.testing.assert_close(at_start.scale, saved["state_dict"]["net.0.input_quantizer.scale"], atol=0, rtol=0)
    assert qat2.boundaries == qat.boundaries
    assert trainer.global_step == 9 and _kinds(fresh) == {"0": "IntLinear", "2": "IntLinear"}
    assert not torch.equal(fresh.net[0].weight, at_start.weight)  # it went on training

    with pytest.raises(ValueError, match=r"layer 'net.0' was quantized with .* pass the checkpoint's config"):
        other_config = _trainer(tmp_path, [IntQAT("w4a8", prepare_at=prepare_at)])
        other_config.validate(TinyClassifier(), ckpt_path=ckpt.last_model_path)


def test_test_validate_and_load_from_checkpoint_after_swap(tmp_path):
    model, ckpt = RestoringClassifier(), ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, [IntQAT(prepare_at=0, integer_at=1), ckpt], max_epochs=2, limit_train_batches=3,
                       enable_checkpointing=True)  # fmt: skip
    trainer.fit(model)
    path = ckpt.last_model_path
    x, y = _dataset(32, 1, False).tensors
    expected = model.eval()(x)
    expected_acc = (expected.argmax(1) == y).float().mean().item()

    # no Trainer, no callback: the module's hook (idempotent with intqat's instantiator), or nothing at all
    for cls in (RestoringClassifier, TinyClassifier):
        loaded = cls.load_from_checkpoint(path)
        assert _kinds(loaded) == {"0": "IntLinear", "2": "IntLinear"}
        torch.testing.assert_close(loaded.eval()(x), expected, atol=0, rtol=0)

    # the module's hook alone, and a plain module with IntQAT in the Trainer, both restore it
    for module, callbacks in [(RestoringClassifier(), []), (TinyClassifier(), [IntQAT(prepare_at=0, integer_at=1)])]:
        tester = _trainer(tmp_path, callbacks, limit_val_batches=None, limit_test_batches=None)
        (tested,) = tester.test(module, ckpt_path=path, verbose=False)
        (validated,) = tester.validate(module, ckpt_path=path, verbose=False)
        assert tested["test_acc"] == pytest.approx(expected_acc) and validated["val_acc"] == pytest.approx(expected_acc)
        assert _kinds(module) == {"0": "IntLinear", "2": "IntLinear"}
    assert {"quant_test/net.0/sqnr_db", "quant_test/net.2/saturation", "quant_test/sqnr_db"} <= tested.keys()
    assert {"quant_val/net.0/sqnr_db", "quant_val/sqnr_db"} <= validated.keys()


# -- other models and callbacks ---------------------------------------------------------------


class KwargsClassifier(TinyClassifier):
    """forward(**kwargs) (Lightning #15862 broke its QAT callback on these)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 16), nn.Linear(16, 3)
        del self.net

    def forward(self, **kwargs):
        return self.fc2(F.relu(self.fc1(kwargs["x"])))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(x=batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(x=batch[0]), batch[1]))


def test_forward_with_kwargs_and_export_at_fit_end(tmp_path):
    exported = []

    def export(pl_module, trainer, export_dir):
        exported.append((type(pl_module.fc1).__name__, trainer.global_step, export_dir))

    model = KwargsClassifier()
    qat = IntQAT(prepare_at=0, integer_at=1, quant_metrics_every_n_steps=1, export_on_fit_end=True, export_fn=export)
    trainer = _trainer(tmp_path, [qat], max_epochs=2, limit_train_batches=2)
    trainer.fit(model)
    assert isinstance(model.fc1, IntLinear) and isinstance(model.fc2, IntLinear)
    assert exported == [("IntLinear", 4, os.path.join(str(tmp_path), "export"))]
    metrics = trainer.callback_metrics
    assert {"quant/fc1/sqnr_db", "quant/fc2/saturation", "quant_val/fc1/sqnr_db", "quant/stage"} <= metrics.keys()
    assert metrics["quant/stage"] == 2 and metrics["quant_val/fc1/sqnr_db"] > 20


def test_model_pruning_alongside(tmp_path):
    """ModelPruning (listed first) prunes the float layers, then the fake-quant ones, then the integer
    ones: the prune re-parametrisation moves with every swap and the weights keep training."""
    model = TinyClassifier()
    weight = model.net[0].weight  # the Parameter the optimizer holds

    class Watch(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 2:
                self.start = pl_module.net[0].weight_orig.detach().clone()

        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 2:
                layer = pl_module.net[0]
                self.end, self.layer, self.mask = layer.weight_orig.detach().clone(), layer, layer.weight_mask.clone()

    watch = Watch()
    pruning = ModelPruning("l1_unstructured", amount=0.3, parameter_names=["weight"], verbose=0)
    trainer = _trainer(tmp_path, [pruning, IntQAT(prepare_at=1, integer_at=2), watch], max_epochs=3,
                       limit_train_batches=3)  # fmt: skip
    trainer.fit(model)
    layer = model.net[0]
    assert isinstance(layer, IntLinear) and layer is watch.layer
    assert layer.weight is weight and "weight" in dict(layer.named_parameters())  # made permanent at train end
    assert not torch.equal(watch.start, watch.end)  # the integer layer's weight_orig was trained
    assert trainer.optimizers[0].param_groups[0]["params"][0] is weight
    weights = torch.cat([model.net[0].weight.flatten(), model.net[2].weight.flatten()])
    sparsity = (weights == 0).float().mean().item()  # ModelPruning prunes globally by default
    assert sparsity == pytest.approx(1 - 0.7**3, abs=0.005)  # three rounds of pruning reached it
    assert torch.equal(layer.weight == 0, watch.mask == 0)


# -- non-finite values ---------------------------------------------------------------------------


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"

    class Files(Callback):  # what the last good epoch left on disk
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.files = {f: (ckpt_dir / f).read_bytes() for f in os.listdir(ckpt_dir)}

    files = Files()
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=3)
    trainer = _trainer(tmp_path, [IntQAT(prepare_at=0, integer_at=1), ckpt, files], max_epochs=3,
                       limit_train_batches=6, enable_checkpointing=True)  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"the loss.* non-finite .* at epoch 1, batch 2 \(global step 8\)"):
        trainer.fit(TinyClassifier(nan_at_step=8))  # step 9 would have been saved (every_n_train_steps=3)
    assert trainer.should_stop
    assert sorted(files.files) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert {f: (ckpt_dir / f).read_bytes() for f in os.listdir(ckpt_dir)} == files.files


def test_non_finite_scale_names_the_layer(tmp_path):
    class Corrupt(Callback):  # runs before IntQAT's check (earlier in `callbacks`)
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                pl_module.net[2].input_quantizer.scale.fill_(float("inf"))

    trainer = _trainer(tmp_path, [Corrupt(), IntQAT(prepare_at=0)], max_epochs=1, limit_train_batches=4)
    with pytest.raises(NonFiniteError, match=r"^IntQAT: the input scale of layer 'net.2' became non-finite .*batch 1 "):
        trainer.fit(TinyClassifier())


# -- metrics -------------------------------------------------------------------------------------


def test_quant_metrics_and_stage_are_logged(tmp_path):
    logger = CSVLogger(tmp_path, name="run")
    qat = IntQAT(prepare_at=1, integer_at=2, quant_metrics_every_n_steps=2)
    trainer = _trainer(tmp_path, [qat], logger=logger, log_every_n_steps=1, max_epochs=3, limit_train_batches=4)
    trainer.fit(TinyClassifier())
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))

    def column(name):
        return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]

    per_layer = {f"{p}/{layer}/{m}" for p in ("quant", "quant_val") for layer in ("net.0", "net.2")
                 for m in ("sqnr_db", "saturation")}  # fmt: skip
    assert per_layer | {"quant/stage", "quant/sqnr_db", "quant_val/sqnr_db"} <= rows[0].keys()
    # the stage per step, exact at the boundaries (step 4: fake quant, step 8: integer)
    assert sorted(set(column("quant/stage"))) == [(s, 0.0) for s in range(4)] + [(s, 1.0) for s in range(4, 8)] + [
        (s, 2.0) for s in range(8, 12)]  # fmt: skip
    assert [s for s, _ in column("quant/net.0/sqnr_db")] == [4, 6, 8, 10]  # measured every 2nd step, once each
    assert [s for s, _ in column("quant_val/net.0/sqnr_db")] == [7, 11]  # each validation after prepare
    assert all(v > 15 for _, v in column("quant/net.0/sqnr_db") + column("quant_val/sqnr_db"))  # 8 bits: ~6 dB/bit
    assert all(0 <= v <= 1 for _, v in column("quant/net.2/saturation"))
    assert trainer.progress_bar_metrics.keys() >= {"quant/sqnr_db", "quant_val/sqnr_db"}


# -- resume ----------------------------------------------------------------------------------


def test_interrupted_run_resumes_to_the_same_weights(tmp_path):
    """LSQ scales created at epoch 1 (their own param group), integer from epoch 2; a run cut after
    epoch 1 and resumed ends bit-identical to one that was never interrupted."""

    def run(max_epochs, ckpt=None, ckpt_path=None):
        torch.manual_seed(0)
        model = TinyClassifier(lr=5e-3)
        qat = IntQAT("w8a8_lsq", prepare_at=1, freeze_observers_at=2, integer_at=2)
        trainer = _trainer(tmp_path, [qat] + ([ckpt] if ckpt else []), max_epochs=max_epochs, limit_train_batches=3,
                           deterministic=True, enable_checkpointing=ckpt is not None)  # fmt: skip
        trainer.fit(model, ckpt_path=ckpt_path)
        return model, trainer

    full, full_trainer = run(4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    run(2, ckpt=ckpt)
    resumed, trainer = run(4, ckpt_path=ckpt.last_model_path)
    assert _kinds(resumed) == {"0": "IntLinear", "2": "IntLinear"}
    assert [len(g["params"]) for g in trainer.optimizers[0].param_groups] == [4, 6]  # weights+biases, 3 scales x 2
    expected = full.state_dict()
    for name, value in resumed.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)
    at_cut = torch.load(ckpt.last_model_path, weights_only=False)["state_dict"]
    assert not torch.equal(expected["net.0.weight_quantizer.scale"], at_cut["net.0.weight_quantizer.scale"])  # learned
    assert trainer.callback_metrics["val_acc"] == full_trainer.callback_metrics["val_acc"] == 1.0


# -- DDP -------------------------------------------------------------------------------------


class RankRecord(Callback):
    """Each rank writes what it saw: module kind per step, final weights, boundaries, metrics."""

    def __init__(self, out):
        self.out, self.kinds = out, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.kinds[trainer.global_step] = type(pl_module.net[0]).__name__

    def on_fit_end(self, trainer, pl_module):
        qat = next(cb for cb in trainer.callbacks if isinstance(cb, IntQAT))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        record = dict(kinds=self.kinds, state=pl_module.state_dict(), boundaries=qat.boundaries, metrics=metrics)
        torch.save(record, os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


def _rank_zero_says_now(trainer, pl_module):
    return trainer.global_rank == 0 and trainer.global_step >= 3  # rank 1 alone would never swap


def test_ddp_ranks_swap_together_and_stay_identical(tmp_path):
    # two gloo ranks on CPU; ddp_spawn re-imports this module in each (ddp_fork starts in ~1 s instead,
    # but forking a process whose OpenMP pool has run is not safe everywhere)
    qat = IntQAT(prepare_at=0, integer_at=_rank_zero_says_now, unit="step", quant_metrics_every_n_steps=2)
    trainer = _trainer(tmp_path, [qat, RankRecord(str(tmp_path))], strategy="ddp_spawn", devices=2, max_epochs=2,
                       limit_train_batches=3)  # fmt: skip
    trainer.fit(TinyClassifier())
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["kinds"] == r1["kinds"] == {0: "FakeQuantLinear", 1: "FakeQuantLinear", 2: "FakeQuantLinear",
                                          3: "IntLinear", 4: "IntLinear", 5: "IntLinear"}  # fmt: skip
    assert r0["boundaries"] == r1["boundaries"]
    for name, value in r0["state"].items():
        torch.testing.assert_close(value, r1["state"][name], atol=0, rtol=0, msg=name)
    assert r0["metrics"]["quant_val/net.0/sqnr_db"] == r1["metrics"]["quant_val/net.0/sqnr_db"]  # pooled over ranks


def test_a_run_that_ends_before_its_stages_says_so_and_exports_no_float_model(tmp_path):
    """A schedule the run never reaches is named when fit ends; the export at the end is skipped when no layer
    was ever quantized (it wrote a float model as export/model.pt2)."""
    exported = []
    model = TinyClassifier()
    qat = IntQAT(prepare_at=5, integer_at=8, export_on_fit_end=True, export_fn=lambda *a: exported.append(a))
    with pytest.warns(UserWarning) as record:
        _trainer(tmp_path, [qat], max_epochs=2, limit_train_batches=2).fit(model)
    text = " ".join(str(w.message) for w in record)
    assert "before these stages started: prepare (at 5), integer (at 8) (epochs)" in text
    assert "no export at the end of training: the model holds no quantized layer" in text and exported == []
    # fake quant reached, integer not: named, and the export runs (it converts fake quant to integer)
    qat = IntQAT(prepare_at=0, integer_at=8, export_on_fit_end=True, export_fn=lambda *a: exported.append(a))
    with pytest.warns(UserWarning, match=r"before these stages started: integer \(at 8\)"):
        _trainer(tmp_path, [qat], max_epochs=1, limit_train_batches=2).fit(TinyClassifier())
    assert len(exported) == 1
