"""intqat-graphs (intqat.cli.graphs) and the compile benchmark (intqat.bench.compile).

The CLI runs in-process on the default recipe with a small MLP whose hidden layers are identical
(model.hidden=[16,16,16]: features.3 and features.5 are both 16 -> 16 on the same batch), so
deduplication must collapse them. trials=2, validated with aot_eager in `make test`; with inductor (the
CLI's default: every stage pays one cold compile) under `make test-slow`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from intqat.cli import graphs as cli
from intqat.graphs.referee import referee

SMALL_MLP = ["recipe=mlp_digits_w8a8", "model.hidden=[16,16,16]", "data.batch_size=16"]


@pytest.fixture(autouse=True, scope="module")
def _compile_in_process():
    """Inductor compiles in this process: on 2 cores, starting and feeding the compile worker pool
    costs more than it saves for these small graphs (about a third of a cold run's wall time)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


def _hash_dirs(out: Path) -> list[Path]:
    return sorted(d for d in out.iterdir() if d.is_dir() and (d / "graph_hash.txt").is_file())


@pytest.mark.parametrize("backend", [
    "aot_eager",
    # inductor, the default: three cold compiles (~30 s here) on top of the extraction (~17 s). In `make test`
    # intqat's integer layers under inductor are validated by tests/test_graphs.py (a conv -> linear model)
    # and tests/test_int_linear.py; the fake-quant stage under inductor is checked here only.
    pytest.param("inductor", marks=pytest.mark.slow),
])
def test_mlp_recipe_every_stage_extracted_deduplicated_and_validated(tmp_path, capsys, backend):
    out = tmp_path / "graphs"
    status = cli.main([*SMALL_MLP, "--trials", "2", "--backend", backend, "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed

    index = json.loads((out / "index.json").read_text())
    assert list(index["stages"]) == ["float", "fake_quant", "integer"]
    tsv = (out / "index.tsv").read_text().splitlines()
    assert tsv[0].split("\t") == ["stage", "layer", "module", "hash_dir"]
    rows = [line.split("\t") for line in tsv[1:]]
    layers = ["features.1", "features.3", "features.5", "head"]
    assert len(rows) == 3 * (1 + len(layers))  # the model and each layer, per stage

    dirs = _hash_dirs(out)
    assert {d.name for d in dirs} == {r[3] for r in rows} == set(index["graphs"])
    for d in dirs:
        assert {"forward.py", "backward.py", "graph_hash.txt", "summary.json", "members.txt"} <= {p.name for p in d.iterdir()}
    # identical layers collapse into one directory; different ones do not
    assert len(dirs) < len(rows) == index["captured_graphs"]
    assert index["distinct_graphs"] == len(dirs)
    for stage, entry in index["stages"].items():
        by_layer = entry["layers"]
        assert by_layer["features.3"] == by_layer["features.5"], stage
        assert len({by_layer["features.1"], by_layer["features.3"], by_layer["head"]}) == 3, stage
        members = (out / by_layer["features.3"] / "members.txt").read_text().split()
        assert {f"{stage}/features.3", f"{stage}/features.5"} <= set(members)
        assert entry["ok"] and entry["error"] is None and not entry["layer_errors"]
        assert entry["validation"]["passed"]
        assert entry["validation"]["trial_status"] == ["pass", "pass"]  # not even a fluctuation
        assert entry["summary"]["regions"] == 1 and not entry["graph_breaks"]
        assert not entry["summary"]["integer_grads"]
    # stages differ: no graph is shared between float, fake quant and integer
    assert len({e["model"] for e in index["stages"].values()}) == 3
    integer = index["stages"]["integer"]["summary"]
    assert integer["integer_ops"] > 0 and integer["ste_kernels"] > 0
    assert index["stages"]["float"]["summary"]["integer_ops"] == 0

    assert "every stage extracted and validated" in printed
    assert printed.count("PASSED") == 3
    assert "STE kernels in backward" in printed
    assert (out / "report.txt").read_text().count("PASSED") == 3

    # a second run into the same directory replaces its own graphs, leaves the rest alone
    (out / "notes.txt").write_text("mine")
    assert cli.main([*SMALL_MLP, "--trials", "0", "--stages", "integer", "--no-layers", "--out", str(out)]) == 0
    capsys.readouterr()
    assert [d.name for d in _hash_dirs(out)] == [index["stages"]["integer"]["model"]]
    assert (out / "notes.txt").read_text() == "mine"


def test_cnn_fake_quant_with_live_batchnorm_is_extracted(tmp_path, capsys):
    """Conv+BN fake quant mutates BN's running stats, which the fold also reads: extraction must
    still succeed (it failed at backward before intqat-graphs kept input mutations in the graph)."""
    out = tmp_path / "cnn"
    status = cli.main(["recipe=cnn_digits_w8a8", "data.batch_size=8", "model.channels=[4,4]", "--stages", "fake_quant",
                       "--trials", "0", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed  # fake-quant graph breaks are reported, not fatal
    stage = json.loads((out / "index.json").read_text())["stages"]["fake_quant"]
    assert stage["error"] is None and not stage["layer_errors"]
    assert set(stage["layers"]) == {"features.0.0", "features.1.0", "head"}
    assert stage["summary"]["integer_ops"] > 0
    # any graph break is located (file:line) in the report
    assert all(":" in b for b in stage["graph_breaks"])
    assert (stage["summary"]["regions"] > 1) == bool(stage["graph_breaks"])


class _ReadThenMutate(nn.Module):
    """BatchNorm's pattern in a fake-quant Conv+BN: a buffer read for the output, then updated in place.
    torch 2.13's min-cut partitioner recomputes the read in the backward, after the update."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.register_buffer("rv", torch.rand(4) + 0.5)

    def forward(self, x):
        y = x * (self.gamma * torch.rsqrt(self.rv + 1e-5))
        with torch.no_grad():
            self.rv.mul_(0.9).add_(0.1 * y.var(0))
        return y


class _SloppyEagerFp32(nn.Module):
    """Eager fp32 rounds through fp16 (as a long fp32 accumulation loses digits); compiled does not."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x):
        y = x * self.w
        if x.dtype == torch.float32 and not torch.compiler.is_compiling():
            y = y.half().float()
        return y


def _loss(out):
    return out.float().pow(2).sum()


def test_referee_clears_eager_rounding_and_keeps_real_miscompiles():
    opts = cli.GraphsOptions(backend="aot_eager")  # same dynamo + aot_autograd (min-cut) path, no codegen
    x = torch.randn(8, 4)
    sloppy = referee(_SloppyEagerFp32(), x, _loss, ["grad.w", "loss", "output"], opts)
    assert sloppy.error is None and sloppy.cleared, sloppy.to_table()
    assert {r.verdict for r in sloppy.rows} <= {"eager less accurate", "compiled within tolerance of fp64"}
    assert max(r.compiled_vs_eager for r in sloppy.rows) > 1e-4  # a real disagreement was arbitrated

    wrong = referee(_ReadThenMutate(), x, _loss, ["grad.gamma"], opts)
    assert wrong.error is None and not wrong.cleared, wrong.to_table()
    (row,) = wrong.rows
    assert row.verdict == "compiled wrong" and row.compiled_vs_fp64 > 100 * row.eager_vs_fp64


def test_unknown_recipe_lists_the_available_ones(capsys):
    assert cli.main(["recipe=no_such_recipe"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'no_such_recipe'" in err
    assert "mlp_digits_w8a8" in err and "cnn_digits_w8a8" in err


@pytest.mark.parametrize("argv, message", [
    (["--trials", "many"], "--trials: invalid an integer >= 0 value: 'many'"),
    (["--stages", "float,bogus"], "--stages: invalid a comma-separated subset of float,fake_quant,integer"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
    (["recipe=mlp_digits_w8a8", "model.no_such_key=1"], "no_such_key"),
    (["--checkpoint", "/nonexistent/last.ckpt"], "does not exist"),
    (["trials=2"], "'trials=2': intqat-graphs takes its own options as flags (--trials ...)"),
    (["recipe=mlp_digits_w8a8", "recipe=cnn_digits_w8a8"], "recipe given 2 times"),
])
def test_bad_command_lines_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: intqat-graphs")
    assert "--checkpoint PATH" in out and "mlp_digits_w8a8" in out


@pytest.mark.slow  # two cold inductor compiles (~40 s here); the property in `make test`: tests/test_graphs.py
def test_compile_bench_quick_gives_finite_positive_times():
    from intqat.bench.compile import COMPILED, EAGER, format_table, run_compile_bench

    rows = run_compile_bench(quick=True)
    assert [r["candidate"] for r in rows] == [EAGER, COMPILED, EAGER, COMPILED]
    for r in rows:
        assert math.isfinite(r["median_s"]) and r["median_s"] > 0
        assert all(math.isfinite(t) and t > 0 for t in r["times_s"])
        if r["candidate"] == COMPILED:
            assert r["graphs"] == 1  # the integer step compiles without a graph break
            assert r["max_rel_diff"] <= 1e-5
    table = format_table(rows)
    assert "integer MLP" in table and "integer CNN" in table and COMPILED in table


def test_step_loss_is_per_token_for_language_models():
    """intqat-graphs' step loss: a classifier's (B, C) against (B,), a language model's (B, T, V) per token."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(4, 10, generator=g), torch.randint(0, 10, (4,), generator=g)
    assert torch.equal(cli.step_loss(logits, labels), torch.nn.functional.cross_entropy(logits, labels))
    lm, tokens = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    want = torch.nn.functional.cross_entropy(lm.reshape(10, 7), tokens.reshape(10))
    assert torch.equal(cli.step_loss(lm, tokens), want)


class _TinyLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, V): an integer input the float64 referee must leave as it is."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def test_referee_runs_a_language_model_on_token_ids():
    opts = cli.GraphsOptions(backend="aot_eager")
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(2))
    ref = referee(_TinyLM(), ids, lambda out: cli.step_loss(out, tokens), ["loss", "grad.head.weight"], opts)
    assert ref.error is None, ref.to_table()
    assert len(ref.rows) == 2 and ref.cleared, ref.to_table()
