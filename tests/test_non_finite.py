"""NaN / inf inputs: fake-quant layers ignore them in their observers (warned once, naming the layer)
and carry a NaN on to the output; integer layers in training refuse them, naming the layer, rather
than return finite garbage. Through the plain API and under Lightning."""

import copy

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import intqat
from intqat.callback import NonFiniteError
from intqat.nn import IntConv2d, IntLinear
from intqat.nn.quantizers import NonFiniteInputError

BAD = [float("nan"), float("inf"), -float("inf")]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _input(model, bad=None, seed=1):
    shape = (4, 16) if isinstance(model[0], (nn.Linear, IntLinear)) or model[0].__class__.__name__.endswith("Linear") \
        else (4, 2, 6, 6)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if bad is not None:
        x[1].view(-1)[7] = bad  # in sample 1
    return x


def _integer(build, config, frozen):
    model = intqat.prepare_qat(build(), config)
    model(_input(model))  # a first range
    if frozen:
        intqat.freeze_observers(model)
    return intqat.to_integer(model)


@pytest.mark.parametrize("frozen", [False, True], ids=["observing", "observers_frozen"])
@pytest.mark.parametrize("config", ["w8a8", "w8a8_dynamic"])
@pytest.mark.parametrize("build", [_mlp, _cnn], ids=["IntLinear", "IntConv2d"])
@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_integer_layers_refuse_non_finite_inputs_in_training(build, config, frozen, bad):
    model = _integer(build, config, frozen).train()
    assert isinstance(model[0], (IntLinear, IntConv2d))
    twin = copy.deepcopy(model)  # never sees the bad batch
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteInputError, match=r"input of integer layer '0' holds NaN / inf in training"):
        model(_input(model, bad))
    for k, v in model.state_dict().items():  # nothing moved: no scale, no range
        assert torch.equal(v, state[k]), k
    x = _input(model, seed=2)
    assert torch.equal(model(x), twin(x))  # and it goes on as if the batch had never come


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_integer_attention_refuses_non_finite_inputs_in_training(bad):
    """The integer MHA's projections are integer layers too: the same refusal, nothing moved."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True))
    x = torch.randn(2, 5, 16)
    intqat.to_integer(intqat.prepare_qat(model, "w8a8"), calibration_data=[x])
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x_bad = x.clone()
    x_bad[1, 2, 3] = bad
    with pytest.raises(NonFiniteInputError, match=r"integer layer '0.self_attn"):
        model(x_bad)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_the_message_names_a_nested_layer_and_eval_stays_quiet():
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 4)))
    intqat.to_integer(model, calibration_data=[torch.randn(8, 16)])
    x = _input(model)
    x[:, :] = 1e3
    hidden_nan = torch.full((4, 16), float("nan"))
    with pytest.raises(NonFiniteInputError, match=r"integer layer '1.1'"):
        model[1](hidden_nan)
    # eval: the deployed arithmetic, checked by no one on the hot inference path (as DeployedIntLinear)
    with torch.no_grad():
        model.eval()(_input(model, float("nan")))


def test_unnamed_layers_say_so():
    layer = IntLinear.from_fake_quant(intqat.nn.FakeQuantLinear.from_linear(nn.Linear(16, 4)))
    layer.input_quantizer.set_qparams(0.1, 0.0)
    with pytest.raises(NonFiniteInputError, match=r"a layer built outside prepare_qat \(unnamed\)"):
        layer.train()(torch.full((2, 16), float("inf")))


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_fake_quant_layers_keep_their_scale_and_carry_a_nan_on(bad):
    model = intqat.prepare_qat(_mlp(), "w8a8").train()
    model(_input(model))
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"observer of layer '0' ignored a batch holding NaN / inf"):
        y = model(_input(model, bad))
    if bad != bad:
        assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()  # only the row that held it
    else:
        assert torch.isfinite(y).all()  # an inf saturates at the range's end, as torch.fake_quantize does
    first, first_twin = model[0].input_quantizer, twin[0].input_quantizer
    for k, v in first.state_dict().items():
        assert torch.equal(v, first_twin.state_dict()[k]), k
    if bad != bad:  # (an inf saturated: the later layers saw finite values, and observed them)
        x = _input(model, seed=3)
        assert torch.equal(model(x), twin(x))


# -- under Lightning ------------------------------------------------------------------------------


class NanAtStep(LightningModule):
    def __init__(self, nan_batch: int):
        super().__init__()
        self.nan_batch = nan_batch
        self.net = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
        x[16 * self.nan_batch + 2, 5] = float("nan")
        return DataLoader(TensorDataset(x, torch.arange(64) % 3), batch_size=16)


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.parametrize("integer_at", [0, 1])
def test_a_nan_batch_under_lightning_stops_training_naming_what(tmp_path, integer_at):
    model = NanAtStep(nan_batch=2)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=2, enable_progress_bar=False, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[intqat.IntQAT(prepare_at=0, integer_at=integer_at)])
    if integer_at == 0:  # the integer layer refuses it, before any optimizer step on it
        with pytest.raises(NonFiniteInputError, match=r"input of integer layer 'net.0'"):
            trainer.fit(model)
        assert isinstance(model.net[0], IntLinear) and all(torch.isfinite(p).all() for p in model.parameters())
    else:  # fake quant: the observer ignores it, the NaN reaches the loss, IntQAT stops there
        with pytest.warns(UserWarning, match=r"observer of layer 'net.0' ignored"):
            with pytest.raises(NonFiniteError, match=r"the loss.* at epoch 0, batch 2"):
                trainer.fit(model)
        assert torch.isfinite(model.net[0].input_quantizer.scale).all()
    # the integer layer raised in the forward; the loss check runs after that batch's optimizer step
    assert trainer.global_step == (2 if integer_at == 0 else 3)


def test_huge_finite_inputs_are_not_taken_for_inf():
    """The cheap check is a float32 sum, which overflows on huge finite values: it is then confirmed
    element by element, and the layer goes on."""
    model = _integer(_mlp, "w8a8", frozen=True).train()
    x = torch.full((4, 16), 3e37)  # sums to inf in float32; every element finite
    assert not torch.isfinite(x.sum()) and torch.isfinite(x).all()
    model(x)
