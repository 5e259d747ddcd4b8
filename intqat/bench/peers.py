"""The other libraries intqat is measured against, set up the way their docs say, each with its
deploy path. Every builder changes a float model in place and returns it; a missing library
raises `Unavailable` with the reason, which the tables print as n/a plus a footnote.

torchao QAT           quantize_(m, QATConfig(activation_config=int8 per-token, weight_config=int8
                      per-channel symmetric)) -> FakeQuantizedLinear. torchao 0.18's per-token
                      fake quantizer is asymmetric only ("Symmetric per token is not supported
                      yet"), so activations are asymmetric. Deploy: QATConfig(step="convert"), then
                      quantize_(Int8DynamicActivationInt8WeightConfig(act_mapping_type=ASYMMETRIC))
                      (the real int8 model, torch._int_mm inside). Linear layers only.
torchao int8 MP       quantize_(m, int8_mixed_precision_training()): dynamic int8 matmuls in forward
                      and both backward matmuls; not QAT. Deploy (for the mismatch column only):
                      quantize_(Int8DynamicActivationInt8WeightConfig()) (symmetric per-token
                      activations, per-channel weights: its forward's own quantization).
torch.ao QAT          eager mode: QuantStub/DeQuantStub around the model, fuse_modules_qat
                      (Conv+BN+ReLU, Linear+ReLU), qconfig get_default_qat_qconfig("x86"),
                      prepare_qat; deploy: torch.ao.quantization.convert on the x86 engine.
"""

from __future__ import annotations

import copy
import logging
import warnings

import torch
from torch import nn

__all__ = [
    "Unavailable",
    "torchao_qat",
    "torchao_qat_deploy",
    "torchao_int8_mp",
    "torchao_int8_mp_deploy",
    "torch_ao_qat",
    "torch_ao_qat_linear",
    "torch_ao_deploy",
]


class Unavailable(RuntimeError):
    """A peer cannot run here; str(e) says why (printed in a footnote)."""


def _torchao():
    # torchao logs a warning per CUDA-only extension it cannot load: noise on a CPU machine
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"torchao is not installed ({e}); `pip install '.[bench]'`") from e
    import torchao.quantization as tq
    import torchao.quantization.qat as qat

    return tq, qat


# ---------------------------------------------------------------------------------------------
# torchao QAT
# ---------------------------------------------------------------------------------------------


def torchao_qat(model: nn.Module) -> nn.Module:
    tq, qat = _torchao()
    act = qat.IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    wgt = qat.IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
    if isinstance(model, nn.Linear):  # quantize_ swaps children: wrap a bare layer
        holder = nn.Sequential(model)
        tq.quantize_(holder, qat.QATConfig(activation_config=act, weight_config=wgt, step="prepare"))
        return holder[0]
    tq.quantize_(model, qat.QATConfig(activation_config=act, weight_config=wgt, step="prepare"))
    return model


def torchao_qat_deploy(model: nn.Module) -> nn.Module:
    tq, qat = _torchao()
    d = copy.deepcopy(model).eval()
    tq.quantize_(d, qat.QATConfig(step="convert"))
    tq.quantize_(d, tq.Int8DynamicActivationInt8WeightConfig(act_mapping_type=tq.MappingType.ASYMMETRIC))
    return d


# ---------------------------------------------------------------------------------------------
# torchao int8 mixed-precision training
# ---------------------------------------------------------------------------------------------


def torchao_int8_mp(model: nn.Module) -> nn.Module:
    tq, _ = _torchao()
    from torchao.prototype.quantized_training import int8_mixed_precision_training

    if isinstance(model, nn.Linear):
        tq.quantize_(nn.Sequential(model), int8_mixed_precision_training())  # swaps the weight in place
        return model
    tq.quantize_(model, int8_mixed_precision_training())
    return model


def torchao_int8_mp_deploy(model: nn.Module) -> nn.Module:
    tq, _ = _torchao()
    d = copy.deepcopy(model).eval()
    for m in d.modules():  # the training wrapper subclass -> the plain fp32 weight it holds
        if isinstance(m, nn.Linear) and hasattr(m.weight, "_data") and type(m.weight) is not nn.Parameter:
            m.weight = nn.Parameter(m.weight._data.detach().clone(), requires_grad=False)
    tq.quantize_(d, tq.Int8DynamicActivationInt8WeightConfig())
    return d


# ---------------------------------------------------------------------------------------------
# torch.ao eager-mode QAT
# ---------------------------------------------------------------------------------------------


def _tao():
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.ao")
    warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization is deprecated.*")
    warnings.filterwarnings("ignore", message=r".*reduce_range will be deprecated.*")
    warnings.filterwarnings("ignore", message=r".*quantized tensor creation functions.*")
    import torch.ao.quantization as tq

    if "x86" not in torch.backends.quantized.supported_engines:
        raise Unavailable(f"the x86 quantized engine is not built in (engines: {torch.backends.quantized.supported_engines})")
    return tq


def _fusion_groups(seq: nn.Sequential) -> list[list[str]]:
    """Conv2d+BatchNorm2d(+ReLU) and Linear+ReLU runs in a flat nn.Sequential, by child name."""
    names = list(seq._modules)
    mods = [seq._modules[n] for n in names]
    groups, i = [], 0
    while i < len(mods):
        if type(mods[i]) is nn.Conv2d and i + 1 < len(mods) and type(mods[i + 1]) is nn.BatchNorm2d:
            g = names[i : i + 2]
            if i + 2 < len(mods) and type(mods[i + 2]) is nn.ReLU:
                g.append(names[i + 2])
            groups.append(g)
            i += len(g)
        elif type(mods[i]) in (nn.Linear, nn.Conv2d) and i + 1 < len(mods) and type(mods[i + 1]) is nn.ReLU:
            groups.append(names[i : i + 2])
            i += 2
        else:
            i += 1
    return groups


def torch_ao_qat(model: nn.Sequential) -> nn.Sequential:
    """A flat float nn.Sequential -> QuantStub, fused QAT modules, DeQuantStub (train mode)."""
    tq = _tao()
    if not isinstance(model, nn.Sequential):
        # eager mode wants QuantStub / DeQuantStub placed by hand around every quantized region and a fusion
        # list per block; the bench does that for flat nn.Sequential models only
        raise Unavailable(f"torch.ao eager-mode QAT needs QuantStub / DeQuantStub and fusion lists written into the "
                          f"model by hand; the bench sets them up for flat nn.Sequential models, not "
                          f"{type(model).__name__}")
    wrapped = nn.Sequential(tq.QuantStub(), *model, tq.DeQuantStub()).train()
    wrapped = tq.fuse_modules_qat(wrapped, _fusion_groups(wrapped))
    wrapped.qconfig = tq.get_default_qat_qconfig("x86")
    return tq.prepare_qat(wrapped)


def torch_ao_qat_linear(linear: nn.Linear) -> nn.Module:
    """One torch.ao.nn.qat.Linear as prepare_qat leaves it: weight fake quant inside, the
    activation fake quant of its output attached (so a layer costs one activation FQ, like the others)."""
    tq = _tao()
    holder = nn.Sequential(linear).train()
    holder.qconfig = tq.get_default_qat_qconfig("x86")
    return tq.prepare_qat(holder)[0]


def torch_ao_deploy(model: nn.Module) -> nn.Module:
    tq = _tao()
    torch.backends.quantized.engine = "x86"
    d = copy.deepcopy(model).eval()
    return tq.convert(d)
