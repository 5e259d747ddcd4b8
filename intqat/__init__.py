"""intqat: quantization-aware training through differentiable integer arithmetic.

    import intqat
    model = intqat.prepare_qat(model, "w8a8")   # nn.Linear / nn.Conv2d -> fake quant
    ...train...
    model = intqat.to_integer(model)            # fake quant -> int8 x int8 -> int32 modules
    ...keep training; the forward is the deployed arithmetic...
"""

# (imported for its side effect: LightningModule.load_from_checkpoint may use intqat's instantiator)
from intqat import checkpoint as _checkpoint  # noqa: F401
from intqat._version import __version__
from intqat.config import PRESETS, QuantConfig, QuantSpec, resolve_config
from intqat.convert import (
    calibrate,
    chain_int8,
    freeze_bn_stats,
    freeze_observers,
    prepare_qat,
    quantized_modules,
    register_converter,
    to_deployed,
    to_integer,
)


__all__ = [
    "QuantConfig", "QuantSpec", "PRESETS", "resolve_config",
    "prepare_qat", "to_integer", "to_deployed", "calibrate", "chain_int8",
    "freeze_observers", "freeze_bn_stats", "quantized_modules", "register_converter",
]


def __getattr__(name):
    # Heavier pieces load on first use: `import intqat` stays cheap for the ops alone.
    if name == "IntQAT":
        from intqat.callback import IntQAT

        return IntQAT
    if name == "export_mixed_precision":
        from intqat.export import export_mixed_precision

        return export_mixed_precision
    raise AttributeError(f"module 'intqat' has no attribute {name!r}")
