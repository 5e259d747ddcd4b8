"""to_qdq: an intqat model -> its Q/DQ deploy form, the float program with quantize / dequantize ops around
each float GEMM that the runtimes' own quantizers emit and their partitioners / graph optimizers match.

.. code-block:: python

    qdq = intqat.deploy.to_qdq(model)          # the same call signature as model
    ep = torch.export.export(qdq, (x,))        # -> ExecuTorch (XNNPACK), ONNX Q/DQ

Each integer layer becomes (docs/numerics.md, "Deploy forms"):
    activations  static:  quantized_decomposed.quantize_per_tensor -> dequantize_per_tensor with the layer's
                          frozen scale / zero point (XNNPACKQuantizer's static form)
                 dynamic: torchao.choose_qparams_affine -> quantize_affine -> dequantize_affine, per token
                          (a linear: one scale per row of the last dim) or per tensor (a conv), symmetric on
                          [qmin, qmax] (torchao's 8da4w form with intqat's symmetric mapping)
    weights      per channel: quantized_decomposed.dequantize_per_channel(q_w, s_w, 0, axis 0)
                 per group:   torchao.dequantize_affine(q_w, [1, group_size], s_w, 0) (torchao's 8da4w form)
    then the float op (aten.linear / aten.conv2d / aten.embedding) in fp32, and the output in the input's dtype.
The codes q_x and q_w these ops make are the integer model's, bit for bit (same formula: round(x * fp32(1/s))
+ z, clamped); y differs from the integer model's only by float rounding: here x_hat @ w_hat, there an exact
int32 sum scaled once. A runtime may fuse the pattern into its own integer kernel with its own requantization.

Attention (DeployedIntMultiheadAttention) keeps its float attention; its projections become Q/DQ layers.
Layers named in `keep_float` become float layers with the dequantized weights w_hat and no activation
quantization (what a runtime that cannot take a layer's quantized form gets: see intqat.deploy.executorch).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["to_qdq", "qdq_layers", "QDQIntLinear", "QDQIntConv2d", "QDQGroupedIntLinear", "QDQIntEmbedding",
           "QDQ_TYPES", "FloatKeptLinear", "FloatKeptConv2d"]

SCALE_EPS = torch.finfo(torch.float32).eps  # intqat.ops.qparams.SCALE_EPS: the smallest dynamic scale


def _ops():
    """quantized_decomposed (torch's PT2E ops) and torchao's affine ops, registered on first use."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)

    try:
        import torchao.quantization.quant_primitives  # noqa: F401  (registers torch.ops.torchao)
    except ImportError as e:
        raise ImportError("intqat.deploy.to_qdq needs torchao (its affine quantize ops are the dynamic and per-group "
                          f"Q/DQ forms): pip install 'intqat[deploy]' ({e})") from None
    return torch.ops.quantized_decomposed, torch.ops.torchao


def _fp32(x: Tensor) -> Tensor:
    # (a no-op .to() would still leave a node in the exported graph, between the op and its quantize)
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _in_dtype(y: Tensor, x: Tensor) -> Tensor:
    """As the integer layers: the epilogue in fp32, the output in the input's float dtype."""
    return y if y.dtype == x.dtype or not x.is_floating_point() else y.to(x.dtype)


def _declared_range(qmin: int, qmax: int, pack4: bool = True) -> tuple[int, int]:
    """The weight range the dequantize op declares. intqat's symmetric codes lie in [-qmax, qmax]; 4-bit codes of
    linear layers are declared on the int4 grid [-8, 7] (they lie in [-7, 7] inside it), the range XNNPACK packs two
    to a byte (per channel: qc4w; per group: qb4w). Conv weights keep their own range (pack4=False): XNNPACK's qc4w
    conversion takes 2-D weights only ("convert_to_qc4w: expecting input tensor to be 2d"), so a 4-bit conv runs
    on its int8 kernel, one code per byte. 8-bit keeps [-127, 127], as XNNPACKQuantizer's weights."""
    return (-8, 7) if pack4 and (qmin, qmax) == (-7, 7) else (qmin, qmax)


class _ActivationQDQ(nn.Module):
    """The input's quantize -> dequantize. static: a Python float scale and int zero point (constants in the
    program, as PT2E's static form has them); dynamic: symmetric scales chosen from the data per token (per_token)
    or for the whole tensor."""

    def __init__(self, x_scale: Tensor, x_zero_point: Tensor, qmin: int, qmax: int, dynamic: bool, per_token: bool):
        super().__init__()
        self.qmin, self.qmax, self.dynamic, self.per_token = int(qmin), int(qmax), bool(dynamic), bool(per_token)
        self.scale = float(x_scale.reshape(-1)[0])  # fp32 value, held as a Python float (exact)
        self.zero_point = 0 if dynamic else int(x_zero_point.reshape(-1)[0])

    def _block(self, x: Tensor) -> list[int]:
        return [1] * (x.dim() - 1) + [x.shape[-1]] if self.per_token else list(x.shape)

    def codes(self, x: Tensor) -> tuple[Tensor, Tensor | float, Tensor | int]:
        """(q_x int8, scale, zero point): the codes the integer layer computes from x (fp32)."""
        qd, ao = _ops()
        if not self.dynamic:
            q = qd.quantize_per_tensor.default(x, self.scale, self.zero_point, self.qmin, self.qmax, torch.int8)
            return q, self.scale, self.zero_point
        block = self._block(x)
        s, z = ao.choose_qparams_affine(x, "SYMMETRIC", block, torch.int8, self.qmin, self.qmax, SCALE_EPS,
                                        torch.float32, torch.int32)
        return ao.quantize_affine(x, block, s, z, torch.int8, self.qmin, self.qmax), s, z

    def forward(self, x: Tensor) -> Tensor:
        qd, ao = _ops()
        q, s, z = self.codes(x)
        if not self.dynamic:
            return qd.dequantize_per_tensor.default(q, s, z, self.qmin, self.qmax, torch.int8)
        return ao.dequantize_affine(q, self._block(x), s, z, torch.int8, self.qmin, self.qmax)

    def extra_repr(self) -> str:
        if self.dynamic:
            return f"dynamic {'per-token' if self.per_token else 'per-tensor'} symmetric [{self.qmin}, {self.qmax}]"
        return f"static scale={self.scale:.6g}, zero_point={self.zero_point}, [{self.qmin}, {self.qmax}]"


def _out_qdq(y: Tensor, out: tuple | None) -> Tensor:
    """A chained producer (intqat.chain_int8): requantize y on its consumer's grid, as the deployed layer does."""
    if out is None:
        return y
    qd, _ = _ops()
    s, z, qmin, qmax, relu = out
    y = qd.dequantize_per_tensor.default(qd.quantize_per_tensor.default(y, s, z, qmin, qmax, torch.int8),
                                         s, z, qmin, qmax, torch.int8)
    return torch.relu(y) if relu else y  # relu((q - z) s) = (max(q, z) - z) s: the codes the consumer sees


class _PerChannelWeight(nn.Module):
    """int8 codes (O, ...) with one scale per output channel: dequantize_per_channel, axis 0."""

    def _init_weight(self, q_w: Tensor, w_scale: Tensor, qmin: int, qmax: int) -> None:
        self.register_buffer("w_stored", None)  # fp32 w_hat in place of the codes (dequantize_weight_at_export)
        self.register_buffer("q_w", q_w.contiguous())
        self.register_buffer("w_scale", w_scale.to(torch.float32).reshape(-1).contiguous())
        self.register_buffer("w_zero_point", torch.zeros(q_w.shape[0], dtype=torch.int64))
        self.w_qmin, self.w_qmax = _declared_range(qmin, qmax, pack4=q_w.dim() == 2)

    def w_hat(self) -> Tensor:
        if self.w_stored is not None:
            return self.w_stored
        qd, _ = _ops()
        return qd.dequantize_per_channel.default(self.q_w, self.w_scale, self.w_zero_point, 0, self.w_qmin,
                                                 self.w_qmax, torch.int8)

    @torch.no_grad()
    def dequantize_weight_at_export(self) -> None:
        """Store w_hat = q_w * s_w (fp32, the same values) instead of the codes: the activation keeps its Q/DQ, the
        GEMM becomes a float one (for a runtime whose integer GEMM could not give this layer's float output)."""
        w = self.w_hat().clone()
        del self.q_w, self.w_scale, self.w_zero_point
        self.w_stored = w


class QDQIntLinear(_PerChannelWeight):
    """DeployedIntLinear (nn.Linear, HF Conv1D, attention projections) as Q/DQ around aten.linear."""

    def __init__(self, src, w_qmin: int, w_qmax: int):
        super().__init__()
        self.in_features, self.out_features, self.transposed = src.in_features, src.out_features, src.transposed
        self.input_qdq = _ActivationQDQ(src.x_scale, src.x_zero_point, src.x_qmin, src.x_qmax, src.x_dynamic, True)
        self._init_weight(src.q_w, src.w_scale, w_qmin, w_qmax)
        self.register_buffer("bias", None if src.bias is None else src.bias.detach().to(torch.float32).clone())
        self.out_qparams = None
        if src.out_codes:  # a chained producer: the consumer's grid, and the ReLU chain_int8 folded into it
            self.out_qparams = (float(src.out_scale), int(src.out_zero_point), src.out_qmin, src.out_qmax, src.out_relu)

    @property
    def weight(self) -> Tensor:
        """w_hat in the layout of the layer it came from, for model code that reads `.weight` (its dtype)."""
        w = self.w_hat()
        return w.t() if self.transposed else w

    def forward(self, input: Tensor) -> Tensor:
        y = F.linear(self.input_qdq(_fp32(input)), self.w_hat(), self.bias)
        return _in_dtype(_out_qdq(y, self.out_qparams), input)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight per channel"


class QDQIntConv2d(_PerChannelWeight):
    """DeployedIntConv2d (BN folded; grouped and depthwise too) as Q/DQ around aten.conv2d. Zero padding of x_hat
    is the integer conv's padding with the zero point's code."""

    def __init__(self, src, w_qmin: int, w_qmax: int):
        super().__init__()
        self.stride, self.padding, self.dilation, self.groups = src.stride, src.padding, src.dilation, src.groups
        self.input_qdq = _ActivationQDQ(src.x_scale, src.x_zero_point, src.x_qmin, src.x_qmax, src.x_dynamic, False)
        self._init_weight(src.q_w, src.w_scale, w_qmin, w_qmax)
        self.register_buffer("bias", None if src.bias is None else src.bias.detach().to(torch.float32).clone())

    @property
    def weight(self) -> Tensor:
        return self.w_hat()

    def forward(self, input: Tensor) -> Tensor:
        x_hat = self.input_qdq(_fp32(input))
        y = F.conv2d(x_hat, self.w_hat(), self.bias, self.stride, self.padding, self.dilation, self.groups)
        return _in_dtype(y, input)

    def extra_repr(self) -> str:
        o, cg, kh, kw = self.w_hat().shape
        return f"{cg * self.groups}, {o}, kernel_size=({kh}, {kw}), stride={self.stride}, groups={self.groups}"


class _PerGroupWeight(nn.Module):
    """int8 codes (N, K) with one scale per (row, group of group_size): torchao.dequantize_affine, block [1, g]."""

    def _init_weight(self, q_w: Tensor, w_scale: Tensor, qmin: int, qmax: int) -> None:
        self.group_size = q_w.shape[1] // w_scale.shape[1]
        # (tied lm_head and embedding share these tensors, as the deployed modules do)
        self.register_buffer("q_w", q_w)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("w_zero_point", torch.zeros(w_scale.shape, dtype=torch.int32))
        self.w_qmin, self.w_qmax = _declared_range(qmin, qmax)

    def w_hat(self) -> Tensor:
        _, ao = _ops()
        return ao.dequantize_affine(self.q_w, [1, self.group_size], self.w_scale, self.w_zero_point, torch.int8,
                                    self.w_qmin, self.w_qmax)


class QDQGroupedIntLinear(_PerGroupWeight):
    """DeployedGroupedIntLinear (8da4w and other per-group weights) as Q/DQ around aten.linear."""

    def __init__(self, src, w_qmin: int, w_qmax: int):
        super().__init__()
        self.in_features, self.out_features = src.in_features, src.out_features
        self.input_qdq = _ActivationQDQ(src.x_scale, src.x_zero_point, src.x_qmin, src.x_qmax, src.x_dynamic, True)
        self._init_weight(src.q_w, src.w_scale, w_qmin, w_qmax)
        self.register_buffer("bias", None if src.bias is None else src.bias.detach().to(torch.float32).clone())

    @property
    def weight(self) -> Tensor:
        return self.w_hat()

    def forward(self, input: Tensor) -> Tensor:
        y = F.linear(self.input_qdq(_fp32(input)), self.w_hat(), self.bias)
        return _in_dtype(y, input)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class QDQIntEmbedding(_PerGroupWeight):
    """DeployedIntEmbedding: aten.embedding of the dequantized table (torchao's quantized-embedding form, which
    ExecuTorch fuses into quantized_decomposed.embedding_byte / embedding_4bit). Exact: w_hat = float(q) * s is the
    one rounding of intqat's dequantizing gather, and a gather moves values unchanged."""

    def __init__(self, src, w_qmin: int, w_qmax: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = src.num_embeddings, src.embedding_dim
        self._init_weight(src.q_w, src.w_scale, w_qmin, w_qmax)
        if (self.w_qmin, self.w_qmax) == (-127, 127):
            self.w_qmin = -128  # the int8 range ExecuTorch's embedding_byte fusion matches; the codes lie inside it

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.w_hat())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}"


QDQ_TYPES = (QDQIntLinear, QDQIntConv2d, QDQGroupedIntLinear, QDQIntEmbedding)


class FloatKeptLinear(nn.Linear):
    """A layer kept float for a runtime that cannot take its quantized form: w_hat as an fp32 weight, float input."""


class FloatKeptConv2d(nn.Conv2d):
    """A conv kept float for a runtime that cannot take its quantized form: w_hat as an fp32 weight, float input."""


@torch.no_grad()
def _kept_float(layer: nn.Module) -> nn.Module:
    w = layer.w_hat()
    if isinstance(layer, QDQIntConv2d):
        o, cg, kh, kw = w.shape
        m = FloatKeptConv2d(cg * layer.groups, o, (kh, kw), layer.stride, layer.padding, layer.dilation, layer.groups,
                            bias=layer.bias is not None, device="meta")
    elif isinstance(layer, QDQIntEmbedding):
        return nn.Embedding.from_pretrained(w, freeze=True)
    else:
        m = FloatKeptLinear(w.shape[1], w.shape[0], bias=layer.bias is not None, device="meta")
    m.weight = nn.Parameter(w.clone(), requires_grad=False)
    if layer.bias is not None:
        m.bias = nn.Parameter(layer.bias.clone(), requires_grad=False)
    return m


def _integer_copy(model: nn.Module) -> nn.Module:
    """A deployed copy: fake-quant modules to integer (their scales carry over), integer ones deployed."""
    from intqat.convert import to_deployed, to_integer
    from intqat.nn import FakeQuantMultiheadAttention
    from intqat.registry import FAKE_QUANT_TYPES

    work = copy.deepcopy(model)
    if any(isinstance(m, FAKE_QUANT_TYPES + (FakeQuantMultiheadAttention,)) for m in work.modules()):
        to_integer(work)
    return to_deployed(work, inplace=True)


def _qdq_of(child: nn.Module) -> nn.Module | None:
    from intqat.nn import DeployedGroupedIntLinear, DeployedIntConv2d, DeployedIntEmbedding, DeployedIntLinear

    # the deployed modules do not keep the weight quantizer's range: the codes' own symmetric range is
    # recovered from their bit width (int4 codes in [-7, 7], int8 in [-127, 127], and so on)
    def weight_range(q_w: Tensor) -> tuple[int, int]:
        amax = int(q_w.abs().max()) if q_w.numel() else 1
        bits = max(2, amax.bit_length() + 1)
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1

    kinds = ((DeployedIntLinear, QDQIntLinear), (DeployedIntConv2d, QDQIntConv2d),
             (DeployedGroupedIntLinear, QDQGroupedIntLinear), (DeployedIntEmbedding, QDQIntEmbedding))
    for deployed, qdq in kinds:
        if isinstance(child, deployed):
            return qdq(child, *weight_range(child.q_w))
    return None


def _swap(parent: nn.Module, prefix: str, keep_float: set[str], done: set[str]) -> None:
    for name, child in list(parent._modules.items()):
        if child is None:
            continue
        fqn = f"{prefix}.{name}" if prefix else name
        qdq = _qdq_of(child)
        if qdq is None:
            _swap(child, fqn, keep_float, done)
            continue
        parent._modules[name] = _kept_float(qdq) if fqn in keep_float else qdq
        done.add(fqn)


def to_qdq(model: nn.Module, *, keep_float=(), fp32_weights=()) -> nn.Module:
    """The Q/DQ deploy form of `model` (never modified): a float nn.Module with the same call signature, in eval
    mode, whose integer layers are quantize -> dequantize -> float op (module docstring). Fake-quant layers are
    converted to integer first (their scales carry over), integer ones deployed. keep_float: names of layers (as
    in model.named_modules()) to keep float instead, with their dequantized weights. fp32_weights: names of
    per-channel layers whose weight is stored dequantized (w_hat, fp32) while the input keeps its Q/DQ."""
    _ops()
    keep, fp32w = set(keep_float), set(fp32_weights)
    work = _integer_copy(model)
    done: set[str] = set()
    _swap(work, "", keep, done)
    for name, layer in qdq_layers(work).items():
        if name in fp32w:
            if not isinstance(layer, (QDQIntLinear, QDQIntConv2d)):
                raise ValueError(f"to_qdq: fp32_weights names {name}, a {type(layer).__name__}: only per-channel "
                                 "linear and conv layers store w_hat")
            layer.dequantize_weight_at_export()
    unknown = sorted((keep | fp32w) - done)
    if unknown:
        layers = sorted(qdq_layers(work)) or ["(none)"]
        raise ValueError(f"to_qdq: keep_float / fp32_weights name {unknown}, which are not integer layers of the model; its "
                         f"integer layers: {', '.join(layers)}")
    return work.eval()


def qdq_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> Q/DQ layer, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QDQ_TYPES)}
