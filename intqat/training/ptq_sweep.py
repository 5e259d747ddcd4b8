"""Sweep: how much does post-training 8da4w raise a recipe GPT's perplexity?

Trains the fp32 GPT of recipes/gpt_text_8da4w.yaml as intqat-train does (same seeding order, so seed 0
gives the recipe's initial weights and batches; Lightning, AdamW, cosine per step to 0 at --steps,
gradient clipping), without QAT, and at the
--evals steps scores fp32 and PTQ (intqat.to_integer of a copy) on the validation and test windows
for several group sizes / embedding specs. One JSON line per evaluation on stdout.

    python -m intqat.training.ptq_sweep --warmup 50 --steps 700 --evals 300,500,700
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
import warnings

import lightning as L
import torch

import intqat
from intqat.data import StdlibTextDataModule
from intqat.training.lm import LanguageModelModule, evaluate_lm

PTQ = {
    "g32_e4g32": {"preset": "8da4w", "weight": {"group_size": 32}, "embedding": {"bits": 4, "granularity": "group", "group_size": 32}},
    "g64_e4g32": {"preset": "8da4w", "weight": {"group_size": 64}, "embedding": {"bits": 4, "granularity": "group", "group_size": 32}},
    "g128_e4g32": {"preset": "8da4w", "weight": {"group_size": 128}, "embedding": {"bits": 4, "granularity": "group", "group_size": 32}},
    "g128_e8ch": {"preset": "8da4w", "weight": {"group_size": 128}, "embedding": {"bits": 8, "granularity": "channel"}},
    "g128_noemb": {"preset": "8da4w", "weight": {"group_size": 128}},
}


class _Probe(L.Callback):
    """At the given optimizer steps: fp32 and PTQ perplexities of the model being trained (one JSON line)."""

    def __init__(self, evals, val, test, ptq, args):
        self.evals, self.val, self.test, self.ptq, self.args = evals, val, test, ptq, args
        self.t0, self.eval_s = time.time(), 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step not in self.evals:
            return
        t = time.time()
        model = pl_module.model
        row = {"args": self.args, "step": step, "train_s": round(t - self.t0 - self.eval_s, 1)}
        for split, b in (("val", self.val), ("test", self.test)):
            row[f"{split}/fp32"] = evaluate_lm(model, b)["ppl"]
        for name in self.ptq:
            q = copy.deepcopy(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                intqat.to_integer(q, config=PTQ[name])
            for split, b in (("val", self.val), ("test", self.test)):
                row[f"{split}/{name}"] = round(100 * (evaluate_lm(q, b)["ppl"] / row[f"{split}/fp32"] - 1), 3)
        print(json.dumps(row), flush=True)
        self.eval_s += time.time() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m intqat.training.ptq_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--evals", default="500,700")
    ap.add_argument("--d_model", type=int, default=128)
    ap.add_argument("--n_layers", type=int, default=4)
    ap.add_argument("--n_heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--ptq", default=",".join(PTQ))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    # the order of intqat-train (intqat/cli/train.py): seed, datamodule, module, trainer; the same seed
    # gives the recipe's initial weights and batch order
    L.seed_everything(a.seed, workers=True)
    dm = StdlibTextDataModule(context=128, batch_size=a.batch, seed=a.seed)
    model = {"_target_": "intqat.models.GPT", "d_model": a.d_model, "n_layers": a.n_layers, "n_heads": a.n_heads,
             "tie_embeddings": not a.untied}
    module = LanguageModelModule(model, num_classes=256, optimizer="adamw", lr=a.lr, weight_decay=a.wd,
                                 warmup_steps=a.warmup)
    ev = StdlibTextDataModule(context=128, batch_size=a.batch, seed=a.seed)
    ev.setup()
    gen_state = torch.get_rng_state()
    val, test = list(ev.val_dataloader()), list(ev.test_dataloader())
    torch.set_rng_state(gen_state)  # iterating a DataLoader draws from the global RNG: keep the recipe's
    probe = _Probe({int(s) for s in a.evals.split(",")}, val, test, a.ptq.split(","), vars(a))
    trainer = L.Trainer(max_steps=a.steps, max_epochs=-1, gradient_clip_val=a.clip or None, logger=False,
                        limit_val_batches=0, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True, callbacks=[probe])
    trainer.fit(module, datamodule=dm)


if __name__ == "__main__":
    main()
