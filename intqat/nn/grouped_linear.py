"""Linear layers with per-group weight scales ("8da4w"-style), holding the nn.Linear's own Parameters:

GroupWeightQuantizer       symmetric codes, one scale per (output row, group of `group_size` inputs):
                           the weight's own min-max at every step, or LSQ-learned (n = group_size).
FakeQuantGroupedLinear     fp32 simulation: F.linear(fq(x), fq_group(W), b).
GroupedIntLinear           the integer layer: `int_linear_grouped` in training, the same functions in eval.
DeployedGroupedIntLinear   frozen for export: int8 codes (int4 values) and (N, G) scales as buffers.

The formulas are in intqat/ops/int_linear_grouped.py: the group sums are exact int32, combined in
fp32 in increasing group order, so training forward, eval and the exported program are the same bits.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intqat.config import QuantConfig, QuantSpec, resolve_config
from intqat.nn import eager_step
from intqat.nn.fake_quantize import fake_quantize_ste
from intqat.nn.linear import _QuantLinearBase, in_input_dtype, is_hf_conv1d, weight_regathered
from intqat.nn.quantizers import ActivationQuantizer, full_tensor, keep_learned_scale_positive_
from intqat.ops.int_linear import quantize_activation, rounded_zero_point
from intqat.ops.int_linear_grouped import (
    check_group_size,
    grouped_integer_linear,
    int_linear_grouped,
    minmax_group_scale,
    quantize_weight_grouped,
)

__all__ = ["GroupWeightQuantizer", "FakeQuantGroupedLinear", "GroupedIntLinear", "DeployedGroupedIntLinear",
           "frozen_group_codes"]


class GroupWeightQuantizer(nn.Module):
    """Symmetric weight codes in [qmin, qmax] with one scale per (row, group) of a 2-D (N, K) weight.

    Min-max scale s = max|W[n, group]| / scale_div (intqat's narrow grid: scale_div = qmax, e.g. int4
    [-7, 7], s = amax / 7; torch's grid [-8, 7] uses scale_div = 7.5). `spec.learnable`: an LSQ
    parameter (N, G) initialised from that min-max.
    """

    def __init__(self, spec: QuantSpec, weight: Tensor, qmin: int | None = None, qmax: int | None = None,
                 scale_div: float | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"GroupWeightQuantizer: weight must be 2-D (N, K), got {tuple(weight.shape)}")
        self.spec = spec
        self.group_size = spec.group_size if spec.granularity == "group" else weight.shape[1]
        check_group_size(weight.shape[1], self.group_size, "GroupWeightQuantizer")
        self.qmin = spec.qmin if qmin is None else qmin
        self.qmax = spec.qmax if qmax is None else qmax
        self.scale_div = float(self.qmax if scale_div is None else scale_div)
        self.scale = nn.Parameter(self.minmax_scale(full_tensor(weight))) if spec.learnable else None
        # in the state_dict: checkpoints show this layer is quantized (intqat.callback) and its group size
        self.register_buffer("group_size_", torch.tensor(self.group_size), persistent=True)

    @property
    def narrow(self) -> bool:
        """True when the min-max scale is amax / qmax on [-qmax, qmax]: the op computes it itself."""
        return self.qmin == -self.qmax and self.scale_div == self.qmax

    def minmax_scale(self, weight: Tensor) -> Tensor:
        return minmax_group_scale(weight, self.group_size, self.scale_div)

    def group_scale(self, weight: Tensor) -> Tensor:
        """The (N, G) scale: learned (kept >= SCALE_EPS in training), or the weight's min-max."""
        if self.scale is not None and self.training:
            keep_learned_scale_positive_(self.scale)
        return self.scale if self.scale is not None else self.minmax_scale(weight)

    def channel_scale(self, weight: Tensor) -> Tensor:
        """Every scale, flattened (N * G,): what the callback's finiteness check reads of any weight quantizer."""
        return self.group_scale(weight).reshape(-1)

    def fake_quant(self, weight: Tensor) -> Tensor:
        """fq(W) with STE (and LSQ, n = group_size) gradients: each (row, group) is a row of the
        (N * G, group_size) view, quantized with torch's formula (the op's codes, bit for bit)."""
        N, K = weight.shape
        s = self.group_scale(weight).reshape(-1)
        w = weight.reshape(-1, self.group_size)
        return fake_quantize_ste(w, s, torch.zeros(1, device=weight.device), self.qmin, self.qmax, axis=0).reshape(N, K)

    def codes(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        """(q_w (N, K) int8, s_w (N, G) fp32), detached: for inference and export."""
        s = None if (self.scale is None and self.narrow) else self.group_scale(weight).detach()
        q_w, _, s_w = quantize_weight_grouped(weight, s, self.group_size, self.qmin, self.qmax)
        return q_w, s_w

    def extra_repr(self) -> str:
        return (f"per-group ({self.group_size}), codes [{self.qmin}, {self.qmax}], scale_div={self.scale_div:g}, "
                f"learnable={self.spec.learnable}")


# Codes of one weight under one quantizer setting, shared by every module deployed from it in one
# to_deployed pass: a lm_head tied to an embedding stores its codes once (the same buffer object).
# id(weight) -> (weakref to the weight, key, codes); an entry dies with its weight.
_FROZEN: dict[int, tuple] = {}


@torch.no_grad()
def frozen_group_codes(weight: Tensor, wq: GroupWeightQuantizer, transposed: bool = False) -> tuple[Tensor, Tensor]:
    """wq.codes(weight) (of weight.t() for a Conv1D's (in, out) weight), memoised on the weight object and its
    version: equal settings -> same tensors."""
    key = (weight._version, transposed, wq.group_size, wq.qmin, wq.qmax, wq.scale_div,
           None if wq.scale is None else (id(wq.scale), wq.scale._version))
    hit = _FROZEN.get(id(weight))
    if hit is None or hit[0]() is not weight or hit[1] != key:  # new weight, or an older version of it
        q_w, s_w = wq.codes(weight.t() if transposed else weight)
        ref = weakref.ref(weight, lambda _, i=id(weight): _FROZEN.pop(i, None))
        hit = _FROZEN[id(weight)] = (ref, key, (q_w.contiguous(), s_w.to(torch.float32).contiguous().clone()))
    return hit[2]


def _check_activation(spec: QuantSpec) -> None:
    if spec.granularity not in ("token", "tensor"):
        raise ValueError(f"per-group linear layers take per-token dynamic or per-tensor static activations, got {spec}")


class FakeQuantGroupedLinear(_QuantLinearBase):
    """y = F.linear(fq(x), fq_group(W), b): the fake-quant stage of a per-group layer."""

    grad_gemm = "fp32"  # the per-group backward GEMMs run in fp32

    @classmethod
    def from_linear(cls, linear: nn.Module, config: QuantConfig | str | dict = "8da4w",
                    transposed: bool | None = None) -> "FakeQuantGroupedLinear":
        """From an nn.Linear, or a transformers Conv1D (GPT-2's projections: weight (in, out), kept as it is and
        grouped along its input dim, as an nn.Linear's). transposed: whether `linear` is laid out as a Conv1D
        (default: is it exactly one)."""
        config = resolve_config(config)
        _check_activation(config.activation)
        dev = linear.weight.device
        if transposed is None:  # (the registry says so for a Conv1D under a wrapper, e.g. FSDP2's FSDPConv1D)
            transposed = is_hf_conv1d(linear)
        w_nk = linear.weight.t() if transposed else linear.weight
        return cls(linear.weight, linear.bias, ActivationQuantizer(config.activation).to(dev),
                   GroupWeightQuantizer(config.weight, w_nk).to(dev), transposed=transposed)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(self.input_quantizer.fake_quant(input), self.weight_quantizer.fake_quant(self.w_nk()), self.bias)

    def extra_repr(self) -> str:
        t = ", weight (in, out) as Conv1D" if self.transposed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{t}"


class GroupedIntLinear(_QuantLinearBase):
    """The integer per-group layer. Training: the differentiable `intqat::int_linear_grouped` op.
    Eval / export: the same functions in aten ops (portable), so both give the same bits."""

    grad_gemm = "fp32"
    extra_repr = FakeQuantGroupedLinear.extra_repr

    @classmethod
    def from_fake_quant(cls, fq: FakeQuantGroupedLinear) -> "GroupedIntLinear":
        return cls(fq.weight, fq.bias, fq.input_quantizer, fq.weight_quantizer, transposed=fq.transposed)

    def _op_args(self) -> dict:
        aq, wq = self.input_quantizer, self.weight_quantizer
        return dict(group_size=wq.group_size, x_qmin=aq.qmin, x_qmax=aq.qmax, w_qmin=wq.qmin, w_qmax=wq.qmax,
                    x_dynamic=aq.dynamic, w_clip_mask=wq.scale is not None)

    def forward(self, input: Tensor) -> Tensor:
        x = input
        w, weight, bias, aq, wq = self._parts()  # (nn.Module's dicts: _QuantLinearBase._parts says why)
        if aq.observing:
            aq.observe(x)
        if not aq.dynamic:
            aq._check_ready()
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad) and not torch.compiler.is_exporting():
            if wq.scale is None and wq.narrow:  # the C++ step, decided once per input shape (eager_step.py)
                y = eager_step.grouped_step(self, "grouped", x, w, bias, aq, wq.group_size, wq.qmin, wq.qmax)
                if y is not None:
                    return y  # (float32 in, float32 out)
            w_scale = None if (wq.scale is None and wq.narrow) else wq.group_scale(w)
            return in_input_dtype(int_linear_grouped(x, w, self.bias, aq.scale, aq.zero_point, w_scale,
                                                     **self._op_args()), x)
        q_w, s_w = self._weight_codes()
        z_x = None if aq.dynamic else rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
        return in_input_dtype(_apply(x, q_w, s_w, self.bias, aq.scale, z_x, aq.qmin, aq.qmax, aq.dynamic), x)

    def _weight_codes(self) -> tuple[Tensor, Tensor]:
        """(q_w, s_w) for inference, cached until the weight or its scale changes (version counters); recomputed
        in traced programs and under FSDP2 (`weight_regathered`)."""
        if torch.compiler.is_compiling() or torch.compiler.is_exporting() or weight_regathered(self):
            return self.weight_quantizer.codes(self.w_nk())
        s = self.weight_quantizer.scale
        key = (id(self.weight), self.weight._version, None if s is None else (id(s), s._version))
        cache = self.__dict__.get("_codes_cache")
        if cache is None or cache[0] != key:
            cache = self.__dict__["_codes_cache"] = (key, self.weight_quantizer.codes(self.w_nk()))
        return cache[1]

    @torch.no_grad()
    def to_deployed(self) -> "DeployedGroupedIntLinear":
        aq = self.input_quantizer
        if not aq.dynamic:
            aq._check_ready()
        q_w, s_w = frozen_group_codes(self.weight, self.weight_quantizer, transposed=self.transposed)
        z_x = torch.zeros(1, dtype=torch.int32) if aq.dynamic else rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
        return DeployedGroupedIntLinear(q_w, s_w, None if self.bias is None else self.bias.detach().clone(),
                                        aq.scale.detach().clone(), z_x.to(q_w.device), aq.qmin, aq.qmax, aq.dynamic)


def _apply(x, q_w, s_w, bias, x_scale, z_x, x_qmin, x_qmax, x_dynamic) -> Tensor:
    """x (..., K) -> y (..., N): quantize the input, then the per-group integer product (shared by
    GroupedIntLinear's eval path and DeployedGroupedIntLinear)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).to(torch.float32)
    q_x, _, s_x = quantize_activation(x2d, x_scale, z_x, x_qmin, x_qmax, x_dynamic, need_mask=False)
    y = grouped_integer_linear(q_x, q_w, s_w, None if x_dynamic else z_x, s_x, None if bias is None else bias.detach())
    return y.reshape(*lead, q_w.shape[0])


class DeployedGroupedIntLinear(nn.Module):
    """Inference-only per-group integer linear: what torch.export packages (aten ops only)."""

    def __init__(self, q_w: Tensor, w_scale: Tensor, bias: Tensor | None, x_scale: Tensor, x_zero_point: Tensor,
                 x_qmin: int, x_qmax: int, x_dynamic: bool):
        super().__init__()
        self.out_features, self.in_features = q_w.shape
        self.group_size = q_w.shape[1] // w_scale.shape[1]
        self.register_buffer("q_w", q_w)  # (N, K) int8 (4-bit values in int8 storage)
        self.register_buffer("w_scale", w_scale)  # (N, G) fp32
        self.register_buffer("bias", bias)
        self.register_buffer("x_scale", x_scale.to(torch.float32).reshape(1))
        self.register_buffer("x_zero_point", x_zero_point.to(torch.int32).reshape(1))
        self.x_qmin, self.x_qmax, self.x_dynamic = x_qmin, x_qmax, x_dynamic

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K) float32, each group times its scale, for model code that reads a layer's
        `.weight` (its dtype, its shape). The layer computes with the int4 / int8 codes."""
        N, K = self.q_w.shape
        w = self.q_w.to(torch.float32).reshape(N, -1, self.group_size) * self.w_scale.unsqueeze(-1)
        return w.reshape(N, K)

    def forward(self, input: Tensor) -> Tensor:
        return in_input_dtype(_apply(input, self.q_w, self.w_scale, self.bias, self.x_scale, self.x_zero_point,
                                     self.x_qmin, self.x_qmax, self.x_dynamic), input)

    def extra_repr(self) -> str:
        kind = "dynamic per-token" if self.x_dynamic else "static"
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"activations={kind}")


def from_torchao_grouped(m: nn.Module) -> GroupedIntLinear:
    """torchao FakeQuantizedLinear with per-group weights (QATConfig with IntxFakeQuantizeConfig(torch.int4,
    group_size=g)) -> GroupedIntLinear sharing its weight and bias, keeping the group size.

    weights  symmetric PerGroup(g) intN on torchao's grid (int4: codes [-8, 7], s = amax / 7.5): the same codes,
             min-max at every step when dynamic (torchao's default); static scales become an LSQ parameter.
    inputs   dynamic per token -> intqat's dynamic per-token symmetric int8 (torchao's per-token scheme is
             asymmetric: the closest integer kernel without a per-row zero-point correction; see interop.py).
    """
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    wfq, afq = m.weight_fake_quantizer, m.activation_fake_quantizer
    wc = wfq.config
    if not wc.is_symmetric:
        raise ValueError("asymmetric per-group weights are not supported by the integer modules; "
                         "prepare with IntxFakeQuantizeConfig(..., is_symmetric=True)")
    if afq is None or not afq.config.is_dynamic:
        raise ValueError("per-group weights convert with dynamic per-token activations only (8da4w); prepare with "
                         "activation_config=IntxFakeQuantizeConfig(torch.int8, 'per_token', is_symmetric=False)")
    qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[wc.dtype]
    a_lo, a_hi = _DTYPE_TO_QVALUE_BOUNDS[afq.config.dtype]
    group_size = wc.granularity.group_size
    learn = not wc.is_dynamic
    if learn and wfq.scale is None:
        raise ValueError("its static weight scales were never computed: run a forward first")
    spec = QuantSpec(bits=max(2, (qmax - qmin).bit_length()), granularity="group", group_size=group_size,
                     learnable=learn)
    wq = GroupWeightQuantizer(spec, m.weight, qmin=qmin, qmax=qmax, scale_div=(qmax - qmin) / 2)
    if learn:
        with torch.no_grad():
            wq.scale.copy_(wfq.scale.detach().reshape(wq.scale.shape))
    a_bits = max(2, (a_hi - a_lo).bit_length())
    aq = ActivationQuantizer(QuantSpec(bits=a_bits, symmetric=True, granularity="token", dynamic=True))
    dev = m.weight.device
    return GroupedIntLinear(m.weight, m.bias, aq.to(dev), wq.to(dev))
