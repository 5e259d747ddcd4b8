"""`intqat-bench ops`: int_mm and one linear layer's forward + backward against their anchors.

int_mm rows      intqat.ops.int_mm and torch._int_mm (the anchor) on int8 (M, K) x (K, N), B both
                 contiguous and as the transposed view of an (N, K) weight (what int_linear passes),
                 and fp32 torch.mm; speed = throughput relative to torch._int_mm.
linear rows      y = layer(x); y.backward(g) for x (M, K) requiring grad, weight (N, K) + bias;
                 speed relative to fp32 nn.Linear; saved-for-backward bytes of the layer
                 (intqat.bench.saved) relative to torchao's FakeQuantizedLinear.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from intqat.bench import peers
from intqat.bench.saved import saved_bytes
from intqat.bench.table import NA, Table, fmt_bytes, fmt_num, fmt_ratio
from intqat.bench.timing import backends_used, machine_info, machine_lines, speed_ratio, time_interleaved
from intqat.config import PRESETS
from intqat.nn import FakeQuantLinear, IntLinear
from intqat.nn.quantizers import WeightQuantizer
from intqat.ops import backends, choose_qparams, int_linear, int_mm
from intqat.ops.int_linear_grouped import int_linear_grouped

__all__ = ["run_ops", "OpsSettings", "linear_candidates"]


@dataclass(frozen=True)
class OpsSettings:
    M: int = 256
    K: int = 1024
    N: int = 1024
    repeats: int = 15
    warmup: int = 3
    min_time: float = 0.05  # seconds per measurement (calls per measurement chosen to reach it)
    seed: int = 0

    @classmethod
    def quick(cls) -> "OpsSettings":
        return cls(M=64, K=256, N=256, repeats=2, warmup=1, min_time=0.002)


ANCHOR_MM = "torch._int_mm"
NO_DOT = "[no int8 dot]"  # rows forced onto the backend a CPU without int8 dot products takes


def no_dot_backend() -> str:
    """The backend the table picks for GEMMs on a CPU without int8 dot products (this build)."""
    return "avx2_int16" if backends.unavailable("avx2_int16") is None else "fp32_exact"
ANCHOR_LINEAR = "nn.Linear fp32"
MEM_ANCHOR = "torchao FakeQuantizedLinear"
INTQAT_8DA4W = "intqat int_linear_grouped 8da4w (g32)"
TORCHAO_8DA4W = "torchao FakeQuantizedLinear 8da4w (g32)"


@dataclass
class LinearCandidate:
    name: str
    layer: Callable[[torch.Tensor], torch.Tensor]  # x -> y, differentiable
    params: list[torch.Tensor]


def linear_candidates(M: int, K: int, N: int, seed: int = 0) -> tuple[dict[str, LinearCandidate], dict[str, str], torch.Tensor]:
    """Every linear flavour built from the same float layer -> ({name: candidate}, {name: why n/a}, x)."""
    torch.manual_seed(seed)
    base = nn.Linear(K, N)
    x = torch.randn(M, K)

    def fresh() -> nn.Linear:  # every candidate gets its own copy of the same float layer
        return _clone(base)

    cands: dict[str, LinearCandidate] = {}
    missing: dict[str, str] = {}

    lin = fresh()
    cands[ANCHOR_LINEAR] = LinearCandidate(ANCHOR_LINEAR, lin, list(lin.parameters()))

    # int_linear as IntLinear calls it: w_scale=None, the op takes min-max per-channel scales at every step
    w8a8 = PRESETS["w8a8"]
    lin = fresh()
    wq = WeightQuantizer(w8a8.weight, lin.weight)
    x_scale, x_zp = choose_qparams(x, bits=8, symmetric=False, granularity="tensor")
    x_zp = x_zp.to(torch.float32)
    a_spec = w8a8.activation

    def static(xx, lin=lin, wq=wq, grad_gemm="int8x3"):
        return int_linear(xx, lin.weight, lin.bias, x_scale, x_zp, None,
                          x_qmin=a_spec.qmin, x_qmax=a_spec.qmax, w_qmin=wq.qmin, w_qmax=wq.qmax, grad_gemm=grad_gemm)

    cands["intqat int_linear static w8a8"] = LinearCandidate("intqat int_linear static w8a8", static, list(lin.parameters()))
    # the same layer with both backward GEMMs in fp32 (QuantConfig(grad_gemm="fp32")): what the digit GEMM buys
    lin = fresh()
    name = "intqat int_linear static, grad_gemm=fp32"
    cands[name] = LinearCandidate(name, lambda xx, lin=lin, wq=wq: static(xx, lin, wq, "fp32"), list(lin.parameters()))

    dyn = PRESETS["w8a8_dynamic"]
    lin = fresh()
    wqd = WeightQuantizer(dyn.weight, lin.weight)

    def dynamic(xx, lin=lin, wq=wqd):
        return int_linear(xx, lin.weight, lin.bias, None, None, None,
                          x_qmin=dyn.activation.qmin, x_qmax=dyn.activation.qmax, w_qmin=wq.qmin, w_qmax=wq.qmax,
                          x_dynamic=True)

    cands["intqat int_linear dynamic per-token"] = LinearCandidate("intqat int_linear dynamic per-token", dynamic, list(lin.parameters()))

    # the backend CPUs without int8 dot-product units take (exact fp32 GEMMs of the codes), forced here so
    # every run shows what such a CPU's intqat layer costs against fp32 on the same units
    lin = fresh()
    name = f"intqat int_linear static w8a8 {NO_DOT}"
    # (grad_gemm="fp32": on that class the backward's digit GEMM never pays, the table keeps fp32 GEMMs)
    cands[name] = LinearCandidate(name, _forced_backend(no_dot_backend(), lambda xx, lin=lin, wq=wq: static(xx, lin, wq, "fp32")),
                                  list(lin.parameters()))

    # the modules models actually run (observer on, as after prepare_qat)
    lin = fresh()
    fq = FakeQuantLinear.from_linear(lin, w8a8).train()
    fq.input_quantizer.observe(x)
    cands["intqat FakeQuantLinear w8a8"] = LinearCandidate("intqat FakeQuantLinear w8a8", fq, list(fq.parameters()))
    lin = fresh()
    il = FakeQuantLinear.from_linear(lin, w8a8).train()
    il.input_quantizer.observe(x)
    il = IntLinear.from_fake_quant(il).train()
    cands["intqat IntLinear w8a8"] = LinearCandidate("intqat IntLinear w8a8", il, list(il.parameters()))
    lin = fresh()
    il2 = FakeQuantLinear.from_linear(lin, w8a8).train()
    il2.input_quantizer.observe(x)
    il2 = IntLinear.from_fake_quant(il2).train()
    il2.grad_gemm = "fp32"  # as the table decides on a CPU without int8 dot products
    name = f"intqat IntLinear w8a8 {NO_DOT}"
    cands[name] = LinearCandidate(name, _forced_backend(no_dot_backend(), il2), list(il2.parameters()))

    for name, build in (
        (MEM_ANCHOR, peers.torchao_qat),
        ("torchao int8 mixed-precision", peers.torchao_int8_mp),
        ("torch.ao.nn.qat.Linear x86", peers.torch_ao_qat_linear),
    ):
        try:
            layer = build(fresh()).train()
        except peers.Unavailable as e:
            missing[name] = str(e)
            continue
        cands[name] = LinearCandidate(name, layer, list(layer.parameters()))
    # 8da4w: int8 per-token dynamic activations, int4 weights per group of 32 (intqat.ops.int_linear_grouped)
    lin = fresh()
    cands[INTQAT_8DA4W] = LinearCandidate(INTQAT_8DA4W, lambda xx, lin=lin: int_linear_grouped(
        xx, lin.weight, lin.bias, None, None, None, group_size=32), list(lin.parameters()))
    try:
        tq, qat = peers._torchao()
        holder = nn.Sequential(fresh())
        tq.quantize_(holder, qat.QATConfig(activation_config=qat.IntxFakeQuantizeConfig(torch.int8, "per_token",
                                                                                        is_symmetric=False),
                                           weight_config=qat.IntxFakeQuantizeConfig(torch.int4, group_size=32),
                                           step="prepare"))
        cands[TORCHAO_8DA4W] = LinearCandidate(TORCHAO_8DA4W, holder[0].train(), list(holder[0].parameters()))
    except peers.Unavailable as e:
        missing[TORCHAO_8DA4W] = str(e)
    return cands, missing, x


def _forced_backend(name: str, fn: Callable) -> Callable:
    """fn run with backend `name` forced (slow or not on this CPU)."""
    def run(*args):
        with backends.use_backend(name):
            return fn(*args)

    return run


def _clone(lin: nn.Linear) -> nn.Linear:
    new = nn.Linear(lin.in_features, lin.out_features)
    with torch.no_grad():
        new.weight.copy_(lin.weight)
        new.bias.copy_(lin.bias)
    return new


def _fwd_bwd(layer, x: torch.Tensor, g: torch.Tensor, params: list[torch.Tensor]) -> Callable[[], None]:
    def run():
        x.grad = None
        for p in params:
            p.grad = None
        layer(x).backward(g)

    return run


def run_ops(s: OpsSettings = OpsSettings(), info: dict | None = None) -> Table:
    M, K, N = s.M, s.K, s.N
    info = info or machine_info()
    torch.manual_seed(s.seed)

    # -- int_mm --------------------------------------------------------------------------------
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    b = torch.randint(-128, 128, (K, N), dtype=torch.int8)
    w_codes = torch.randint(-127, 128, (N, K), dtype=torch.int8)  # (N, K) like q_w; int_linear passes q_w.t()
    bt = w_codes.t()
    af, bf = torch.randn(M, K), torch.randn(K, N)
    mm_cands = {
        ANCHOR_MM: lambda: torch._int_mm(a, b),
        "intqat int_mm": lambda: int_mm(a, b),
        "torch._int_mm, B = Wᵀ view": lambda: torch._int_mm(a, bt),
        "intqat int_mm, B = Wᵀ view": lambda: int_mm(a, bt),
        "intqat int_mm, B = Wᵀ view [avx2_int16]": _forced_backend("avx2_int16", lambda: int_mm(a, bt)),
        "intqat int_mm, B = Wᵀ view [fp32_exact]": _forced_backend("fp32_exact", lambda: int_mm(a, bt)),
        "fp32 torch.mm": lambda: torch.mm(af, bf),
    }
    assert torch.equal(int_mm(a, b), torch._int_mm(a, b)) and torch.equal(int_mm(a, bt), torch._int_mm(a, bt))
    mm_t = time_interleaved(mm_cands, s.repeats, s.warmup, s.min_time)
    mm_backends = {n: backends_used(f) for n, f in mm_cands.items()}

    # -- linear forward + backward -------------------------------------------------------------
    cands, missing, x = linear_candidates(M, K, N, s.seed)
    x = x.clone().requires_grad_(True)
    g = torch.randn(M, N)
    lin_t = time_interleaved(
        {n: _fwd_bwd(c.layer, x, g, c.params) for n, c in cands.items()}, s.repeats, s.warmup, s.min_time
    )
    lin_backends = {n: backends_used(_fwd_bwd(c.layer, x, g, c.params)) for n, c in cands.items()}
    saved = {}
    for n, c in cands.items():
        nbytes, y = saved_bytes(lambda c=c: c.layer(x), exclude=c.params)
        saved[n] = nbytes
        del y

    # -- table ---------------------------------------------------------------------------------
    cols = ["candidate", "median ms", "GOP/s", "speed vs anchor", "saved/layer MiB", "saved vs torchao FQ", "backends"]
    t = Table(
        title=f"intqat-bench ops   M={M} K={K} N={N}",
        header_lines=[
            *machine_lines(info),
            f"timing: {s.repeats} repeats, interleaved round-robin, median; warm-up {s.warmup}; "
            f">= {s.min_time * 1e3:.0f} ms per measurement",
        ],
        columns=cols,
    )
    t.group(f"int_mm: int8 ({M}x{K}) x int8 ({K}x{N}) -> int32; anchor {ANCHOR_MM}, speed = throughput ratio")
    ops_mm = 2 * M * K * N
    for n, tm in mm_t.items():
        ratio = speed_ratio(mm_t[ANCHOR_MM], tm)
        t.add(
            [n + (" [anchor]" if n == ANCHOR_MM else ""), fmt_num(tm.median * 1e3), fmt_num(ops_mm / tm.median / 1e9),
             fmt_ratio(ratio), "-", "-", mm_backends[n]],
            {"group": "int_mm", "name": n, "median_s": tm.median, "times_s": tm.times, "inner": tm.inner,
             "gops": ops_mm / tm.median / 1e9, "speed_vs_anchor": ratio, "backends": mm_backends[n]},
        )
    t.group(f"linear forward+backward, x ({M}x{K}) requires grad, W ({N}x{K}) + bias; anchor {ANCHOR_LINEAR}")
    ops_lin = 3 * 2 * M * K * N  # y, grad_x, grad_w
    mem_anchor = saved.get(MEM_ANCHOR)
    order = [ANCHOR_LINEAR, "intqat int_linear static w8a8", "intqat int_linear static, grad_gemm=fp32",
             "intqat int_linear dynamic per-token", f"intqat int_linear static w8a8 {NO_DOT}",
             "intqat IntLinear w8a8", f"intqat IntLinear w8a8 {NO_DOT}", "intqat FakeQuantLinear w8a8", MEM_ANCHOR,
             "torchao int8 mixed-precision", "torch.ao.nn.qat.Linear x86", INTQAT_8DA4W, TORCHAO_8DA4W]
    marks = {}
    for n in order:
        label = n + (" [anchor]" if n == ANCHOR_LINEAR else "")
        if n in missing:
            marks[n] = f"[{len(marks) + 1}]"
            t.add([f"{label} {marks[n]}", NA, NA, NA, NA, NA, NA], {"group": "linear", "name": n, "unavailable": missing[n]})
            continue
        tm = lin_t[n]
        ratio = speed_ratio(lin_t[ANCHOR_LINEAR], tm)
        mem_ratio = saved[n] / mem_anchor if mem_anchor else None
        t.add(
            [label, fmt_num(tm.median * 1e3), fmt_num(ops_lin / tm.median / 1e9), fmt_ratio(ratio),
             fmt_bytes(saved[n]), fmt_ratio(mem_ratio), lin_backends[n]],
            {"group": "linear", "name": n, "median_s": tm.median, "times_s": tm.times, "inner": tm.inner,
             "gops": ops_lin / tm.median / 1e9, "speed_vs_anchor": ratio, "saved_bytes": saved[n],
             "saved_vs_torchao_fq": mem_ratio, "backends": lin_backends[n]},
        )
    t.footnotes = [
        "speed vs anchor: median over repeats of t_anchor / t_candidate (> 1 = faster). GOP/s counts 2MKN per matmul "
        "(3 matmuls for forward+backward).",
        "saved/layer: bytes autograd keeps for backward (saved_tensors_hooks, one count per storage, parameters "
        "excluded); lower is better.",
        "int_linear rows: the functional op with w_scale=None, i.e. min-max per-channel weight scales computed inside "
        "the op at each call (as IntLinear does); static = per-tensor asymmetric x_scale/zero point fixed from x. "
        "The backend table (intqat.ops.backends) picks each primitive's implementation; column 'backends' says "
        "what ran (linear / int_mm: the forward GEMM; digit_matmul: backward GEMMs on the int8 units, "
        "grad_gemm='int8x3' where they pay; passes: the elementwise quantize / epilogue / mask passes). The "
        "grad_gemm=fp32 row keeps both backward GEMMs in fp32. "
        f"{NO_DOT} rows force the backend CPUs without int8 dot-product units take (avx2_int16: exact int16 "
        "multiply-adds, vpmaddwd; fp32_exact where the build has no AVX2: exact fp32 GEMMs of the codes in K slices "
        "of <= 1024), the backward in fp32 (column 'backends' says which ran): what such a CPU's intqat layer costs "
        "against fp32 on the same units. [avx2_int16] / [fp32_exact] int_mm rows force that backend. "
        "IntLinear / FakeQuantLinear: the modules, activation observer on. intqat rows use the fused CPU kernels "
        "when they are built (see the machine line).",
        "torchao FakeQuantizedLinear: int8 per-token activations (asymmetric: torchao 0.18 rejects symmetric "
        "per-token), int8 per-channel symmetric weights. torch.ao: weight FQ + the output activation FQ prepare_qat "
        "attaches (x86 qconfig: per-channel weights, reduce_range activations).",
    ]
    for n, mark in marks.items():
        t.footnotes.append(f"{mark} {n}: {missing[n]}")
    t.meta = {"machine": info, "settings": dict(s.__dict__)}
    return t
