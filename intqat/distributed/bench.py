"""FSDP2 training steps on CPU processes (gloo): the integer stage with int8 all-gathers against fp32 FSDP2.

    python -m intqat.distributed.bench                    # both models, 2 processes
    python -m intqat.distributed.bench --model mlp --repeats 30 --json out.json

Per model, three copies of the same weights, each sharded with fully_shard (every layer / GPT block, then
the root), trained side by side on the same batches:
    fp32             the float model under FSDP2 (the anchor)
    integer, fp32 AG intqat's integer stage, FSDP2 all-gathering the fp32 weights
    integer, int8 AG intqat's integer stage, FSDP2 all-gathering int8 codes + row absmax (the default)
and per step it reports the bytes each rank all-gathers (its shards; FSDP2's all-gather output is
world_size times that) and the step time (forward, backward, SGD step).

Timing (the machine is shared): one thread per process, steps of the three interleaved (round-robin, order
rotated per repeat), the CPU time of each process (time.process_time: the compute and the gloo copies, not
the waits), the slower rank's per repeat, median over repeats; ratios are medians of per-repeat ratios
to fp32. Wall-clock medians are printed too: on an idle machine they are the ones to read.

Models: `mlp`, 4 Linear layers 1024 wide (batch 256 per rank), w8a8; `gpt`, the text recipe's GPT (4 blocks,
width 128, context 128, tied embeddings; 16 windows per rank), w8a8_dynamic with int8 embeddings.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["main", "run"]

VARIANTS = ("fp32", "integer, fp32 AG", "integer, int8 AG")


def _mlp() -> tuple[nn.Module, list[nn.Module], object, callable]:
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(1024, 1024), nn.ReLU())], nn.Linear(1024, 1024))
    layers = [m for m in model if isinstance(m, nn.Linear)]

    def batch(g):
        return torch.randn(256, 1024, generator=g), None

    def loss(model, x, _):
        return model(x).square().mean()

    return model, layers, "w8a8", batch, loss


def _gpt():
    from intqat.models import GPT

    model = GPT(vocab_size=256, context=128, d_model=128, n_layers=4, n_heads=4, mlp_ratio=4)
    config = {"preset": "w8a8_dynamic", "embedding": {"bits": 8, "granularity": "channel"}}

    def batch(g):
        idx = torch.randint(0, 256, (16, 129), generator=g)
        return idx[:, :-1], idx[:, 1:]

    def loss(model, x, y):
        return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    return model, list(model.blocks), config, batch, loss


MODELS = {"mlp": _mlp, "gpt": _gpt}


def _shard(model: nn.Module, units: list[nn.Module]) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in units:
        fully_shard(m)
    fully_shard(model)


def _units(model: nn.Module, name: str) -> list[nn.Module]:
    if name == "mlp":
        return [m for m in model if isinstance(m, nn.Linear)]
    return list(model.blocks)


def _bench_model(rank: int, world: int, name: str, repeats: int, steps: int) -> dict:
    import intqat
    from intqat.distributed import int8_gather
    from intqat.distributed.traffic import count_all_gathers

    torch.manual_seed(0)
    base, _, config, make_batch, loss_fn = MODELS[name]()
    g = torch.Generator().manual_seed(1 + rank)
    models = {}
    for v in VARIANTS:
        m = copy.deepcopy(base)
        _shard(m, _units(m, name))
        models[v] = m
    counters = {v: count_all_gathers(m) for v, m in models.items()}
    opts = {v: torch.optim.SGD(m.parameters(), lr=1e-4) for v, m in models.items()}

    def step(v: str, x, y) -> None:
        loss_fn(models[v], x, y).backward()
        opts[v].step()
        opts[v].zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (FSDP2's view warning on GPT's outputs; the report below says what crosses)
        for v in VARIANTS[1:]:
            intqat.prepare_qat(models[v], config)
            for _ in range(2):  # observe activation ranges in the fake-quant stage
                step(v, *make_batch(torch.Generator().manual_seed(7)))
            intqat.freeze_observers(models[v])
            intqat.to_integer(models[v])
        int8_gather.disable(models["integer, fp32 AG"])
        report = int8_gather.enable(models["integer, int8 AG"], warn=False)
        batches = [make_batch(g) for _ in range(4)]
        for v in VARIANTS:  # warm-up: lazy init, C++ ops, allocator
            for x, y in batches[:2]:
                step(v, x, y)
        cpu = {v: [] for v in VARIANTS}
        wall = {v: [] for v in VARIANTS}
        bytes_out = {}
        for r in range(repeats):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for v in order:
                counters[v].reset()
                dist.barrier()
                t0, w0 = time.process_time(), time.perf_counter()
                for i in range(steps):
                    step(v, *batches[(r * steps + i) % len(batches)])
                t = torch.tensor([(time.process_time() - t0) / steps, (time.perf_counter() - w0) / steps])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank's
                cpu[v].append(float(t[0]))
                wall[v].append(float(t[1]))
                bytes_out[v] = counters[v].bytes_out // steps
    result = {"model": name, "world_size": world, "int8_weights": sorted(n for n, why in report.items() if why == "int8"),
              "fp32_weights": {n: why for n, why in report.items() if why != "int8"}, "variants": {}}
    for v in VARIANTS:
        result["variants"][v] = {
            "bytes_all_gathered_per_step": bytes_out[v],
            "bytes_vs_fp32": bytes_out[v] / bytes_out["fp32"],
            "cpu_ms": 1e3 * statistics.median(cpu[v]),
            "cpu_vs_fp32": statistics.median(a / b for a, b in zip(cpu[v], cpu["fp32"])),
            "wall_ms": 1e3 * statistics.median(wall[v]),
            "wall_vs_fp32": statistics.median(a / b for a, b in zip(wall[v], wall["fp32"])),
        }
    return result


def _worker(rank: int, world: int, names: list[str], repeats: int, steps: int, out: str) -> None:
    results = [_bench_model(rank, world, n, repeats, steps) for n in names]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def run(models: list[str], world_size: int = 2, repeats: int = 15, steps: int = 2, timeout: float = 1800) -> list[dict]:
    """The bench on `world_size` spawned processes; returns one result dict per model."""
    import os
    import tempfile

    from intqat.distributed.launch import run_processes

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        run_processes(_worker, world_size, args=(models, repeats, steps, out), timeout=timeout)
        with open(out) as f:
            return json.load(f)


def format_results(results: list[dict]) -> str:
    from intqat.ops.cpu_features import cpu_class, cpu_info

    lines = [f"# FSDP2 steps, {results[0]['world_size']} CPU processes (gloo, 1 thread each) on {cpu_info()[0]} "
             f"({cpu_class()}); torch {torch.__version__}",
             "# step = forward + backward + SGD step; CPU time per process (slower rank), median; ratios to fp32 FSDP2",
             ""]
    for r in results:
        lines.append(f"{r['model']}: int8 all-gather on {len(r['int8_weights'])} weights"
                     + (f"; fp32 for {', '.join(f'{n} ({w})' for n, w in r['fp32_weights'].items())}"
                        if r["fp32_weights"] else ""))
        lines.append(f"  {'variant':18s} {'AG bytes/step':>14s} {'x fp32':>7s} {'CPU ms':>8s} {'x fp32':>7s} "
                     f"{'wall ms':>8s} {'x fp32':>7s}")
        for v, d in r["variants"].items():
            lines.append(f"  {v:18s} {d['bytes_all_gathered_per_step']:>14,d} {d['bytes_vs_fp32']:>7.3f} "
                         f"{d['cpu_ms']:>8.2f} {d['cpu_vs_fp32']:>7.2f} {d['wall_ms']:>8.2f} {d['wall_vs_fp32']:>7.2f}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m intqat.distributed.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--processes", type=int, default=2, help="FSDP2 ranks (CPU processes, gloo)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (the median is over them)")
    p.add_argument("--steps", type=int, default=2, help="training steps per measurement")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    names = list(MODELS) if a.model == "all" else [a.model]
    results = run(names, a.processes, a.repeats, a.steps)
    print(format_results(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
