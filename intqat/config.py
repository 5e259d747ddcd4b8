"""QuantConfig: what to quantize and how, checked when built.

    from intqat import QuantConfig, QuantSpec
    cfg = QuantConfig(weight=QuantSpec(bits=4, granularity="channel"),
                      activation=QuantSpec(bits=8, symmetric=False, observer="moving_average"))
    cfg = QuantConfig.from_preset("w8a8")      # or just pass "w8a8" wherever a config is taken
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

from intqat.ops.digit_gemm import check_grad_gemm
from intqat.ops.qparams import qrange

__all__ = ["QuantSpec", "QuantConfig", "PRESETS", "resolve_config"]

Observer = Literal["minmax", "moving_average", "percentile"]


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor (weights or activations) is quantized.

    The defaults (symmetric, per tensor, static) are a neutral starting point, not a recommendation: the presets
    (`QuantConfig.from_preset`, e.g. w8a8's per-channel weights and asymmetric activations) are what the recipes
    train with; override a preset's fields ({"preset": "w8a8", "weight": {"bits": 4}}) rather than start here.
    """

    bits: int = 8  # 2..8; codes are stored in int8 whatever the width
    symmetric: bool = True  # symmetric: zero point 0, narrow range [-(2^(b-1)-1), 2^(b-1)-1]
    granularity: Literal["tensor", "channel", "token", "group"] = "tensor"
    group_size: int | None = None  # only with granularity="group"
    dynamic: bool = False  # scales from each batch at run time (activations, per token)
    learnable: bool = False  # LSQ scales (and LSQ+ zero points for asymmetric activations)
    observer: Observer = "moving_average"  # initialises static scales while observing
    averaging_constant: float = 0.01  # moving_average: torch.ao's QAT default
    percentile: float = 99.99  # percentile: clip range = this percentile of |x| (or of x's tails)

    def __post_init__(self):
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"QuantSpec(bits={self.bits!r}): bits must be an int in 2..8, e.g. QuantSpec(bits=8)")
        if self.granularity not in ("tensor", "channel", "token", "group"):
            raise ValueError(
                f"QuantSpec(granularity={self.granularity!r}): use 'tensor', 'channel', 'token' or 'group'"
            )
        if self.granularity == "group":
            if not isinstance(self.group_size, int) or self.group_size <= 0:
                raise ValueError(
                    f"QuantSpec(granularity='group', group_size={self.group_size!r}): give a positive "
                    "group_size, e.g. QuantSpec(granularity='group', group_size=32)"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"QuantSpec(group_size={self.group_size}) only applies to granularity='group', "
                f"not {self.granularity!r}: drop group_size or set granularity='group'"
            )
        if self.observer not in ("minmax", "moving_average", "percentile"):
            raise ValueError(
                f"QuantSpec(observer={self.observer!r}): use 'minmax', 'moving_average' or 'percentile'"
            )
        if not 0.0 < self.averaging_constant <= 1.0:
            raise ValueError(f"QuantSpec(averaging_constant={self.averaging_constant}): must be in (0, 1]")
        if not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"QuantSpec(percentile={self.percentile}): must be in (50, 100]")
        if self.dynamic and self.learnable:
            raise ValueError(
                "QuantSpec(dynamic=True, learnable=True): dynamic scales come from each batch and cannot "
                "be learned; choose one, e.g. QuantSpec(dynamic=True)"
            )

    @property
    def qmin(self) -> int:
        return qrange(self.bits, self.symmetric)[0]

    @property
    def qmax(self) -> int:
        return qrange(self.bits, self.symmetric)[1]


def _default_weight() -> QuantSpec:
    return QuantSpec(bits=8, symmetric=True, granularity="channel")


def _default_activation() -> QuantSpec:
    return QuantSpec(bits=8, symmetric=False, granularity="tensor", observer="moving_average")


@dataclass(frozen=True)
class QuantConfig:
    """Weight and activation specs for every quantized layer.

    Integer kernels impose: symmetric weights (the int32 epilogue corrects only the activation
    zero point), one weight scale per tensor or output channel, and activations per tensor
    (static or dynamic) or per token (dynamic).
    """

    weight: QuantSpec = field(default_factory=_default_weight)
    activation: QuantSpec = field(default_factory=_default_activation)
    # How integer linear layers run their backward GEMMs: "int8x3" (large layers' grad_x, and on AMX
    # CPUs grad_w, on the int8 units, the gradient split into three int8 digits;
    # intqat.ops.digit_gemm) or "fp32".
    grad_gemm: str = "int8x3"
    # nn.Embedding weights: None keeps embeddings float; a symmetric weight spec (per channel, or per
    # group along the embedding dim) quantizes them. A lm_head tied to the embedding shares its codes
    # when both specs agree.
    embedding: QuantSpec | None = None

    def __post_init__(self):
        try:
            check_grad_gemm(self.grad_gemm)
        except ValueError as e:
            raise ValueError(f"QuantConfig({e})") from None
        for name in ("weight", "activation", "embedding"):
            value = getattr(self, name)
            if name == "embedding" and value is None:
                continue
            if hasattr(value, "items"):
                object.__setattr__(self, name, _spec_from_dict(dict(value.items()), name))
            elif not isinstance(value, QuantSpec):
                raise TypeError(
                    f"QuantConfig({name}={value!r}): expected a QuantSpec or a dict of its fields, e.g. "
                    f"QuantConfig({name}=QuantSpec(bits=8))"
                )
        w, a = self.weight, self.activation
        if not w.symmetric:
            raise ValueError(
                "QuantConfig: weights must be symmetric for the integer kernels; use "
                "weight=QuantSpec(symmetric=True, ...)"
            )
        if w.granularity not in ("tensor", "channel", "group"):
            raise ValueError(
                f"QuantConfig: weight granularity {w.granularity!r} is not supported by the integer "
                "modules; use weight=QuantSpec(granularity='channel') or granularity='group' with a group_size"
            )
        e = self.embedding
        if e is not None and (not e.symmetric or e.granularity not in ("channel", "group") or e.dynamic or e.learnable):
            raise ValueError("QuantConfig: embedding weights are symmetric, per channel or per group, not learned "
                             "or dynamic; e.g. embedding=QuantSpec(bits=4, granularity='group', group_size=32)")
        if w.dynamic:
            raise ValueError("QuantConfig: weights are never dynamic; drop dynamic=True from the weight spec")
        if a.granularity not in ("tensor", "token"):
            raise ValueError(
                f"QuantConfig: activation granularity {a.granularity!r} is not supported; use 'tensor' "
                "(static or dynamic) or 'token' (dynamic)"
            )
        if a.dynamic != (a.granularity == "token") or (a.dynamic and not a.symmetric):
            raise ValueError(
                "QuantConfig: dynamic activations are quantized symmetric per token, and per-token "
                "scales are dynamic; use activation=QuantSpec(granularity='token', dynamic=True, "
                "symmetric=True) or a static per-tensor activation=QuantSpec(granularity='tensor')"
            )

    @classmethod
    def from_preset(cls, name: str) -> "QuantConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown QuantConfig preset {name!r}; available: {', '.join(sorted(PRESETS))}")
        return PRESETS[name]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replace(self, **kw) -> "QuantConfig":
        return replace(self, **kw)


PRESETS: dict[str, QuantConfig] = {
    # per-channel symmetric int8 weights, per-tensor asymmetric static int8 activations
    "w8a8": QuantConfig(),
    # w8a8 with symmetric static activations (zero point 0, codes in [-127, 127]): the scheme TensorRT's explicit
    # quantization takes (QuantizeLinear's zero point must be 0), so its Q/DQ model.onnx is TensorRT-ready
    # (intqat.deploy.tensorrt_check); a ReLU's output uses half the codes, where w8a8's zero point uses them all
    "w8a8_sym": QuantConfig(activation=QuantSpec(bits=8, symmetric=True, granularity="tensor")),
    # same weights; activations quantized per token from each batch (no activation observer)
    "w8a8_dynamic": QuantConfig(
        activation=QuantSpec(bits=8, symmetric=True, granularity="token", dynamic=True)
    ),
    # 4-bit per-channel weights (codes in int8 storage), static int8 activations
    "w4a8": QuantConfig(weight=QuantSpec(bits=4, symmetric=True, granularity="channel")),
    # w8a8 with LSQ-learned scales and LSQ+ activation zero points
    "w8a8_lsq": QuantConfig(
        weight=QuantSpec(bits=8, symmetric=True, granularity="channel", learnable=True),
        activation=QuantSpec(bits=8, symmetric=False, granularity="tensor", learnable=True),
    ),
    # LLM-style "8da4w" (ExecuTorch XNNPACK, torchao QAT): int8 per-token dynamic activations, int4
    # symmetric weights with one scale per group of 32 input features (the group size is a knob:
    # {"preset": "8da4w", "weight": {"group_size": 128}})
    "8da4w": QuantConfig(
        weight=QuantSpec(bits=4, symmetric=True, granularity="group", group_size=32),
        activation=QuantSpec(bits=8, symmetric=True, granularity="token", dynamic=True),
    ),
    # int8 weights with one scale per group of 128 input features, per-token dynamic int8 activations
    "w8a8_g128": QuantConfig(
        weight=QuantSpec(bits=8, symmetric=True, granularity="group", group_size=128),
        activation=QuantSpec(bits=8, symmetric=True, granularity="token", dynamic=True),
    ),
}


def _spec_from_dict(d: dict, what: str, base: QuantSpec | None = None) -> QuantSpec:
    valid = [f.name for f in fields(QuantSpec)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ValueError(f"unknown {what} QuantSpec field(s) {unknown}; valid fields: {', '.join(valid)}")
    if base is not None and d.get("granularity", "group") != "group" and "group_size" not in d:
        d = {**d, "group_size": None}  # {"granularity": "channel"} over a per-group preset
    return replace(base, **d) if base is not None else QuantSpec(**d)


def resolve_config(config: QuantConfig | str | dict | None) -> QuantConfig:
    """Accept a QuantConfig, a preset name ("w8a8"), a dict (e.g. from Hydra) or None (w8a8)."""
    if config is None:
        return PRESETS["w8a8"]
    if isinstance(config, QuantConfig):
        return config
    if isinstance(config, str):
        return QuantConfig.from_preset(config)
    if hasattr(config, "items"):
        # a dict overrides fields of a preset (w8a8 unless it names one): {"weight": {"bits": 4}}
        # keeps w8a8's per-channel weights and changes only their width
        d = dict(config.items())
        base = QuantConfig.from_preset(d.pop("preset", "w8a8"))
        w = dict((d.pop("weight", None) or {}).items())
        a = dict((d.pop("activation", None) or {}).items())
        grad_gemm = d.pop("grad_gemm", base.grad_gemm)
        e = d.pop("embedding", base.embedding)
        if e is not None and not isinstance(e, QuantSpec):  # a dict: fields over the weight spec's defaults
            e = _spec_from_dict(dict(e.items()), "embedding", base.embedding or QuantSpec(granularity="channel"))
        if d:
            raise ValueError(f"unknown QuantConfig keys {sorted(d)}; valid: preset, weight, activation, grad_gemm, "
                             "embedding")
        return QuantConfig(weight=_spec_from_dict(w, "weight", base.weight),
                           activation=_spec_from_dict(a, "activation", base.activation), grad_gemm=grad_gemm,
                           embedding=e)
    raise TypeError(f"expected a QuantConfig, a preset name or a dict, got {type(config).__name__}")
