"""Converters from other libraries' fake-quant modules to intqat's integer modules, registered in
intqat.registry (FOREIGN) by `register()`, which intqat.convert calls when it is imported:

    torchao   FakeQuantizedLinear (quantize_(m, QATConfig(..., step="prepare")))  -> IntLinear
    torch.ao  eager QAT (prepare_qat): qat.Linear -> IntLinear, qat.Conv2d -> IntConv2d, ConvBn2d ->
              IntConv2d with the BatchNorm folded; ReLU fusions -> Sequential(integer module, ReLU)

The integer module holds the very same weight / bias Parameters (and BatchNorm): an optimizer built
before the swap keeps its state. Neither library is imported here: a model holds their modules only
once they are loaded, so predicates look the classes up in sys.modules.

torch.ao fake-quantizes a layer's input in the module before it (its output FakeQuantize, called by
a forward hook) or in a QuantStub, which a converter, seeing one module, cannot find: run
`attach_torch_ao_input_qparams(model, example_inputs)` once before `to_integer`.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import namedtuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from intqat.config import QuantSpec
from intqat import registry
from intqat.nn import ActivationQuantizer, IntConv2d, IntLinear, WeightQuantizer
from intqat.ops.qparams import SCALE_EPS
from intqat.ops.quant import check_qrange

__all__ = ["attach_torch_ao_input_qparams", "from_torchao_linear", "from_torch_ao_qat", "TorchRangeWeightQuantizer", "register"]


def _loaded(module: str, *names: str) -> tuple[type, ...]:
    mod = sys.modules.get(module)
    return tuple(getattr(mod, n) for n in names if hasattr(mod, n)) if mod is not None else ()


def _bits(qmin: int, qmax: int) -> int:  # [-128, 127] and [-127, 127] -> 8, [0, 127] -> 7
    return max(2, (qmax - qmin).bit_length())


class TorchRangeWeightQuantizer(WeightQuantizer):
    """Symmetric weights on torch's signed grid, e.g. codes [-128, 127] with s = max|W| / 127.5: the rule
    of torch.ao's observers and torchao's choose_qparams_affine, s = amax / ((qmax - qmin) / 2).
    intqat's own narrow range [-127, 127], s = amax / 127, is the case qmin = -qmax."""

    def __init__(self, spec: QuantSpec, weight: Tensor, qmin: int, qmax: int):
        check_qrange(qmin, qmax)
        super().__init__(spec, weight)
        self.qmin, self.qmax = qmin, qmax
        if self.scale is not None:  # the LSQ init ran with spec's range
            self.scale.data.copy_(self.minmax_scale(weight))

    def minmax_scale(self, weight: Tensor) -> Tensor:
        w = weight.detach().reshape(weight.shape[0], -1)
        amax = w.abs().amax(dim=1) if self.per_channel else w.abs().amax().reshape(1)
        return torch.clamp(amax / ((self.qmax - self.qmin) / 2), min=SCALE_EPS)


def _weight_quantizer(weight: Tensor, qmin: int, qmax: int, per_channel: bool, scale: Tensor | None = None):
    """Symmetric codes in [qmin, qmax]; min-max scales at every step, or `scale` carried over as an LSQ
    parameter (a new Parameter: add it to the optimizer to learn it, else it keeps the carried value)."""
    if not (qmin < 0 < qmax and qmin in (-qmax, -qmax - 1)):
        raise ValueError(f"weight codes [{qmin}, {qmax}] are not a signed symmetric range: the integer modules need one")
    spec = QuantSpec(bits=_bits(qmin, qmax), symmetric=True, granularity="channel" if per_channel else "tensor",
                     learnable=scale is not None)
    same = (spec.qmin, spec.qmax) == (qmin, qmax)
    wq = WeightQuantizer(spec, weight) if same else TorchRangeWeightQuantizer(spec, weight, qmin, qmax)
    if scale is not None:
        wq.scale = nn.Parameter(scale.detach().reshape(-1).to(torch.float32).clone())
    return wq.to(weight.device)


def _static_activation_quantizer(scale, zero_point, qmin, qmax, symmetric, device, *, learnable=False,
                                 observed=None, averaging_constant=None) -> ActivationQuantizer:
    """A static per-tensor ActivationQuantizer holding these qparams as they are, observer off
    (intqat.freeze_observers(model, False) resumes observing from the carried range)."""
    shift = -128 if qmax > 127 else 0  # quint8 [0, 255] -> int8 storage: the same grid, the zero point moves along
    qmin, qmax = qmin + shift, qmax + shift
    check_qrange(qmin, qmax)
    ema = {"observer": "moving_average", "averaging_constant": averaging_constant}
    spec = QuantSpec(bits=_bits(qmin, qmax), symmetric=symmetric, granularity="tensor", learnable=learnable,
                     **(ema if averaging_constant else {"observer": "minmax"}))
    aq = ActivationQuantizer(spec)
    aq.qmin, aq.qmax = qmin, qmax  # the source's range, which may differ from spec's (torch.ao's reduce_range [0, 127])
    zp = torch.zeros(1) if zero_point is None else zero_point.detach().reshape(1).to(torch.float32)
    aq.set_qparams(scale.detach(), zp + shift, freeze=True)
    if observed is not None:
        with torch.no_grad():
            aq.min_val.copy_(observed[0].reshape(1))
            aq.max_val.copy_(observed[1].reshape(1))
    return aq.to(device)


# -- torchao ------------------------------------------------------------------------------------


def from_torchao_linear(m: nn.Module) -> IntLinear:
    """torchao FakeQuantizedLinear -> IntLinear sharing its weight and bias.

    weights  PerAxis(0) (or PerGroup(in_features)) symmetric intN -> per-channel codes on torchao's grid
             ([-128, 127], s = amax / 127.5): min-max at every step when dynamic, as torchao does;
             static scales (range_learning or not) are carried into an LSQ parameter.
    inputs   dynamic per token -> dynamic per-token symmetric (below); a static scale for the whole
             tensor -> static ActivationQuantizer with that scale and zero point (LSQ if range_learning).
    """
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS, ZeroPointDomain

    wfq, afq = m.weight_fake_quantizer, m.activation_fake_quantizer
    for role, fq in (("weights", wfq), ("activations", afq)):
        if fq is not None and not isinstance(fq, IntxFakeQuantizer):
            raise ValueError(f"{role} use {type(fq).__name__}, not integer fake quantization")
    if wfq is None:
        raise ValueError("its weights are not fake-quantized")
    wc = wfq.config
    if isinstance(wc.granularity, PerGroup) and wc.granularity.group_size != m.in_features:
        from intqat.nn.grouped_linear import from_torchao_grouped  # per-group weights: GroupedIntLinear

        return from_torchao_grouped(m)
    if not wc.is_symmetric:
        raise ValueError("asymmetric weights are not supported by the integer modules (the int32 epilogue corrects "
                         "only the activation zero point); prepare with is_symmetric=True")
    if not wc.is_dynamic and wfq.scale is None:
        raise ValueError("its static weight scales were never computed: run a forward first")
    wq = _weight_quantizer(m.weight, *_DTYPE_TO_QVALUE_BOUNDS[wc.dtype], per_channel=True,
                           scale=None if wc.is_dynamic else wfq.scale)

    # Weight-only QAT is refused rather than given dynamic activations: the integer matmul needs quantized
    # inputs, which this model never trained with; quantizing them here would silently change the model.
    if afq is None:
        raise ValueError(
            "weight-only QAT: the integer matmul needs quantized activations, which this model never trained with; "
            "prepare with an activation_config, e.g. IntxFakeQuantizeConfig(torch.int8, 'per_token', "
            "is_symmetric=False), or use intqat.prepare_qat(model, 'w8a8_dynamic')"
        )
    ac = afq.config
    qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[ac.dtype]
    if isinstance(ac.granularity, PerGroup):
        raise ValueError("per-group activations are not supported by the integer modules")
    if ac.is_dynamic:
        # PerToken, or PerAxis(0), which torchao applies to the rows of the 2-D input: per token as well.
        # torchao's per-token scheme is asymmetric; the closest integer kernel is intqat's dynamic per-token
        # *symmetric* one (z = 0: no per-row zero-point correction in the int32 epilogue). Same bits, but a
        # one-sided row (e.g. after ReLU) uses half the codes: about one bit coarser there.
        aq = ActivationQuantizer(QuantSpec(bits=_bits(qmin, qmax), symmetric=True, granularity="token", dynamic=True))
        return IntLinear(m.weight, m.bias, aq.to(m.weight.device), wq)
    if afq.scale is None:
        raise ValueError("its static activation scale was never computed: run initialize_fake_quantizers first")
    if afq.scale.numel() != 1:
        raise ValueError(f"its static per-token activation scales ({afq.scale.numel()}, one per row of the batch "
                         "they came from) have no per-tensor equivalent in the integer modules")
    if not ac.is_symmetric and ac.zero_point_domain != ZeroPointDomain.INT:
        raise ValueError(f"activation zero points in the {ac.zero_point_domain.name} domain: integer kernels need INT")
    aq = _static_activation_quantizer(afq.scale, afq.zero_point, qmin, qmax, ac.is_symmetric, m.weight.device,
                                      learnable=isinstance(afq.scale, nn.Parameter))
    return IntLinear(m.weight, m.bias, aq, wq)


# -- torch.ao eager QAT -------------------------------------------------------------------------


def _torch_ao_bases() -> tuple[type, ...]:
    """Every torch.ao QAT type with a weight fake quant; those not converted get named in the warning."""
    return _loaded("torch.ao.nn.qat", "Linear", "Conv1d", "Conv2d", "Conv3d") + _loaded(
        "torch.ao.nn.intrinsic.qat", "ConvBn1d", "ConvBn2d", "ConvBn3d", "LinearBn1d")


def _torch_ao_kind(m: nn.Module) -> tuple[bool, bool, bool] | None:
    """(conv, folds a BatchNorm, ends in ReLU) for the exact types converted, else None."""
    names = {"Linear": (False, False, False), "Conv2d": (True, False, False)}
    fused = {"LinearReLU": (False, False, True), "ConvReLU2d": (True, False, True),
             "ConvBn2d": (True, True, False), "ConvBnReLU2d": (True, True, True)}
    kinds = {c: names[c.__name__] for c in _loaded("torch.ao.nn.qat", *names)}
    kinds.update({c: fused[c.__name__] for c in _loaded("torch.ao.nn.intrinsic.qat", *fused)})
    return kinds.get(type(m))


# What attach_torch_ao_input_qparams found for a layer: a plain attribute, not a submodule (no second
# registration in state_dict or .to()); deepcopy maps the FakeQuantize along with the model.
_Link = namedtuple("_Link", ["input_fq", "keep_output_fq"])


def from_torch_ao_qat(m: nn.Module) -> nn.Module:
    """torch.ao QAT Linear / Conv2d / ConvBn2d (and ReLU fusions) -> IntLinear / IntConv2d.

    Weights: torch.ao's observed scale (its symmetric rule on a moving average of the weight's range)
    goes into an LSQ parameter on torch.ao's grid: the integer layer computes what the fake-quant one
    did. Input: the qparams of the FakeQuantize that produced it, observer off, and that FakeQuantize's
    observer off too: where it still fake-quantizes (a QuantStub) the integer layer requantizes on the
    same grid, which gives the same codes back.
    Hooks: the QAT module leaves the model with its `_observer_forward_hook` and output FakeQuantize,
    whose work the consumers' input quantizers now do: nothing is quantized twice. Where no integer
    layer consumes the output (the model's output, an add), that FakeQuantize is kept after the
    integer layer, where torch.ao's deployed model requantizes too.
    """
    kind = _torch_ao_kind(m)
    if kind is None:
        raise ValueError(f"{type(m).__name__} has no integer module (intqat converts Linear and Conv2d, with BN / ReLU)")
    conv, has_bn, relu = kind
    fq = m.weight_fake_quant
    if fq.qscheme not in (torch.per_channel_symmetric, torch.per_tensor_symmetric):
        raise ValueError(f"weights quantized {fq.qscheme}: the integer modules take symmetric weights")
    per_channel = fq.qscheme == torch.per_channel_symmetric
    if per_channel and fq.ch_axis != 0:
        raise ValueError(f"per-channel weight scales along axis {fq.ch_axis}: the integer modules take axis 0")
    link = m.__dict__.get("_intqat_torch_ao", _Link(None, False))
    if link.input_fq is None:
        raise ValueError(
            f"no input qparams for this {type(m).__name__}: torch.ao fake-quantizes a layer's input in the module "
            "before it (or a QuantStub); run intqat.interop.attach_torch_ao_input_qparams(model, example_inputs) "
            "before to_integer"
        )
    if per_channel and fq.scale.numel() != m.weight.shape[0]:
        raise ValueError("its weight FakeQuantize has observed no weight yet: train (or run a forward) first")
    wq = _weight_quantizer(m.weight, int(fq.quant_min), int(fq.quant_max), per_channel, fq.scale)
    aq = _input_quantizer(link.input_fq, m.weight.device)
    if conv:
        mod = IntConv2d(m, m.bn if has_bn else None, aq, wq)
        mod.freeze_bn_stats(True)  # integer convs fold BatchNorm with its running statistics
    else:
        mod = IntLinear(m.weight, m.bias, aq, wq)
    link.input_fq.disable_observer()
    tail = ([nn.ReLU()] if relu else []) + ([m.activation_post_process] if link.keep_output_fq else [])
    return nn.Sequential(mod, *tail) if tail else mod


def _input_quantizer(fq: nn.Module, device) -> ActivationQuantizer:
    dynamic = getattr(fq, "is_dynamic", False)
    if dynamic or fq.qscheme not in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        raise ValueError(f"its input is quantized {'dynamically' if dynamic else fq.qscheme}: static per-tensor only")
    obs = getattr(fq, "activation_post_process", None)
    lo, hi = getattr(obs, "min_val", None), getattr(obs, "max_val", None)
    observed = (lo, hi) if isinstance(lo, Tensor) and isinstance(hi, Tensor) and lo.numel() == 1 else None
    if observed is not None and not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise ValueError("the FakeQuantize of its input has observed no data yet: train (or calibrate) first")
    return _static_activation_quantizer(
        fq.scale, fq.zero_point, int(fq.quant_min), int(fq.quant_max), fq.qscheme == torch.per_tensor_symmetric,
        device, learnable=isinstance(fq.scale, nn.Parameter), observed=observed,
        averaging_constant=getattr(obs, "averaging_constant", None),
    )


# Ops after which a fake-quantized tensor is still on its producer's grid, or (average pooling) keeps the
# producer's qparams in torch.ao's quantized kernels: the consumer's input qparams are the producer's.
_SAME_QPARAMS = frozenset({
    "relu", "relu_", "relu6", "hardtanh", "dropout", "max_pool1d", "max_pool2d", "adaptive_max_pool2d",
    "avg_pool2d", "adaptive_avg_pool2d", "flatten", "view", "reshape", "permute", "transpose", "contiguous",
    "squeeze", "unsqueeze", "clone", "detach", "__getitem__",
})


class _DataFlow(TorchFunctionMode):
    """One forward's record of the FakeQuantize that produced each QAT layer's input (`inputs`), and of
    FakeQuantizes whose output reaches something else: another op, the model's output (`elsewhere`)."""

    def __init__(self):
        super().__init__()
        self.producers: dict[int, tuple[Tensor, nn.Module]] = {}  # id(tensor) -> (tensor kept alive, producer)
        self.inputs: dict[nn.Module, nn.Module] = {}
        self.elsewhere: set[nn.Module] = set()
        self.depth = 0  # > 0 inside a QAT layer, whose own ops are not consumers

    def source(self, t) -> nn.Module | None:
        hit = self.producers.get(id(t)) if isinstance(t, Tensor) else None
        return hit[1] if hit is not None and hit[0] is t else None

    def produced(self, fq, _args, out):  # forward hook of every FakeQuantize
        self.producers[id(out)] = (out, fq)

    def enter(self, layer, args):  # forward-pre-hook of every QAT layer
        if args and (src := self.source(args[0])) is not None:
            self.inputs.setdefault(layer, src)
        self.depth += 1

    def leave(self, *_):
        self.depth -= 1

    def consume(self, values) -> None:
        self.elsewhere.update(src for v in values if (src := self.source(v)) is not None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = self.source(args[0]) if args else None
        if src is not None and isinstance(out, Tensor) and getattr(func, "__name__", "") in _SAME_QPARAMS:
            self.producers[id(out)] = (out, src)
        elif self.depth == 0 and any(isinstance(o, Tensor) for o in tree_leaves(out)):  # not .size() and the like
            self.consume(tree_leaves((args, kwargs)))
        return out


@torch.no_grad()
def attach_torch_ao_input_qparams(model: nn.Module, example_inputs) -> dict[str, str]:
    """Link every torch.ao QAT layer to the FakeQuantize whose output it consumes; returns {layer: producer}.

    Runs model(*example_inputs) once in eval mode with observers paused (no range or BN statistic moves):
    forward hooks record the tensor each FakeQuantize returns, grid-preserving ops (ReLU, pooling,
    reshapes) pass it on, forward-pre-hooks match each layer's input against them. The link is to the
    module, so qparams are read when `to_integer` converts: call this any time after prepare_qat. Layers
    whose input has no producer are left out, and stay unconverted (named in to_integer's warning).
    """
    bases = _torch_ao_bases()
    layers = [mod for mod in model.modules() if bases and isinstance(mod, bases)]
    if not layers:
        return {}  # no torch.ao QAT layer: nothing to run (safe to call on any model)
    from torch.ao.quantization.fake_quantize import FakeQuantizeBase

    args = (example_inputs,) if isinstance(example_inputs, Tensor) else tuple(example_inputs)
    fqs = [mod for mod in model.modules() if isinstance(mod, FakeQuantizeBase)]
    flow = _DataFlow()
    handles = [fq.register_forward_hook(flow.produced) for fq in fqs]
    for layer in layers:
        handles += [layer.register_forward_pre_hook(flow.enter), layer.register_forward_hook(flow.leave)]
    observing, modes = [fq.observer_enabled.clone() for fq in fqs], [mod.training for mod in model.modules()]
    try:
        for fq in fqs:
            fq.disable_observer()
        model.eval()
        with flow:
            flow.consume(tree_leaves(model(*args)))
    finally:
        for h in handles:
            h.remove()
        for fq, flag in zip(fqs, observing):
            fq.observer_enabled.copy_(flag)
        for mod, training in zip(model.modules(), modes):
            mod.training = training
    consumed_by_layers = set(flow.inputs.values())
    for layer in layers:
        out_fq = getattr(layer, "activation_post_process", None)
        keep = out_fq is not None and (out_fq in flow.elsewhere or out_fq not in consumed_by_layers)
        layer._intqat_torch_ao = _Link(flow.inputs.get(layer), keep)
    names = {id(mod): name for name, mod in model.named_modules()}
    return {names[id(la)]: names.get(id(fq), type(fq).__name__) for la, fq in flow.inputs.items()}


def _is_torchao_fake_quant(m: nn.Module) -> bool:
    return isinstance(m, _loaded("torchao.quantization.qat.linear", "FakeQuantizedLinear"))


def _is_torch_ao_qat(m: nn.Module) -> bool:
    return isinstance(m, _torch_ao_bases())


def register() -> None:
    """Put torchao's and torch.ao's converters in intqat.registry.FOREIGN (once)."""
    known = {f.convert for f in registry.FOREIGN}
    if importlib.util.find_spec("torchao") is not None and from_torchao_linear not in known:
        registry.register_converter(_is_torchao_fake_quant, from_torchao_linear, "torchao FakeQuantizedLinear")
    if from_torch_ao_qat not in known:
        registry.register_converter(_is_torch_ao_qat, from_torch_ao_qat, "torch.ao eager QAT")
