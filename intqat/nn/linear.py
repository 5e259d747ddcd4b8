"""Quantized linear layers, all holding the very same `weight` / `bias` Parameters as the nn.Linear
they replace (an optimizer built before a swap keeps its state):

FakeQuantLinear    fp32 simulation: F.linear(fq(x), fq(W)) with STE / LSQ gradients.
IntLinear          the integer layer: int8 codes, int32 int_mm, float epilogue, in training and eval.
DeployedIntLinear  frozen for export: int8 weight codes stored as buffers, no fp32 weight.

`transformers`' Conv1D (GPT-2 family) is a linear layer whose weight is stored (in, out): the quantized
layers keep that very Parameter (and its state_dict key) and read it as the (out, in) view `weight.t()`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intqat.config import QuantConfig, resolve_config
from intqat.nn import eager_step
from intqat.nn.quantizers import ActivationQuantizer, WeightQuantizer
from intqat.ops.int_linear import (
    int_linear,
    integer_linear,
    quantize_activation,
    quantize_weight,
    rounded_zero_point,
    weight_colsum,
)
from intqat.ops.quant import quantize
from intqat.nn.fake_quantize import fake_quantize_ste

__all__ = ["FakeQuantLinear", "IntLinear", "DeployedIntLinear", "is_hf_conv1d", "in_input_dtype"]


def is_hf_conv1d(m: nn.Module) -> bool:
    """Is m exactly `transformers.pytorch_utils.Conv1D` (y = x @ W + b, W stored (in, out))?
    Looked up in sys.modules: a model can hold one only once transformers is loaded."""
    mod = sys.modules.get("transformers.pytorch_utils")
    return mod is not None and type(m) is getattr(mod, "Conv1D", None)


def weight_regathered(m: nn.Module) -> bool:
    """Does FSDP2 manage m's weight? fully_shard marks the modules it manages (and intqat their successors,
    intqat.distributed.fsdp). It writes every all-gather into the same unsharded Parameter without bumping
    its version counter, so a cache keyed on (id, version) would hand back the codes of an older weight."""
    return m.__dict__.get("_is_fsdp_managed_module", False)


def in_input_dtype(y: Tensor, x: Tensor) -> Tensor:
    """The integer layers compute their epilogue in float32 (the deployed arithmetic) and return y in the input's
    float dtype, as nn.Linear / nn.Conv2d do: a bf16 model stays bf16 after them (a LayerNorm that follows refuses
    mixed dtypes). float32 input: y as it is; int8 codes in (a chained consumer): float32 out."""
    return y if y.dtype == x.dtype or not x.is_floating_point() else y.to(x.dtype)


_PARTS = ("weight", "bias", "input_quantizer", "weight_quantizer")
_PLAIN_TYPES: dict[type, bool] = {}  # class -> none of _PARTS is a class attribute (_QuantLinearBase._parts)


class _QuantLinearBase(nn.Module):
    grad_gemm = "int8x3"  # QuantConfig.grad_gemm: how IntLinear's backward GEMMs run (set per instance)
    transposed = False  # class default: modules pickled before Conv1D support read as nn.Linear layout

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, input_quantizer, weight_quantizer,
                 transposed: bool = False):
        super().__init__()
        # transposed: weight stored (in, out) as transformers' Conv1D keeps it; read through w_nk()
        self.transposed = transposed
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape
        self.weight = weight
        self.bias = bias
        self.input_quantizer = input_quantizer
        self.weight_quantizer = weight_quantizer

    def extra_repr(self) -> str:
        grad = "" if self.grad_gemm == "int8x3" else f", grad_gemm={self.grad_gemm}"
        t = ", weight (in, out) as Conv1D" if self.transposed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{grad}{t}"

    def _parts(self) -> tuple:
        """(weight as (N, K), the weight as stored, bias, input_quantizer, weight_quantizer), read from nn.Module's
        own dicts on the training hot path: each `self.weight`-style read goes through nn.Module.__getattr__ after a
        failed attribute lookup, ~0.5 us (Zen 4, torch 2.13), five a call on a layer whose whole C++ step is ~15 us
        at 8 x 128 -> 10. A class that defines one of these names itself (torch.nn.utils.parametrize's property), or
        a module holding one elsewhere (a plain tensor attribute, a buffer), reads them the usual way."""
        cls = type(self)
        plain = _PLAIN_TYPES.get(cls)
        if plain is None:
            plain = _PLAIN_TYPES[cls] = not any(hasattr(cls, n) for n in _PARTS)
        d = self.__dict__
        try:
            if not plain:
                raise KeyError
            p, m = d["_parameters"], d["_modules"]
            w, b, aq, wq = p["weight"], p["bias"], m["input_quantizer"], m["weight_quantizer"]
        except KeyError:
            w, b, aq, wq = self.weight, self.bias, self.input_quantizer, self.weight_quantizer
        return (w.t() if self.transposed else w), w, b, aq, wq

    def w_nk(self) -> Tensor:
        """The weight as (out, in) = (N, K): the Parameter itself, or a view of a Conv1D's (in, out) one."""
        return self.weight.t() if self.transposed else self.weight

    def to_linear(self) -> nn.Module:
        """Back to a float nn.Linear (or the Conv1D it came from) sharing the same Parameters."""
        if self.transposed:
            from transformers.pytorch_utils import Conv1D

            lin = Conv1D(self.out_features, self.in_features)
        else:
            lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin


class FakeQuantLinear(_QuantLinearBase):
    """y = F.linear(fq(x), fq(W), b): the fake-quant stage that warms up scales."""

    @classmethod
    def from_linear(cls, linear: nn.Module, config: QuantConfig | str | dict = "w8a8",
                    transposed: bool | None = None) -> "FakeQuantLinear":
        """From an nn.Linear, or a transformers Conv1D (weight (in, out), kept as it is).
        transposed: whether `linear` is laid out as a Conv1D (default: is it exactly one)."""
        config = resolve_config(config)
        if transposed is None:  # (the registry says so for a Conv1D under a wrapper, e.g. FSDP2's FSDPConv1D)
            transposed = is_hf_conv1d(linear)
        w_nk = linear.weight.t() if transposed else linear.weight
        fq = cls(
            linear.weight,
            linear.bias,
            ActivationQuantizer(config.activation).to(linear.weight.device),
            WeightQuantizer(config.weight, w_nk).to(linear.weight.device),
            transposed=transposed,
        )
        if config.grad_gemm != fq.grad_gemm:
            fq.grad_gemm = config.grad_gemm  # carried to the IntLinear that replaces it
        return fq

    def forward(self, input: Tensor) -> Tensor:  # `input`, like nn.Linear / nn.Conv2d: layer(input=x) works
        x = input
        return F.linear(self.input_quantizer.fake_quant(x), self.weight_quantizer.fake_quant(self.w_nk()), self.bias)


# Without autograd (a validation pass) a layer with at most this many weights runs the training op too: the op
# quantizes W again at every call (one pass over N x K), where the plain-aten path below reads codes cached across
# calls but pays ~40 us of Python and dispatch per call (Zen 4, 1 thread, 2026-12-07: 8 x 128 -> 10 57 -> 17 us; the
# two tie near 2^17-2^18 weights, e.g. 32 x 256 -> 768 102 against 108 us; at 1024 x 1024 the pass costs ~150 us).
# 2^16 keeps the op's side of the trade on CPUs whose memory passes are several times slower against their Python.
FUSED_NO_GRAD_MAX_WEIGHTS = 1 << 16


class IntLinear(_QuantLinearBase):
    """The integer layer. Training: the differentiable `intqat::int_linear` op. Eval: the same
    functions composed of aten ops (portable through torch.export), so both give the same bits.

    int8 -> int8 chains (`intqat.chain_int8`): a producer holds its consumer's input quantizer as
    `output_quantizer` and emits dequantize(requantize(y)) (optionally ReLU'd: max(q, z) on the
    codes); the consumer's quantize recovers exactly those codes. Deployed, the producer returns the
    int8 codes and the consumer takes them as they are: no float round trip, the same numbers.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.output_quantizer: ActivationQuantizer | None = None  # set by chain_int8 (shared module)
        self.output_relu = False
        self.input_chained = False  # the input comes from a chained producer (deploys as codes)

    @classmethod
    def from_fake_quant(cls, fq: FakeQuantLinear) -> "IntLinear":
        mod = cls(fq.weight, fq.bias, fq.input_quantizer, fq.weight_quantizer, transposed=fq.transposed)
        if fq.grad_gemm != mod.grad_gemm:
            mod.grad_gemm = fq.grad_gemm
        return mod

    def _op_args(self):
        aq, wq = self.input_quantizer, self.weight_quantizer
        # a min-max weight scale (not learned) never clips: no weight mask to keep for backward
        return dict(x_qmin=aq.qmin, x_qmax=aq.qmax, w_qmin=wq.qmin, w_qmax=wq.qmax, x_dynamic=aq.dynamic,
                    w_clip_mask=wq.scale is not None, grad_gemm=self.grad_gemm)

    def forward(self, input: Tensor) -> Tensor:  # `input`, like nn.Linear / nn.Conv2d: layer(input=x) works
        x = input
        w_nk, weight, bias, aq, wq = self._parts()
        # the differentiable op whenever autograd needs it (eval-mode training too); both paths
        # run the same functions, so they give the same bits
        op = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad) and not torch.compiler.is_exporting()
        if wq.scale is None and wq.per_channel and (op or weight.numel() <= FUSED_NO_GRAD_MAX_WEIGHTS):
            # the observer and the C++ step in one op call (eager_step.fused_linear), or None: the path below
            y = eager_step.fused_linear(self, "linear", x, w_nk, bias, aq, wq.qmin, wq.qmax, self.grad_gemm)
            if y is not None:
                return y if self.output_quantizer is None else self._requantize(y)  # (float32 in, float32 out)
        aq.integer_input(x)  # observes (while observing), refuses NaN / inf in training, checks the scale
        if op:
            # min-max per-channel scales: the op computes them in the pass that makes the codes
            w = self.w_nk()
            try:
                if wq.scale is None and wq.per_channel:  # the C++ step decided once per input shape (eager_step.py)
                    y = eager_step.linear_step(self, "linear", x, w, self.bias, aq, wq.qmin, wq.qmax, self.grad_gemm)
                    if y is not None:
                        return self._requantize(y)  # (float32 in, float32 out: in_input_dtype has nothing to do)
                w_scale = None if (wq.scale is None and wq.per_channel) else wq.channel_scale(w)
                y = int_linear(x, w, self.bias, aq.scale, aq.zero_point, w_scale, **self._op_args())
            except ValueError as e:  # (a shape / dtype the op refuses: say which layer)
                raise ValueError(f"intqat: integer {aq._where()}: {e}") from None
        else:
            y = self._integer_forward(x)
        return in_input_dtype(self._requantize(y), x)

    def _requantize(self, y: Tensor) -> Tensor:
        """Chained producer: y -> dequantize(quantize(y)) on the consumer's grid, STE gradient."""
        oq = self.output_quantizer
        if oq is None:
            return y
        y = fake_quantize_ste(y, oq.scale, oq.zero_point, oq.qmin, oq.qmax)
        return torch.relu(y) if self.output_relu else y  # relu((q - z) s) = (max(q, z) - z) s exactly

    def _integer_forward(self, x: Tensor) -> Tensor:
        """The deploy arithmetic in plain aten ops: exactly what the op's forward runs."""
        aq = self.input_quantizer
        q_w, w_colsum, w_scale = self._weight_codes()
        z_x = None if aq.dynamic else rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
        return _apply(x, q_w, w_colsum, w_scale, self.bias, aq.scale, z_x, aq.qmin, aq.qmax, aq.dynamic)

    def _weight_codes(self) -> tuple[Tensor, Tensor | None, Tensor]:
        """(q_w, colsum or None, w_scale) for inference; cached until the weight or its scale changes.

        Inference calls would otherwise re-quantize the fp32 weight every time. The key holds the
        tensors' version counters, which every in-place update (optimizer step, load_state_dict)
        bumps. Traced programs (export, compile) always recompute: the codes are part of the program;
        so does a layer under FSDP2 (`weight_regathered`), whose weight is all-gathered anew each call.
        """
        aq, wq = self.input_quantizer, self.weight_quantizer
        tracing = torch.compiler.is_compiling() or torch.compiler.is_exporting()
        key = None
        if not tracing and not weight_regathered(self):
            s = wq.scale
            key = (id(self.weight), self.weight._version, None if s is None else (id(s), s._version), aq.dynamic)
            cache = self.__dict__.get("_codes_cache")
            if cache is not None and cache[0] == key:
                return cache[1]
        w_scale = wq.channel_scale(self.w_nk()).detach()
        q_w, _, w_colsum, _ = quantize_weight(self.w_nk(), w_scale, wq.qmin, wq.qmax, need_colsum=not aq.dynamic)
        codes = (q_w, w_colsum, w_scale)
        if key is not None:
            self.__dict__["_codes_cache"] = (key, codes)
        return codes

    @torch.no_grad()
    def to_deployed(self) -> "DeployedIntLinear":
        """Freeze: int8 weight codes as buffers (1 byte per weight instead of 4)."""
        aq, wq = self.input_quantizer, self.weight_quantizer
        if not aq.dynamic:
            aq._check_ready()
        w_scale = wq.channel_scale(self.w_nk()).detach().contiguous().clone()
        q_w, _, _, _ = quantize_weight(self.w_nk(), w_scale, wq.qmin, wq.qmax)
        z_x = torch.zeros(1, dtype=torch.int32) if aq.dynamic else rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
        oq = self.output_quantizer
        return DeployedIntLinear(
            q_w=q_w,
            w_scale=w_scale,
            bias=None if self.bias is None else self.bias.detach().clone(),
            x_scale=aq.scale.detach().clone(),
            x_zero_point=z_x.to(q_w.device),
            x_qmin=aq.qmin,
            x_qmax=aq.qmax,
            x_dynamic=aq.dynamic,
            input_codes=self.input_chained,
            transposed=self.transposed,
            out_qparams=None if oq is None else (
                oq.scale.detach().clone(), rounded_zero_point(oq.zero_point, oq.qmin, oq.qmax), oq.qmin, oq.qmax, self.output_relu
            ),
        )


def _apply(x, q_w, w_colsum, w_scale, bias, x_scale, z_x, x_qmin, x_qmax, x_dynamic, input_codes=False) -> Tensor:
    """x (..., K) -> y (..., N) through int8 codes; shared by IntLinear (eval) and DeployedIntLinear.
    input_codes: x already holds the int8 codes (a chained producer made them)."""
    lead = x.shape[:-1]
    if input_codes:
        q_x, s_x = x.reshape(-1, x.shape[-1]), x_scale.detach().reshape(1, 1).to(torch.float32)
    else:
        x2d = x.reshape(-1, x.shape[-1]).to(torch.float32)
        q_x, _, s_x = quantize_activation(x2d, x_scale, z_x, x_qmin, x_qmax, x_dynamic, need_mask=False)
    if x_dynamic:
        z_x = w_colsum = None  # symmetric per-token codes: no zero-point correction
    y = integer_linear(q_x, q_w, z_x, w_colsum, s_x, w_scale, None if bias is None else bias.detach())
    return y.reshape(*lead, q_w.shape[0])


class DeployedIntLinear(nn.Module):
    """Inference-only integer linear layer with int8 weights: what `torch.export` packages."""

    def __init__(self, q_w, w_scale, bias, x_scale, x_zero_point, x_qmin, x_qmax, x_dynamic,
                 input_codes: bool = False, out_qparams: tuple | None = None, transposed: bool = False):
        super().__init__()
        self.transposed = transposed  # deployed from a Conv1D: `weight` reads (in, out), as the Conv1D's did
        self.input_codes = input_codes  # takes int8 codes from a chained producer
        self.out_codes = out_qparams is not None  # returns int8 codes for a chained consumer
        if out_qparams is not None:
            out_scale, out_zero_point, self.out_qmin, self.out_qmax, self.out_relu = out_qparams
            self.register_buffer("out_scale", out_scale.to(torch.float32).reshape(1))
            self.register_buffer("out_zero_point", out_zero_point.to(torch.int32).reshape(1))
        self.out_features, self.in_features = q_w.shape
        self.register_buffer("q_w", q_w)  # (N, K) int8
        self.register_buffer("w_colsum", weight_colsum(q_w))  # (N,) int32
        self.register_buffer("w_scale", w_scale.to(torch.float32).contiguous())  # (N,)
        self.register_buffer("bias", bias)
        self.register_buffer("x_scale", x_scale.to(torch.float32).reshape(1))
        self.register_buffer("x_zero_point", x_zero_point.to(torch.int32).reshape(1))
        self.x_qmin, self.x_qmax, self.x_dynamic = x_qmin, x_qmax, x_dynamic

    @property
    def weight(self) -> Tensor:
        """The dequantized weight q_w * s_w, float32, in the layout of the layer it came from: for model code
        that reads a layer's `.weight` (Hugging Face's T5 and ViT read its dtype to cast their inputs). The
        layer itself computes with the int8 codes, never with this."""
        w = self.q_w.to(torch.float32) * self.w_scale.reshape(-1, 1)
        return w.t() if self.transposed else w

    def forward(self, input: Tensor) -> Tensor:  # `input`, like nn.Linear / nn.Conv2d: layer(input=x) works
        if self.input_codes and input.dtype != torch.int8:
            raise ValueError(f"this chained layer takes int8 codes from its producer, got {input.dtype}")
        y = _apply(
            input, self.q_w, self.w_colsum, self.w_scale, self.bias, self.x_scale, self.x_zero_point,
            self.x_qmin, self.x_qmax, self.x_dynamic, self.input_codes,
        )
        if not self.out_codes:
            return in_input_dtype(y, input)
        # requantize for the consumer: int8 codes out, no float round trip between the layers
        q = quantize(y, self.out_scale.reshape(()), self.out_zero_point.reshape(()), self.out_qmin, self.out_qmax)
        return torch.maximum(q, self.out_zero_point.to(torch.int8)) if self.out_relu else q

    def extra_repr(self) -> str:
        kind = "dynamic per-token" if self.x_dynamic else "static"
        return f"in_features={self.in_features}, out_features={self.out_features}, activations={kind}"
