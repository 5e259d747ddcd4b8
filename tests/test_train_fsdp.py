"""The default recipe under FSDP2 (trainer=fsdp_cpu: 2 CPU processes, gloo, FullyShardStrategy) trains through
every QAT stage, tests the last distributed checkpoint and exports the integer model."""

import json
import re
import subprocess
import sys

QUICK = [
    "trainer.max_epochs=6", "quant.prepare_at=1", "quant.freeze_bn_at=3", "quant.freeze_observers_at=3",
    "quant.integer_at=4", "trainer.enable_progress_bar=false", "trainer=fsdp_cpu",
]


def test_fsdp_recipe_trains_tests_and_exports(tmp_path):
    out = tmp_path / "fsdp"
    r = subprocess.run([sys.executable, "-m", "intqat.cli.train", *QUICK, f"output_dir={out}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    acc = re.search(r"test accuracy ([0-9.]+)", r.stdout)
    assert acc and float(acc.group(1)) > 0.85, r.stdout[-2000:]
    report = (out / "report.md").read_text()
    assert "2 x cpu (FullyShardStrategy)" in report and "integer" in report
    last = out / "checkpoints" / "last.ckpt"
    assert last.is_dir() and len(list(last.glob("*.distcp"))) == 2  # a distributed checkpoint: a shard per rank
    # the program exported from rank 0's unsharded copy computes what the integer model computed
    validation = json.loads((out / "export" / "report.json").read_text())["validation"]
    assert validation["reference_equals_integer_model"] and validation["top1_agreement"] > 0.98, validation
