"""The models the golden test (tests/test_golden.py) pins down, and how one "run" of each is recorded.

A run: build the model (seeded), prepare_qat, calibrate, freeze, then record
  - the fake-quant stage: training forward output and every gradient of a fixed loss;
  - the integer stage (to_integer): training forward output, every gradient, the eval output;
  - the exported program (export_mixed_precision): its graph text, the graph text before autocast, a
    hash of every constant it stores, and its output on the input.
The cases cover every op intqat defines and every path the dispatcher picks between: per-channel
static / dynamic / 4-bit / LSQ linear layers, a wide MLP whose backward GEMMs take the digit path
(M*N*K >= 2^24), convs (plain, BN folded, depthwise, strided), attention, per-group (8da4w) layers
with int4 embeddings and a tied head (the recipes' GPT), and GPT-2's Conv1D.

Tensors are recorded whole when small; large ones (the wide MLP's gradients) as a SHA-256 of their
bytes plus a strided sample, so the golden files stay well under a megabyte.
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import intqat
from intqat.models import GPT, MLP, SmallCNN

WHOLE_NUMEL = 2048  # tensors up to this size are stored whole; larger ones as hash + sample
SAMPLE_NUMEL = 512


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    config: str | dict
    inputs: Callable[[torch.Generator], tuple[Tensor, ...]]
    loss: Callable[[Tensor], Tensor]
    bn: bool = False  # freeze BN statistics with the observers


def _images(shape):
    return lambda g: (torch.randn(*shape, generator=g),)


def _tokens(batch, seq, vocab=256):
    return lambda g: (torch.randint(0, vocab, (batch, seq), generator=g),)


def _mse(y: Tensor) -> Tensor:
    return (y.float() ** 2).mean()


class _DepthwiseNet(nn.Module):
    """dw 3x3 (stride 2) + BN + ReLU6, pw 1x1 + BN, head: the MobileNet pattern."""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, 2, 1, groups=8, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(8, 16, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu6(self.bn1(self.dw(x)))
        x = self.bn2(self.pw(x))
        return self.head(x.mean(dim=(2, 3)))


class _Encoder(nn.Module):
    """nn.TransformerEncoderLayer (nn.MultiheadAttention inside) + a Linear head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.layer(x))


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, idx):
            return self.model(input_ids=idx).logits

    return Logits()


CASES: tuple[Case, ...] = (
    Case("mlp_w8a8", lambda: MLP(64, (128, 128), 10), "w8a8", _images((32, 64)), _mse),
    Case("mlp_w8a8_dynamic", lambda: MLP(64, (128, 128), 10), "w8a8_dynamic", _images((32, 64)), _mse),
    Case("mlp_w4a8", lambda: MLP(64, (128, 128), 10), "w4a8", _images((32, 64)), _mse),
    Case("mlp_w8a8_lsq", lambda: MLP(64, (128, 128), 10), "w8a8_lsq", _images((32, 64)), _mse),
    # M*N*K = 2^28: the backward GEMMs take the int8 digit path where this CPU's rule says it pays
    Case("mlp_wide_w8a8", lambda: MLP(1024, (1024, 1024), 16), "w8a8", _images((256, 1024)), _mse),
    Case("cnn_w8a8", lambda: SmallCNN(1, 10, (16, 32)), "w8a8", _images((16, 1, 8, 8)), _mse, bn=True),
    Case("depthwise_w8a8", _DepthwiseNet, "w8a8", _images((8, 8, 12, 12)), _mse, bn=True),
    Case("encoder_w8a8", _Encoder, "w8a8", _images((4, 6, 32)), _mse),
    Case("gpt_w8a8_dynamic", lambda: GPT(256, 16, 64, 2, 2), {"preset": "w8a8_dynamic",
         "embedding": {"bits": 8, "granularity": "channel"}}, _tokens(4, 16), _mse),
    Case("gpt_8da4w", lambda: GPT(256, 16, 64, 2, 2), {"preset": "8da4w", "weight": {"group_size": 32},
         "embedding": {"bits": 4, "granularity": "group", "group_size": 32}}, _tokens(4, 16), _mse),
    Case("hf_gpt2_conv1d_w8a8", _hf_gpt2, "w8a8", _tokens(2, 8, 64), _mse),
)


def machine_signature() -> str:
    """What the bits of float kernels depend on besides intqat's code: torch's build and the CPU's
    instruction sets (MKL / oneDNN / ATen pick kernels by them), and INTQAT_EMULATE_NO_INT8_DOT (it changes the class
    the backend table sees: the backward's GEMMs differ, so such a run is another machine class). The test runs on
    one thread."""
    from intqat.ops.cpu_features import cpu_info, emulating_no_int8_dot

    model, flags = cpu_info()
    isa = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "asimd", "sve", "i8mm")))
    emulated = "; emulating no int8 dot products" if emulating_no_int8_dot() else ""
    return f"torch {torch.__version__}; {platform.machine()}; {model}; {' '.join(isa)}{emulated}"


def record_tensor(t: Tensor) -> dict:
    t = t.detach().contiguous().cpu()
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)  # (a 0-dim tensor cannot be viewed as bytes)
    rec = {"dtype": str(t.dtype), "shape": tuple(t.shape),
           "sha256": hashlib.sha256(raw.numpy().tobytes() if t.numel() else b"").hexdigest()}
    flat = t.reshape(-1)
    if t.numel() <= WHOLE_NUMEL:
        rec["data"] = t.clone()
    else:
        step = t.numel() // SAMPLE_NUMEL
        rec["sample_step"] = step
        rec["sample"] = flat[::step][:SAMPLE_NUMEL].clone()
    return rec


def _grads(model: nn.Module) -> dict[str, dict]:
    return {n: record_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _step(model: nn.Module, x: tuple[Tensor, ...], loss_fn) -> tuple[Tensor, dict]:
    model.zero_grad(set_to_none=True)
    y = model(*x)
    loss_fn(y).backward()
    return y, _grads(model)


def _program_record(program) -> dict:
    consts = {}
    for name, t in {**program.state_dict, **program.constants}.items():
        if isinstance(t, Tensor):
            consts[name] = record_tensor(t)["sha256"]
    return {"graph": str(program.graph), "signature": str(program.graph_signature), "constants": consts}


def run_case(case: Case) -> dict:
    """One run of `case` on one thread (float kernels' bits depend on the thread count)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = case.build()
    calib = [case.inputs(g) for _ in range(2)]
    x = case.inputs(g)
    intqat.prepare_qat(model, case.config)
    intqat.calibrate(model, calib)
    model.train()
    rec: dict = {}
    y, grads = _step(model, x, case.loss)
    rec["fake_quant"] = {"y": record_tensor(y), "grads": grads}
    intqat.freeze_observers(model)
    if case.bn:
        intqat.freeze_bn_stats(model)
    model = intqat.to_integer(model)
    model.train()
    y, grads = _step(model, x, case.loss)
    rec["integer"] = {"y": record_tensor(y), "grads": grads}
    model.eval()
    with torch.no_grad():
        rec["integer"]["y_eval"] = record_tensor(model(*x))
    from intqat.export import export_mixed_precision

    result = export_mixed_precision(model, x, calibration_data=[x])
    rec["program"] = _program_record(result.program)
    rec["reference_program"] = _program_record(result.reference)
    with torch.no_grad():
        rec["program"]["y"] = record_tensor(result.program.module()(*x))
    return rec
