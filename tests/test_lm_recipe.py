"""The text recipe's pieces: stdlib byte data, the GPT, and a real (tiny) Lightning run through
IntQAT 8da4w with LMQuantReport and the LM export hook."""

from __future__ import annotations

import functools
import json
import math

import lightning as L
import pytest
import torch

import intqat
from intqat.data import StdlibTextDataModule
from intqat.data.text import stdlib_files, stdlib_text
from intqat.models import GPT
from intqat.training.lm import LanguageModelModule, LMQuantReport, evaluate_lm, export_lm_for_callback


def test_stdlib_split_is_deterministic_and_disjoint():
    files = stdlib_files()
    train, held = stdlib_text(val_every=10)
    train2, held2 = stdlib_text(val_every=10)
    assert torch.equal(train, train2) and torch.equal(held, held2)
    assert len(train) + len(held) == sum(p.stat().st_size + 2 for p in files)
    assert held[: len(files[0].read_bytes())].numpy().tobytes() == files[0].read_bytes()  # file 0 is held out


def test_windows_shift_by_one_and_eval_windows_do_not_overlap():
    dm = StdlibTextDataModule(context=16, batch_size=4, train_windows=32, eval_windows=8)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    starts = dm.val_set.starts
    assert torch.equal(starts[1:] - starts[:-1], torch.full((7,), 16))
    assert int(dm.test_set.starts[0]) >= len(dm.val_set.data) // 2 > int(starts[-1]) + 16


def test_gpt_ties_and_rejects_long_sequences():
    m = GPT(context=16, d_model=32, n_layers=1, n_heads=2)
    assert m.lm_head.weight is m.tok_emb.weight
    assert m(torch.randint(0, 256, (2, 16))).shape == (2, 16, 256)
    with pytest.raises(ValueError, match="exceeds the context of 16"):
        m(torch.zeros(1, 17, dtype=torch.int64))


def test_tiny_8da4w_run_reports_ptq_qat_and_exports(tmp_path):
    L.seed_everything(0)
    cfg = {"preset": "8da4w", "embedding": {"bits": 4, "granularity": "group", "group_size": 32}}
    dm = StdlibTextDataModule(context=16, batch_size=4, train_windows=64, eval_windows=4)
    model = {"_target_": "intqat.models.GPT", "context": 16, "d_model": 32, "n_layers": 1, "n_heads": 2}
    module = LanguageModelModule(model, num_classes=256, lr=3e-3, optimizer="adamw")
    export = functools.partial(export_lm_for_callback, calibration_batches=1, validation_split="val",
                               integer_module_types=("IntLinear", "IntConv2d", "IntEmbedding"))
    qat = intqat.IntQAT(cfg, unit="step", prepare_at=3, integer_at=4, export_on_fit_end=True,
                        export_dir=tmp_path / "export", export_fn=export)
    report = LMQuantReport(cfg, fork_at=3, out_dir=tmp_path)
    trainer = L.Trainer(max_steps=6, callbacks=[qat, report], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, num_sanity_val_steps=0, val_check_interval=3,
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    res = json.loads((tmp_path / "lm_report.json").read_text())
    for key in ("val/fp32", "val/ptq", "val/qat", "test/fp32", "test/ptq", "test/qat"):
        assert res[key]["tokens"] == 4 * 16 and res[key]["ppl"] > 1
    assert res["fork_at_step"] == 3 and res["steps"] == 6
    assert isinstance(module.model.blocks[0].fc, intqat.nn.GroupedIntLinear)
    assert not any(isinstance(m, intqat.registry.INTEGER_TYPES) for m in report.twin.modules())  # the twin stayed fp32
    assert not torch.equal(report.twin.blocks[0].fc.weight, report._fork_model.blocks[0].fc.weight)  # and trained
    e = res["export"]
    assert e["loads_without_intqat"] is True and abs(e["ppl_rel_diff"]) < 0.01
    assert (tmp_path / "export" / "model.pt2").exists() and "val ppl fp32 / PTQ / QAT" in report.report_rows


def test_lm_report_fork_must_precede_quantization():
    with pytest.raises(ValueError, match="fork_at=0"):
        LMQuantReport("8da4w", fork_at=0)


def test_evaluate_lm_matches_cross_entropy():
    torch.manual_seed(0)
    m = GPT(context=8, d_model=32, n_layers=1, n_heads=2)
    x, y = torch.randint(0, 256, (3, 8)), torch.randint(0, 256, (3, 8))
    r = evaluate_lm(m, [(x[:2], y[:2]), (x[2:], y[2:])])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1))
    assert r["tokens"] == 24 and abs(r["loss"] - float(loss)) < 1e-5


def test_warmup_then_cosine_schedule_in_a_real_run(tmp_path):
    """warmup_steps: lr rises linearly to lr over the first steps, then the cosine reaches 0 at the last."""
    L.seed_everything(0)
    dm = StdlibTextDataModule(context=8, batch_size=2, train_windows=32, eval_windows=2)
    model = {"_target_": "intqat.models.GPT", "context": 8, "d_model": 32, "n_layers": 1, "n_heads": 2}
    module = LanguageModelModule(model, num_classes=256, lr=1e-2, optimizer="adamw", warmup_steps=4)
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = L.Trainer(max_steps=10, callbacks=[Record()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    cos = [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(6)]
    expected = [1e-2 * f for f in (0.25, 0.5, 0.75, 1.0, *cos)]
    assert seen == pytest.approx(expected, rel=1e-6, abs=1e-12) and module.hparams.warmup_steps == 4
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_warmup_must_be_shorter_than_the_run(tmp_path):
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        LanguageModelModule({"_target_": "intqat.models.GPT"}, warmup_steps=-1)
    module = LanguageModelModule({"_target_": "intqat.models.GPT", "context": 8, "d_model": 32, "n_layers": 1,
                                  "n_heads": 2}, warmup_steps=5, lr=1e-3)
    trainer = L.Trainer(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="must be below the 5 optimizer steps"):
        trainer.fit(module, datamodule=StdlibTextDataModule(context=8, batch_size=2, train_windows=16, eval_windows=2))


def test_ptq_sweep_prints_fp32_and_ptq_perplexities(capsys):
    """python -m intqat.training.ptq_sweep (how the recipe's settings were chosen) on a 1-block GPT, 2 steps:
    one JSON line per evaluation, with finite fp32 perplexities and the PTQ rise in % per spec and split."""
    import json
    import math

    from intqat.training import ptq_sweep

    threads = torch.get_num_threads()
    try:
        ptq_sweep.main(["--steps", "2", "--evals", "2", "--d_model", "32", "--n_layers", "1", "--n_heads", "2",
                        "--batch", "4", "--ptq", "g32_e4g32,g128_noemb"])
    finally:
        torch.set_num_threads(threads)
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    row = json.loads(line)
    assert row["step"] == 2
    for split in ("val", "test"):
        assert math.isfinite(row[f"{split}/fp32"]) and row[f"{split}/fp32"] > 1.0
        for spec in ("g32_e4g32", "g128_noemb"):
            assert math.isfinite(row[f"{split}/{spec}"])
