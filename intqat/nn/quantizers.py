"""The state of one quantized tensor: scales, zero points, observers.

ActivationQuantizer  static (observed, optionally LSQ-learned) per-tensor qparams, or dynamic per token.
WeightQuantizer      per-channel / per-tensor symmetric weight scales: the weight's own min-max at
                     every step, or LSQ-learned.
Both are shared, unchanged, by the fake-quant and the integer modules: the swap hands them over.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

from intqat.config import QuantSpec
from intqat.nn.fake_quantize import fake_quantize_ste
from intqat.ops import backends, cpp_step
from intqat.ops.int_linear import minmax_weight_scale
from intqat.ops.qparams import SCALE_EPS, _f32, _scale_zero_point, row_absmax, scale_zero_point_scalar

__all__ = ["ActivationQuantizer", "WeightQuantizer", "NonFiniteInputError", "name_quantizers", "full_tensor"]


def full_tensor(t: Tensor) -> Tensor:
    """The whole of a sharded tensor (an FSDP2 / DTensor Parameter: all-gathered, a collective that every rank
    runs, as prepare_qat runs on every rank alike), t itself otherwise. For values a module computes once from
    its weight (a learned scale's min-max start)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class NonFiniteInputError(ValueError):
    """An integer layer was fed NaN / inf in training (see ActivationQuantizer.integer_input)."""


def name_quantizers(model: nn.Module) -> None:
    """Give each layer's input quantizers the layer's name in `model`, for the messages they raise
    ("net.0"; "net.1.self_attn (k_input_quantizer)" for an attention layer's per-input ones)."""
    for fqn, m in model.named_modules():
        for attr, q in m.named_children():
            if isinstance(q, ActivationQuantizer) and attr.endswith("input_quantizer"):
                q.layer_name = fqn if attr == "input_quantizer" else f"{fqn} ({attr})"


def _all_reduce_(t: Tensor, op) -> Tensor:
    """Keep observers identical on every rank under DDP (each rank sees other batches)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t


def keep_learned_scale_positive_(scale: Tensor) -> None:
    """An optimizer step can push a learned (LSQ) scale to <= 0, after which every code saturates or the
    reciprocal is inf, silently. As torch.ao's learnable fake quant does, put it back to SCALE_EPS before it
    is used in training: in place through .data (no autograd version bump for a graph still holding it, no
    device sync: a no-op unless the value was below). Traced programs use the value as it is."""
    if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        scale.data.clamp_(min=SCALE_EPS)


class ActivationQuantizer(nn.Module):
    """Quantization state of a layer's input activations.

    Static: `scale` (1,) and `zero_point` (1,) float, set by the observer while `observer_enabled`,
    learned by LSQ / LSQ+ when spec.learnable. Dynamic: nothing stored; scales come per token.
    """

    # (class defaults: a quantizer unpickled from an older intqat has neither attribute)
    layer_name: str | None = None  # the owning layer's name in the model, for messages (name_quantizers)
    _warned_non_finite = False

    def __init__(self, spec: QuantSpec):
        super().__init__()
        self.spec = spec
        self.qmin, self.qmax = spec.qmin, spec.qmax
        self.dynamic = spec.dynamic
        scale = torch.ones(1)
        zero_point = torch.zeros(1)
        if spec.learnable:
            self.scale = nn.Parameter(scale)
            # LSQ+: a learned zero point only makes sense for asymmetric ranges
            if spec.symmetric:
                self.register_buffer("zero_point", zero_point)
            else:
                self.zero_point = nn.Parameter(zero_point)
        else:
            self.register_buffer("scale", scale)
            self.register_buffer("zero_point", zero_point)
        self.register_buffer("min_val", torch.zeros(1))
        self.register_buffer("max_val", torch.zeros(1))
        # The flags live in buffers (so checkpoints carry them) and are mirrored as Python bools:
        # forward branches on the mirrors, which torch.compile can guard on without a graph break.
        # Change them through enable_observer / set_qparams / load_state_dict, not the buffers.
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.register_buffer("observer_enabled", torch.ones((), dtype=torch.bool))
        self._initialized, self._observer_enabled = False, True
        self.register_load_state_dict_post_hook(_sync_flags)

    # -- observing ---------------------------------------------------------------------------
    # A batch holding NaN / inf is ignored, warned once naming the layer, rather than raised: the
    # fake-quant output carries a NaN on to the loss as a float layer would (an inf saturates, as in
    # torch.fake_quantize_*), so IntQAT's non-finite check or an AMP GradScaler stops or skips that
    # step, while the scale, which every later step uses, keeps the range of the finite batches.
    # (Integer layers cannot carry a NaN in int8 codes: they raise, see `integer_input`.)
    @torch.no_grad()
    def observe(self, x: Tensor) -> None:
        """Update min/max from a batch and set scale / zero point from them; a batch holding NaN /
        inf leaves them as they were (warned once per layer)."""
        if self._observe(x) is False:
            self._warn_non_finite()

    def _observe(self, x: Tensor) -> bool | None:
        """`observe`, returning False when x held NaN / inf (ignored), True when x's min and max, so
        all of x, were finite, None when not known (nothing observed, percentile, traced)."""
        if self.dynamic or x.numel() == 0:
            return None
        with torch.no_grad():
            x = x.detach().to(torch.float32)
            done = self._observe_scalar(x)
            return done if done is not None else self._observe_tensor(x)

    def _observe_tensor(self, x: Tensor) -> bool | None:
        if self.spec.observer == "percentile":
            flat = x.reshape(-1)
            if flat.numel() > 1 << 20:  # torch.quantile's input limit; a strided sample is plenty
                flat = flat[:: flat.numel() // (1 << 20) + 1]
            p = self.spec.percentile / 100.0
            lo, hi = torch.quantile(flat, torch.tensor([1.0 - p, p], device=flat.device)).split(1)
        else:
            lo, hi = (v.reshape(1) for v in torch.aminmax(x))  # one pass over x, not two
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        # Under DDP a rank whose batch holds NaN / inf gives MIN / MAX their neutral element, so all
        # ranks still reduce to the same range (and none skips the collective).
        lo = _all_reduce_(torch.where(finite, lo, math.inf), dist.ReduceOp.MIN)
        hi = _all_reduce_(torch.where(finite, hi, -math.inf), dist.ReduceOp.MAX)
        traced = torch.compiler.is_compiling() or torch.compiler.is_exporting()
        if not traced:  # (host syncs: off the scalar CPU path, which returned above)
            local_ok, all_ok = torch.cat([finite, torch.isfinite(lo) & torch.isfinite(hi)]).tolist()
            if not all_ok:  # every rank's batch held NaN / inf
                return False
        else:
            # a traced program cannot branch on values: the current range is a fixed point of every
            # update below (min(m, m), m + c (m - m)), so a non-finite batch leaves it as it was
            lo = torch.where(torch.isfinite(lo), lo, self.min_val)
            hi = torch.where(torch.isfinite(hi), hi, self.max_val)
        if not self._initialized or self.spec.observer == "minmax":
            first = not self._initialized
            self.min_val.copy_(lo if first else torch.minimum(self.min_val, lo))
            self.max_val.copy_(hi if first else torch.maximum(self.max_val, hi))
        else:  # moving_average and percentile: exponential moving average of the range
            c = self.spec.averaging_constant
            self.min_val.add_(c * (lo - self.min_val))
            self.max_val.add_(c * (hi - self.max_val))
        self.initialized.fill_(True)
        self._initialized = True
        scale, zero_point = _scale_zero_point(self.min_val, self.max_val, self.qmin, self.qmax, self.spec.symmetric)
        self.scale.data.copy_(scale)
        self.zero_point.data.copy_(zero_point.to(torch.float32))
        if self.spec.learnable and self.__dict__.get("_is_fsdp_managed_module", False):
            # under FSDP2 (the tensor path runs whenever torch.distributed is up) a learned scale here is the
            # unsharded copy of a sharded Parameter, which the next all-gather replaces: set the shard too
            from intqat.distributed.shards import write_through

            write_through(self, [n for n in ("scale", "zero_point") if n in self._parameters])
        if traced or (local_ok and self.spec.observer == "percentile"):
            return None  # (a lone inf can fall outside the percentile: x was not seen whole)
        return bool(local_ok)

    def _observe_scalar(self, x: Tensor) -> bool | None:
        """`observe` for the common case (CPU, eager, one process, min-max or moving average) in
        Python floats: the same float32 steps as the tensor code, so the same bits, at a fraction of
        the cost (it runs at every training step: ~25 tiny tensor ops otherwise). Returns None,
        having changed nothing, when the tensor path must run; else what `_observe` returns."""
        if (self.spec.observer == "percentile" or type(x) is not Tensor or x.device.type != "cpu"
                or self.min_val.device.type != "cpu" or torch.compiler.is_compiling()
                or torch.compiler.is_exporting() or (dist.is_available() and dist.is_initialized())):
            return None
        lo, hi = backends.select("minmax", x).minmax(x)  # one pass (C on plain CPU tensors: ~40x aminmax here)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return False  # NaN / inf: ignored
        if not self._initialized:
            new_lo, new_hi = lo, hi
        elif self.spec.observer == "minmax":
            new_lo, new_hi = min(float(self.min_val), lo), max(float(self.max_val), hi)
        else:  # moving average: min_val += c * (lo - min_val), each step rounded to float32
            c = _f32(self.spec.averaging_constant)
            old_lo, old_hi = float(self.min_val), float(self.max_val)
            new_lo = _f32(old_lo + _f32(c * _f32(lo - old_lo)))
            new_hi = _f32(old_hi + _f32(c * _f32(hi - old_hi)))
        if not (math.isfinite(new_lo) and math.isfinite(new_hi)):
            return None  # a state that already holds NaN / inf (loaded): the tensor path as before
        scale, zero_point = scale_zero_point_scalar(new_lo, new_hi, self.qmin, self.qmax, self.spec.symmetric)
        self.min_val.fill_(new_lo)
        self.max_val.fill_(new_hi)
        self.scale.data.fill_(scale)
        self.zero_point.data.fill_(float(zero_point))
        if not self._initialized:
            self.initialized.fill_(True)
            self._initialized = True
        return True

    def _observe_in_cpp(self, x: Tensor) -> bool:
        """`integer_input`'s common training case in one C++ call (kernels/cpu/observe.cpp: the same bits as
        `_observe_scalar`, without its ~15 us of Python). True: a finite batch was observed. False: nothing
        changed, the general path runs (not this case, no C++ ops here, a batch holding NaN / inf, a kept
        range that is not finite)."""
        if not (self.observing and type(x) is Tensor and x.is_cpu and x.is_floating_point() and x.numel()
                and self.spec.observer != "percentile"):
            return False
        if (torch.compiler.is_compiling() or torch.compiler.is_exporting()
                or (dist.is_available() and dist.is_initialized())):
            return False  # (as _observe_scalar: traced programs and DDP take the tensor path)
        if backends.select("minmax", x).name != "cpu_fused" or not cpp_step.available():
            return False
        buffers, f32 = self._buffers, torch.float32
        lo, hi, scale, zero_point = buffers["min_val"], buffers["max_val"], self.scale, self.zero_point
        if not (lo.dtype is f32 and hi.dtype is f32 and scale.dtype is f32 and zero_point.dtype is f32 and lo.is_cpu):
            return False  # (after model.double(), or on a GPU)
        status = cpp_step.observe_minmax_(
            x, lo, hi, scale, zero_point, buffers["initialized"], not self._initialized,
            self.spec.observer != "minmax", self.spec.averaging_constant, self.qmin, self.qmax, self.spec.symmetric)
        if status != 1:
            return False
        if not self._initialized:  # (nn.Module.__setattr__ costs a few us: only on the first batch)
            self._initialized = True
        return True

    def _where(self) -> str:
        return f"layer {self.layer_name!r}" if self.layer_name else "a layer built outside prepare_qat (unnamed)"

    def _warn_non_finite(self) -> None:
        if not self._warned_non_finite:
            self._warned_non_finite = True
            warnings.warn(
                f"intqat: the activation observer of {self._where()} ignored a batch holding NaN / inf: its scale "
                "keeps the range of the finite batches (a NaN goes on to the output and the loss, an inf saturates). "
                "Warned once per layer",
                stacklevel=4,
            )

    def integer_input(self, x: Tensor) -> None:
        """What IntLinear / IntConv2d do with their input before the integer op: observe it (while
        observing), refuse NaN / inf in training, check that a static scale exists.

        Refused, not ignored: int8 codes cannot hold NaN / inf, so the layer would return finite
        numbers that no loss check can tell from good ones, and the optimizer would step on them.
        The check reuses the observer's aminmax when it ran; else one sum over x.
        """
        if self._observe_in_cpp(x):
            return  # observed a finite batch in one C++ call: nothing to refuse, and a scale exists
        finite = self._observe(x) if self.observing else None
        if self.training and x.numel() and not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            if finite is None:
                # a sum is NaN / inf iff an element is, or the finite ones overflow float32: the cheap
                # reduction (~16x faster than aminmax on this CPU), confirmed exactly when it trips
                finite = math.isfinite(float(x.detach().sum(dtype=torch.float32)))
                finite = finite or bool(torch.isfinite(x.detach()).all())
            if not finite:
                raise NonFiniteInputError(
                    f"intqat: the input of integer {self._where()} holds NaN / inf in training: int8 codes cannot "
                    "represent it, and the layer would return finite garbage. Find where it comes from (the batch, a "
                    "float layer before this one, the learning rate), or skip such batches before the model"
                )
        if not self.dynamic:
            self._check_ready()

    @torch.no_grad()
    def set_qparams(self, scale: Tensor | float, zero_point: Tensor | float, freeze: bool = True) -> None:
        """Take scale / zero point from elsewhere (another library's fake quantizer, a checkpoint)."""
        s = torch.as_tensor(scale, dtype=torch.float32).reshape(1)
        if not (s.numel() == 1 and bool(torch.isfinite(s).all()) and float(s) > 0):
            raise ValueError(f"set_qparams of {self._where()}: the scale must be one positive finite number, got "
                             f"{s.tolist()} (a scale <= 0 would make every code saturate or divide by zero)")
        self.scale.data.copy_(s)
        self.zero_point.data.copy_(torch.as_tensor(zero_point, dtype=torch.float32).reshape(1))
        self.initialized.fill_(True)
        self._initialized = True
        if freeze:
            self.enable_observer(False)

    def enable_observer(self, enabled: bool = True) -> None:
        self.observer_enabled.fill_(enabled)
        self._observer_enabled = bool(enabled)

    @property
    def observing(self) -> bool:
        # a learned (LSQ) scale is only initialised by the observer: observing later would undo learning.
        # Not inside a backward pass: gradient checkpointing runs the forward again there, and a second update
        # would quantize the recomputed activations on another grid than the forward that made the loss.
        return (self.training and not self.dynamic and self._observer_enabled
                and not (self.spec.learnable and self._initialized)
                and (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1))

    # -- use -----------------------------------------------------------------------------
    def dynamic_scale(self, x2d: Tensor) -> Tensor:
        """Per-token symmetric scales (M,) from rows of x2d (M, K), the integer op's formula."""
        return torch.clamp(row_absmax(x2d.detach(), dim=1) / self.qmax, min=SCALE_EPS)

    def fake_quant(self, x: Tensor, per_tensor_dynamic: bool = False) -> Tensor:
        """The fp32 simulation of what the integer op feeds its int_mm.

        Dynamic scales are per token (row of the last dim) for linear layers; convolutions pass
        per_tensor_dynamic=True, matching the integer conv's one scale per batch.
        """
        if self.dynamic and per_tensor_dynamic:
            s = torch.clamp(row_absmax(x.detach(), dim=None) / self.qmax, min=SCALE_EPS).reshape(1)
            return fake_quantize_ste(x, s, torch.zeros_like(s), self.qmin, self.qmax)
        if self.dynamic:
            x2d = x.reshape(-1, x.shape[-1])
            s = self.dynamic_scale(x2d)
            z = torch.zeros_like(s)
            return fake_quantize_ste(x2d, s, z, self.qmin, self.qmax, axis=0).reshape(x.shape)
        if self.observing:
            self.observe(x)
        self._check_ready()
        return fake_quantize_ste(x, self.scale, self.zero_point, self.qmin, self.qmax)

    def _check_ready(self) -> None:
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            return  # traced programs cannot branch on buffer values; eager runs checked already
        if self.spec.learnable and self.training:
            keep_learned_scale_positive_(self.scale)
        if not self._initialized and not self.spec.learnable:
            raise RuntimeError(
                f"the activation quantizer of {self._where()} has no scale yet: run training batches with the "
                "observer enabled (model.train()) or intqat.calibrate(model, batches) before evaluating"
            )

    def extra_repr(self) -> str:
        kind = "dynamic per-token" if self.dynamic else "static per-tensor"
        return f"{kind}, bits={self.spec.bits}, symmetric={self.spec.symmetric}, learnable={self.spec.learnable}"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward (bit for bit); gradient times a constant."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _sync_flags(module: ActivationQuantizer, _incompatible_keys) -> None:
    module._initialized = bool(module.initialized)
    module._observer_enabled = bool(module.observer_enabled)


class WeightQuantizer(nn.Module):
    """Symmetric weight scales, one per output channel (dim 0) or one for the tensor.

    Not learnable: the scale is the weight's own max|W| / qmax at every step (it never clips).
    Learnable: an LSQ parameter initialised from that min-max.
    """

    def __init__(self, spec: QuantSpec, weight: Tensor):
        super().__init__()
        self.spec = spec
        self.qmin, self.qmax = spec.qmin, spec.qmax
        if spec.granularity not in ("channel", "tensor"):
            raise ValueError(f"WeightQuantizer: granularity {spec.granularity!r} is not a weight granularity it "
                             "implements ('channel', 'tensor'); per-group weights: intqat.nn.grouped_linear")
        self.per_channel = spec.granularity == "channel"
        self.register_buffer("zero_point", torch.zeros(weight.shape[0] if self.per_channel else 1))
        if spec.learnable:
            self.scale = nn.Parameter(self.minmax_scale(full_tensor(weight.detach())))
        else:
            self.scale = None

    def minmax_scale(self, weight: Tensor) -> Tensor:
        if self.per_channel:  # the formula the integer op uses when it is given no scale
            return minmax_weight_scale(weight, self.qmax)
        return torch.clamp(row_absmax(weight.detach(), dim=None).reshape(-1) / self.qmax, min=SCALE_EPS)

    def channel_scale(self, weight: Tensor) -> Tensor:
        """The (N,) scale the integer op takes.

        A learned per-tensor scale is expanded to (N,): the ops apply LSQ's gradient scale per
        row (1/sqrt(K * qmax)), so the expand's backward rescales by 1/sqrt(N) to give the
        per-tensor factor 1/sqrt(N * K * qmax) without touching the forward value.
        """
        if self.scale is not None and self.training:
            keep_learned_scale_positive_(self.scale)
        s = self.scale if self.scale is not None else self.minmax_scale(weight)
        if s.numel() != 1:
            return s
        if s.requires_grad:
            s = _ScaleGrad.apply(s, 1.0 / math.sqrt(weight.shape[0]))
        return s.expand(weight.shape[0])

    def fake_quant(self, weight: Tensor) -> Tensor:
        s = self.channel_scale(weight)
        z = self.zero_point[:1]  # symmetric: one zero point (0) shared by every channel
        return fake_quantize_ste(weight, s, z, self.qmin, self.qmax, axis=0)

    def extra_repr(self) -> str:
        kind = "per-channel" if self.per_channel else "per-tensor"
        return f"{kind}, bits={self.spec.bits}, learnable={self.spec.learnable}"
