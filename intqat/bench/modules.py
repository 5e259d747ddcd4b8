"""`intqat-bench modules`: whole training steps of two small models, every QAT flavour.

Models (flat nn.Sequential, so torch.ao's eager fusion and intqat's Conv+BN folding both apply):
    MLP  in 1024 -> 1024 -> 1024 -> 1024 -> 10, ReLU between, batch 256
    CNN  3x32x32 -> 3 x (Conv3x3-BN-ReLU-MaxPool2) with 32/64/128 channels -> avgpool -> Linear 10, batch 64
         (twice: NCHW, and model + batch in channels_last memory format)
Step: zero_grad(set_to_none) -> forward -> cross-entropy -> backward -> Adam.step(), the Adam the
recipes build (fused; `--loop-optimizer`: torch's default per-parameter loop).

Columns: step time (interleaved timer, intqat.bench.timing), the eval-mode (validation) forward's time,
peak memory (intqat.bench.memory),
saved-for-backward bytes of one step (intqat.bench.saved), and the train/deploy mismatch:
max |eval-mode forward of the trained model - its deployed program| on the same batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat.bench import peers
from intqat.bench.memory import peak_transient_bytes, state_bytes
from intqat.bench.saved import saved_bytes
from intqat.bench.table import NA, Table, fmt_bytes, fmt_num, fmt_ratio
from intqat.bench.timing import backends_used, machine_info, machine_lines, speed_ratio, time_interleaved
from intqat.training.optimizers import build_optimizer

__all__ = ["ModulesSettings", "run_modules", "make_mlp", "make_cnn", "FLAVOURS"]


@dataclass(frozen=True)
class ModulesSettings:
    mlp_in: int = 1024
    mlp_width: int = 1024
    mlp_hidden: int = 3  # hidden Linear+ReLU layers; one more Linear is the head
    mlp_batch: int = 256
    cnn_hw: int = 32
    cnn_channels: tuple[int, ...] = (32, 64, 128)
    cnn_batch: int = 64
    classes: int = 10
    repeats: int = 10
    warmup: int = 2  # untimed rounds, after the one step each flavour takes when it is built
    calib_batches: int = 3
    lr: float = 1e-3
    seed: int = 0
    # the recipes' optimizer (intqat.training.optimizers): torch's fused Adam; False: Adam's default
    # per-parameter loop (~4 ms more per MLP step here, the same for every flavour)
    fused_optimizer: bool = True
    blocks: bool = True  # also the transformer-encoder and depthwise-separable blocks (intqat.bench.blocks)
    quick_blocks: bool = False
    # which models (MODELS' names); empty: the default set (MLP, CNN, CNN channels_last, and with `blocks`
    # the encoder and depthwise-separable blocks). `--models resnet,mbconv,convnext,encoder,llama` (issue 27)
    models: tuple[str, ...] = ()
    preset: str = "w8a8"  # the intqat preset of the model being built (set per model: the Llama block is 8da4w)

    @classmethod
    def quick(cls) -> "ModulesSettings":
        return cls(mlp_in=128, mlp_width=128, mlp_batch=32, cnn_hw=16, cnn_channels=(8, 16, 16), cnn_batch=8,
                   repeats=2, warmup=0, calib_batches=1, quick_blocks=True)


def bench_models(s, g: torch.Generator, prefix: str = "",
                 channels_last_cnn: bool = False) -> list[tuple[str, Any, torch.Tensor]]:
    """(title, model factory, input batch) for the MLP and the CNN both module benches time;
    channels_last_cnn adds the CNN again with model and batch in channels_last memory format (the
    layout oneDNN's fp32 convs and intqat's integer convs both run fastest in on the CPU)."""
    widths = [s.mlp_in] + [s.mlp_width] * s.mlp_hidden + [s.classes]
    cnn_title = (f"{prefix}CNN 3x{s.cnn_hw}x{s.cnn_hw}, 3 x conv3x3-BN-ReLU-maxpool "
                 f"{'/'.join(map(str, s.cnn_channels))} ch, linear head, batch {s.cnn_batch}")
    mlp_x = torch.randn(s.mlp_batch, s.mlp_in, generator=g)  # drawn in this order: same batches as ever
    cnn_x = torch.randn(s.cnn_batch, 3, s.cnn_hw, s.cnn_hw, generator=g)
    models = [
        (f"{prefix}MLP {'-'.join(map(str, widths))}, batch {s.mlp_batch}", lambda: make_mlp(s), mlp_x),
        (cnn_title, lambda: make_cnn(s), cnn_x),
    ]
    if channels_last_cnn:
        cl = torch.channels_last
        models.append((f"{cnn_title}, channels_last", lambda: make_cnn(s).to(memory_format=cl),
                       cnn_x.to(memory_format=cl)))
    return models


# every model `--models` can name: the two bench models, the CNN in channels_last, and the blocks
MODELS = ("mlp", "cnn", "cnn_cl", "encoder", "dwsep", "resnet", "mbconv", "convnext", "llama")
DEFAULT_MODELS = ("mlp", "cnn", "cnn_cl", "encoder", "dwsep")


def parse_models(text: str | None) -> tuple[str, ...]:
    """'resnet,llama' -> ('resnet', 'llama'); 'all' -> MODELS; None / '' -> () (the default set). A clear error
    naming the unknown names and the valid ones."""
    if not text:
        return ()
    names = tuple(n.strip().lower().replace("-", "_") for n in text.split(",") if n.strip())
    if names == ("all",):
        return MODELS
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"--models: unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)} or all")
    return names


def selected_models(s: ModulesSettings, g: torch.Generator) -> list[tuple[str, Any, torch.Tensor, str]]:
    """(title, factory, batch, preset) for the models `s` selects, in MODELS' order within each kind. The
    default set draws its batches from g in the order it always did (same batches as earlier runs)."""
    from intqat.bench.blocks import block_models

    names = s.models or (DEFAULT_MODELS if s.blocks else DEFAULT_MODELS[:3])
    base = bench_models(s, g, channels_last_cnn=True)  # (drawn first, always: the blocks' batches stay put)
    out = [(*m, "w8a8") for key, m in zip(("mlp", "cnn", "cnn_cl"), base) if key in names]
    blocks = tuple(n for n in MODELS[3:] if n in names)
    return out + block_models(s, g, quick=s.quick_blocks, names=blocks)


def make_mlp(s: ModulesSettings) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = s.mlp_in
    for _ in range(s.mlp_hidden):
        layers += [nn.Linear(width, s.mlp_width), nn.ReLU()]
        width = s.mlp_width
    return nn.Sequential(*layers, nn.Linear(width, s.classes))


def make_cnn(s: ModulesSettings) -> nn.Sequential:
    layers: list[nn.Module] = []
    c_in = 3
    for c in s.cnn_channels:
        layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)]
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, s.classes))


# ---------------------------------------------------------------------------------------------
# Flavours: float model (+ a batch for calibration) -> (training model, deploy fn or None)
# ---------------------------------------------------------------------------------------------

Deploy = Callable[[nn.Module, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def _export(model: nn.Module, x: torch.Tensor):
    return torch.export.export(model, (x,)).module()


def _fp32(m, x, s):
    return m, None


def _intqat_fq(m, x, s):
    intqat.prepare_qat(m, s.preset)
    return m, lambda t, xx: _export(intqat.to_deployed(intqat.to_integer(copy.deepcopy(t))), xx)


def _intqat_int(m, x, s):
    intqat.prepare_qat(m, s.preset)
    intqat.calibrate(m, [x] * s.calib_batches)
    intqat.to_integer(m)
    return m, lambda t, xx: _export(intqat.to_deployed(t), xx)


def _torchao_qat(m, x, s):
    if s.preset == "8da4w":
        return _torchao_qat_8da4w(m), lambda t, xx: _torchao_8da4w_deploy(t)
    return peers.torchao_qat(m), lambda t, xx: peers.torchao_qat_deploy(t)


def _torchao_qat_8da4w(m):
    """torchao's 8da4w QAT as its docs set it up: int8 per-token (asymmetric: 0.18 has no symmetric per-token fake
    quant) activations, int4 symmetric weights in groups of 32 (intqat's 8da4w preset's group size)."""
    tq, qat = peers._torchao()
    act = qat.IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    wgt = qat.IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True)
    tq.quantize_(m, qat.QATConfig(activation_config=act, weight_config=wgt, step="prepare"))
    return m


def _torchao_8da4w_deploy(m):
    tq, qat = peers._torchao()
    d = copy.deepcopy(m).eval()
    tq.quantize_(d, qat.QATConfig(step="convert"))
    tq.quantize_(d, tq.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=tq.PerGroup(32)))
    return d


def _torchao_mp(m, x, s):
    return peers.torchao_int8_mp(m), lambda t, xx: peers.torchao_int8_mp_deploy(t)


def _torch_ao(m, x, s):
    return peers.torch_ao_qat(m), lambda t, xx: peers.torch_ao_deploy(t)


FP32 = "fp32"
INTQAT_FQ = "intqat fake-quant w8a8"
INTQAT_INT = "intqat integer w8a8"
TORCHAO_QAT = "torchao QAT"
TORCHAO_MP = "torchao int8 mixed-precision"
TORCH_AO = "torch.ao QAT x86"

FLAVOURS: dict[str, Callable] = {
    FP32: _fp32,
    INTQAT_FQ: _intqat_fq,
    INTQAT_INT: _intqat_int,
    TORCHAO_QAT: _torchao_qat,
    TORCHAO_MP: _torchao_mp,
    TORCH_AO: _torch_ao,
}


@dataclass
class Run:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    deploy: Deploy | None
    x: torch.Tensor
    y: torch.Tensor
    results: dict = field(default_factory=dict)

    def forward_backward(self):
        loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()

    def step_no_zero(self):
        self.forward_backward()
        self.opt.step()

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        self.step_no_zero()

    def eval_forward(self):
        """a validation batch as Lightning runs it: eval mode (set by the caller), inference_mode"""
        with torch.inference_mode():
            self.model(self.x)


def _first_line(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def _mismatch(run: Run) -> tuple[float | None, float | None, bool, str | None]:
    """-> (max |Δ|, max |Δ| / max |y|, exactly equal, why n/a)."""
    model = run.model
    if TORCH_AO in run.name:  # freeze observers: an eval forward would still move their ranges
        import torch.ao.quantization as tq

        model.apply(tq.disable_observer)
    model.eval()
    try:
        with torch.no_grad():
            y_train = model(run.x)
            program = run.deploy(model, run.x)
            y_dep = program(run.x)
    except Exception as e:  # a peer whose deploy path cannot run here is reported; intqat's must run
        if run.name.startswith("intqat"):
            raise
        return None, None, False, _first_line(e)
    finally:
        model.train()
    diff = (y_train.float() - y_dep.float()).abs().max().item()
    scale = y_train.float().abs().max().item()
    return diff, (diff / scale if scale else None), torch.equal(y_train, y_dep), None


def _bench_model(make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor,
                 s: ModulesSettings) -> tuple[list[Run], dict[str, str], dict]:
    runs: list[Run] = []
    missing: dict[str, str] = {}
    for name, build in FLAVOURS.items():
        torch.manual_seed(s.seed)  # every flavour starts from the same float weights
        try:
            model, deploy = build(make(), x, s)
            model.train()
            run = Run(name, model, build_optimizer(model.parameters(), "adam", lr=s.lr, fused=s.fused_optimizer),
                      deploy, x, y)
            run.step()  # fails here, not inside the timer, if a peer cannot train on this machine
        except peers.Unavailable as e:
            missing[name] = str(e)
            continue
        except Exception as e:  # a peer that cannot train here is reported; intqat failing is a bug: raise
            if name.startswith("intqat"):
                raise
            missing[name] = f"training step failed: {_first_line(e)}"
            continue
        runs.append(run)
    timings = time_interleaved({r.name: r.step for r in runs}, s.repeats, s.warmup, min_time=0.0)
    for r in runs:
        r.model.eval()
    try:
        eval_timings = time_interleaved({r.name: r.eval_forward for r in runs}, s.repeats, s.warmup, min_time=0.0)
    finally:
        for r in runs:
            r.model.train()
    for r in runs:
        r.results["eval"] = eval_timings[r.name]
        r.opt.zero_grad(set_to_none=True)
        st = state_bytes(r.model, r.opt)
        peak = peak_transient_bytes(r.step_no_zero)
        r.opt.zero_grad(set_to_none=True)
        params = list(r.model.parameters())
        saved, loss = saved_bytes(lambda r=r: F.cross_entropy(r.model(r.x), r.y), exclude=params)
        del loss
        r.results.update(state=st, transient=peak, peak=None if peak is None else st + peak, saved=saved)
        if r.name.startswith("intqat"):
            r.results["backends"] = backends_used(r.step)  # which implementation ran each primitive
        if r.deploy is not None:
            r.results["mismatch"] = _mismatch(r)
    return runs, missing, timings


_DEPLOYED_INT_MM = ("intqat: the deployed program multiplies with aten._int_mm, which the self-check refused on "
                    "this machine (SELF-CHECK REFUSED above; the training step did not use it): this is that "
                    "GEMM's error. Where intqat.ops.check_int_mm() passes, the deployed program equals the "
                    "integer model bit for bit")


def deploy_cells(name: str, mm: tuple | None, int_mm_refused: bool, mark: Callable[[str], str]) -> tuple[str, str]:
    """The table's (deploy max|Δ|, rel |Δ|) cells of one row. mm: (max abs, rel or None, exactly zero, error or None)
    (`_mismatch`), None for a flavour with no deploy step; mark(reason) -> its footnote mark. An intqat row's nonzero
    mismatch where the self-check refused torch._int_mm is marked as that GEMM's (_DEPLOYED_INT_MM)."""
    if mm is None:
        return "-", "-"
    if mm[3] is not None:
        cell = f"{NA} {mark(f'{name}: deploy path failed: {mm[3]}')}"
        return cell, cell
    d_cell = "0" if mm[2] else f"{mm[0]:.2e}"
    rel_cell = "0" if mm[2] else (NA if mm[1] is None else f"{mm[1]:.1e}")
    if not mm[2] and name.startswith("intqat") and int_mm_refused:
        d_cell += f" {mark(_DEPLOYED_INT_MM)}"
    return d_cell, rel_cell


def run_modules(s: ModulesSettings = ModulesSettings(), info: dict | None = None) -> Table:
    info = info or machine_info()
    g = torch.Generator().manual_seed(s.seed)
    cols = ["candidate", "step ms", "speed vs fp32", "eval speed vs fp32", "peak MiB", "peak vs fp32", "saved MiB", "deploy max|Δ|", "rel |Δ|"]
    t = Table(
        title="intqat-bench modules   train step = zero_grad, forward, cross-entropy, backward, Adam.step "
              f"({'fused' if s.fused_optimizer else 'per-parameter loop'})",
        header_lines=[
            *machine_lines(info),
            f"timing: {s.repeats} repeats, interleaved round-robin over the flavours of a model, median; "
            f"warm-up {1 + s.warmup} steps",
        ],
        columns=cols,
    )
    models = selected_models(s, g)
    na_marks: dict[str, str] = {}

    def mark(reason: str) -> str:
        if reason not in na_marks:
            na_marks[reason] = f"[{len(na_marks) + 1}]"
        return na_marks[reason]

    summary: list[str] = []
    backends_ran: list[str] = []
    # the deployed program runs aten._int_mm whatever trained it: where the self-check refused that GEMM, an intqat
    # row's deploy mismatch is that GEMM's error (the row's footnote says so), not the integer model's
    int_mm_refused = "torch._int_mm" in info.get("gemms_refused", {})
    for title, make, x, preset in models:
        y = torch.randint(0, s.classes, (x.shape[0],), generator=g)
        runs, missing, timings = _bench_model(make, x, y, replace(s, preset=preset))
        t.group(title)
        by = {r.name: r for r in runs}
        fp = by.get(FP32)
        for name in FLAVOURS:
            if name in missing:
                t.add([f"{name.replace('w8a8', preset)} {mark(missing[name])}"] + [NA] * (len(cols) - 1),
                      {"model": title, "name": name, "preset": preset, "unavailable": missing[name]})
                continue
            r, tm = by[name], timings[name]
            res = r.results
            speed = speed_ratio(timings[FP32], tm) if fp else None
            eval_speed = speed_ratio(fp.results["eval"], res["eval"]) if fp else None
            peak_ratio = res["peak"] / fp.results["peak"] if fp and res["peak"] and fp.results["peak"] else None
            mm = res.get("mismatch")
            d_cell, rel_cell = deploy_cells(name, mm, int_mm_refused, mark)
            t.add(
                [name.replace("w8a8", preset), fmt_num(tm.median * 1e3), fmt_ratio(speed), fmt_ratio(eval_speed),
                 fmt_bytes(res["peak"]), fmt_ratio(peak_ratio),
                 fmt_bytes(res["saved"]), d_cell, rel_cell],
                {"model": title, "name": name, "preset": preset, "median_s": tm.median, "times_s": tm.times, "speed_vs_fp32": speed,
                 "eval_median_s": res["eval"].median, "eval_speed_vs_fp32": eval_speed,
                 "peak_bytes": res["peak"], "state_bytes": res["state"], "transient_bytes": res["transient"],
                 "peak_vs_fp32": peak_ratio, "saved_bytes": res["saved"],
                 "mismatch_max_abs": None if mm is None else mm[0], "mismatch_rel": None if mm is None else mm[1],
                 "mismatch_exact_zero": None if mm is None else mm[2], "deploy_error": None if mm is None else mm[3]},
            )
        if INTQAT_INT in timings:
            parts = [f"{peer} {speed_ratio(timings[peer], timings[INTQAT_INT]):.2f}x"
                     for peer in (FP32, TORCHAO_MP, TORCHAO_QAT, TORCH_AO, INTQAT_FQ) if peer in timings]
            summary.append(f"{title.split(',')[0]}: speed of intqat integer relative to " + ", ".join(parts))
            backends_ran.append(f"{title.split(',')[0]}: {by[INTQAT_INT].results['backends']}")
    t.footnotes = [
        "speed: median over repeats of t_fp32 / t_candidate (> 1 = faster). " + " | ".join(summary),
        "eval speed: the same for one validation forward of the batch (model.eval(), torch.inference_mode; "
        "intqat integer: the eager integer layers, not the deployed program), timed after the train steps.",
        "backends that ran intqat integer's primitives (intqat.ops.backends; GEMMs by name, passes = the "
        "elementwise passes): " + " | ".join(backends_ran),
        "peak = parameters + buffers + Adam state alive at step start (grads set to None) + the step's peak net "
        "allocation by torch's CPU allocator (torch.profiler profile_memory allocation events: exact and "
        "deterministic, unlike RSS, which measures glibc's heap caching and fragmentation; memory that "
        "oneDNN/MKL allocate outside torch's allocator is not included). saved: bytes kept for backward by one "
        "forward (saved_tensors_hooks, one count per storage, parameters excluded).",
        "deploy max|Δ|: max |eval-mode forward of the trained model - its deployed program| on the training batch; "
        "rel = / max|y|. intqat: torch.export.export(intqat.to_deployed(model)).module() (fake-quant: after "
        "to_integer on a copy); torchao QAT: QATConfig(step='convert') then quantize_(Int8DynamicActivationInt8"
        "WeightConfig(act_mapping_type=ASYMMETRIC)) on a copy; torchao int8 mixed-precision (not QAT, no deploy "
        "step of its own): quantize_(Int8DynamicActivationInt8WeightConfig()) on a copy; torch.ao: "
        "torch.ao.quantization.convert on the x86 engine (observers disabled first). torch.ao's x86 qconfig "
        "fake-quantizes activations to codes [0, 127] (reduce_range) but its converted kernels output [0, 255]: "
        "activations beyond the moving-average range clip in training and not in deployment.",
        f"intqat integer: prepare_qat('w8a8') (the Llama block: '8da4w', and torchao QAT with int4 weights in groups "
        f"of 32), calibrate on {s.calib_batches} batch(es), to_integer; activation "
        "observers stay on while training (moving average), convs fold BN with running statistics. torchao "
        "(QAT and int8 mixed-precision) only swaps nn.Linear: in the CNN its convs run in fp32 and only the head "
        "is quantized. torchao QAT activations are per-token asymmetric (0.18 has no symmetric per-token fake quant).",
    ]
    for reason, m in na_marks.items():
        t.footnotes.append(f"{m} {reason}")
    t.meta = {"machine": info, "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.__dict__.items()}}
    return t
