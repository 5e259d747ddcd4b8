"""`intqat-bench gpu`: intqat's Triton kernels against their peers, on a CUDA device.

    int_mm            vs torch._int_mm (cuBLASLt), 4096^3 and the MLP's shapes    target >= 0.9x its throughput
    int_linear f+b    vs bf16 F.linear f+b, M=8192 K=N=4096, and torchao's int8 mixed-precision training
                                                                                 target <= 0.7x bf16's time
    train steps       MLP and transformer block: fp32, bf16 autocast, intqat int8 (fused AdamW)

Where no CUDA device is present it measures nothing: it says so and exits with NO_GPU_EXIT (3),
so scripts can tell "no GPU" from a failure (1) or bad arguments (2). Nothing here has been run
on a GPU yet: the project's machines have none (README, "Triton kernels on NVIDIA GPUs").
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["NO_GPU_EXIT", "no_gpu_reason", "main"]

NO_GPU_EXIT = 3


def no_gpu_reason() -> Optional[str]:
    """Why this process cannot run the GPU bench, or None when it can."""
    import os

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (f"intqat-bench gpu needs a CUDA device, and torch.cuda.is_available() is False here (torch "
                f"{torch.__version__}, {build}). Nothing was measured. Run it on a machine with an NVIDIA GPU; "
                f"`intqat-bench kernels` checks the kernels' GPU build without one.")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return ("intqat-bench gpu: TRITON_INTERPRET is set, so the Triton kernels would run in the interpreter, "
                "not on the GPU. Unset it.")
    return None


def _ms(fn: Callable[[], object], quick: bool, repeats: Optional[int]) -> float:
    """Median milliseconds per call (triton.testing.do_bench: CUDA events, L2 flushed between calls)."""
    import triton.testing

    rep = 20 if quick else 100 * (repeats or 1)
    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=rep, return_mode="median"))


def _row(name: str, ms: Optional[float], anchor_ms: Optional[float], flops: Optional[float] = None,
         note: str = "") -> dict:
    return {"name": name, "ms": ms, "vs_anchor": None if ms is None or anchor_ms is None else ms / anchor_ms,
            "tflops": None if ms is None or flops is None else flops / ms / 1e9, "note": note}


def _try(name: str, fn: Callable[[], float], anchor: Optional[float], flops: Optional[float] = None,
         note: str = "") -> dict:
    try:
        return _row(name, fn(), anchor, flops, note)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is named in the table, not fatal
        return _row(name, None, anchor, flops, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")


def bench_int_mm(shapes: list[tuple[int, int, int]], quick: bool, repeats: Optional[int]) -> list[dict]:
    from intqat.ops import int_mm

    rows = []
    for M, K, N in shapes:
        a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device="cuda")
        b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device="cuda").t()  # (K, N) column-major: cuBLASLt's
        if not torch.equal(int_mm(a, b), torch._int_mm(a, b)):
            raise AssertionError(f"int_mm != torch._int_mm at M={M} K={K} N={N}: the kernel is wrong on this GPU")
        flops = 2.0 * M * N * K
        anchor = _ms(lambda: torch._int_mm(a, b), quick, repeats)
        rows.append(_row(f"torch._int_mm {M}x{K}x{N}", anchor, anchor, flops))
        rows.append(_try(f"intqat int_mm {M}x{K}x{N}", lambda: _ms(lambda: int_mm(a, b), quick, repeats), anchor, flops,
                         "target: >= 0.9x torch._int_mm's TFLOP/s, i.e. vs_anchor <= 1.11"))
    return rows


def _fwd_bwd(layer: Callable, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    def step():
        x.grad = None
        layer(x).backward(g)

    return step


def bench_linear(M: int, K: int, N: int, quick: bool, repeats: Optional[int]) -> list[dict]:
    from intqat.bench import peers
    from intqat.ops import choose_qparams, int_linear

    torch.manual_seed(0)
    base = nn.Linear(K, N, device="cuda")
    x32 = torch.randn(M, K, device="cuda", requires_grad=True)
    g32 = torch.randn(M, N, device="cuda")
    flops = 6.0 * M * N * K  # forward + both backward GEMMs

    bf = nn.Linear(K, N, device="cuda", dtype=torch.bfloat16)
    xb = x32.detach().to(torch.bfloat16).requires_grad_()
    anchor = _ms(_fwd_bwd(bf, xb, g32.to(torch.bfloat16)), quick, repeats)
    rows = [_row(f"bf16 F.linear fwd+bwd M={M} K={K} N={N}", anchor, anchor, flops)]

    x_scale, x_zp = choose_qparams(x32.detach(), bits=8, symmetric=False, granularity="tensor")

    def intqat_layer(x):
        return int_linear(x, base.weight, base.bias, x_scale, x_zp.to(torch.float32), None)

    rows.append(_try("intqat int_linear w8a8 fwd+bwd (fp32 master)", lambda: _ms(_fwd_bwd(intqat_layer, x32, g32),
                                                                               quick, repeats),
                     anchor, flops, "target: <= 0.7x bf16's time"))

    def torchao_ms():
        layer = peers.torchao_int8_mp(nn.Linear(K, N, device="cuda", dtype=torch.bfloat16))
        return _ms(_fwd_bwd(layer, xb, g32.to(torch.bfloat16)), quick, repeats)

    rows.append(_try("torchao int8 mixed-precision fwd+bwd (bf16)", torchao_ms, anchor, flops))
    return rows


class Block(nn.Module):
    """A pre-norm transformer block: attention (q, k, v, out Linear) and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, dim)
        B, T, D = x.shape
        h = self.norm1(x).reshape(B * T, D)  # intqat's linear takes (M, K)
        q, k, v = (p(h).reshape(B, T, self.heads, D // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B * T, D)
        x = x + self.out(a).reshape(B, T, D)
        h = self.norm2(x).reshape(B * T, D)
        return x + self.down(F.gelu(self.up(h))).reshape(B, T, D)


def _train_step(model: nn.Module, x: torch.Tensor, autocast: bool) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def bench_steps(quick: bool, repeats: Optional[int]) -> list[dict]:
    import intqat
    from intqat.bench.modules import ModulesSettings, make_mlp

    s = ModulesSettings.quick() if quick else ModulesSettings()
    dim, tokens = (128, 64) if quick else (1024, 2048)
    builders = {
        "MLP": (lambda: make_mlp(s), lambda: torch.randn(s.mlp_batch, s.mlp_in, device="cuda")),
        "transformer block": (lambda: Block(dim, 16 if dim >= 1024 else 4),
                              lambda: torch.randn(tokens // 512 or 1, min(tokens, 512), dim, device="cuda")),
    }
    rows = []
    for name, (make, data) in builders.items():
        x = data()
        torch.manual_seed(0)
        anchor = _ms(_train_step(make().cuda(), x, autocast=True), quick, repeats)
        rows.append(_row(f"{name} step, bf16 autocast", anchor, anchor))
        rows.append(_try(f"{name} step, fp32", lambda: _ms(_train_step(make().cuda(), x, False), quick, repeats), anchor))

        def intqat_ms():
            m = make().cuda()
            intqat.prepare_qat(m, "w8a8")
            intqat.calibrate(m, [x] * s.calib_batches)
            intqat.to_integer(m)
            return _ms(_train_step(m, x, autocast=False), quick, repeats)

        rows.append(_try(f"{name} step, intqat int8 (w8a8)", intqat_ms, anchor))
    return rows


def format_rows(title: str, rows: list[dict]) -> str:
    from intqat.bench.table import Table, fmt_num, fmt_ratio

    t = Table(title=title, header_lines=[f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
                                         f"torch {torch.__version__}"],
              columns=["candidate", "ms", "vs first row", "TFLOP/s", "note"])
    for r in rows:
        t.add([r["name"], fmt_num(r["ms"]), fmt_ratio(r["vs_anchor"]), fmt_num(r["tflops"]), r["note"]], r)
    return t.render()


def main(quick: bool = False, repeats: Optional[int] = None, json_out: Optional[dict] = None) -> int:
    """Run the GPU bench; NO_GPU_EXIT (with a message on stderr) where there is no CUDA device."""
    reason = no_gpu_reason()
    if reason is not None:
        print(reason, file=sys.stderr, flush=True)
        return NO_GPU_EXIT if not torch.cuda.is_available() else 2
    from intqat.bench.modules import ModulesSettings

    s = ModulesSettings.quick() if quick else ModulesSettings()
    mm_shapes = [(256, 128, 128)] if quick else [(4096, 4096, 4096), (s.mlp_batch, s.mlp_in, s.mlp_width)]
    sections = {
        "int_mm": bench_int_mm(mm_shapes, quick, repeats),
        "linear": bench_linear(*((256, 256, 256) if quick else (8192, 4096, 4096)), quick, repeats),
        "steps": bench_steps(quick, repeats),
    }
    for name, rows in sections.items():
        print(format_rows(f"intqat-bench gpu: {name}", rows), end="\n\n", flush=True)
    if json_out is not None:
        json_out["gpu"] = sections
    return 0
