"""Fine-tuning quality: does ZenFlow fine-tune a pretrained causal LM as well as AdamW?

A byte-level GPT (zenflow.tools.bench.model.GPT: 4 layers, width 128, context 64) is pretrained with
AdamW on Shakespeare (cached after the first run), then fine-tuned on BBC News text with each
optimizer, over several seeds (the seed sets the batch order; the pretrained weights and the data
split never change). Each run is scored after `synchronize()` on held-out BBC articles (the new
domain) and on held-out Shakespeare plays (the old one). Within a seed the systems run in a
rotated order. Writes benchmarks/results/<name>.json and <name>.png.

    python benchmarks/finetune_quality.py                       # the default comparison
    python benchmarks/finetune_quality.py --systems AdamW "ZenFlow default" --seeds 0
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from zenflow.tools.bench.harness import machine_info
from zenflow.tools.bench.model import GPT, GPTConfig
from zenflow.tools.finetune.optim import make_optimizer

MODEL = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, seq_len=64)

# name -> (optimizer kind, ZenFlow keyword arguments)
# The settings that set the defaults before 2026-11-22: DeepSpeed's paper setting.
FIXED_WINDOWS = dict(update_interval=4, install_lookahead=0.0)
SYSTEMS = {
    "AdamW": ("adamw", {}),
    "OffloadAdamW": ("offload", {}),
    "ZenFlow default": ("zenflow", {}),
    "ZenFlow U=4 (k=0.1, overlap, no lookahead)": ("zenflow", FIXED_WINDOWS),
    "ZenFlow DeepSpeed auto (auto_ratio=0.99)": ("zenflow", dict(auto_ratio=0.99,
                                                                  install_lookahead=0.0)),
    "ZenFlow sync": ("zenflow", dict(FIXED_WINDOWS, overlap_step=False)),
    "ZenFlow sync, window credit": ("zenflow", dict(FIXED_WINDOWS, overlap_step=False,
                                                    deferred_credit="window")),
    "ZenFlow U=1, lookahead 1": ("zenflow", dict(update_interval=1, install_lookahead=1.0)),
    "ZenFlow k=0.05 (the seeds' ratio)": ("zenflow", dict(topk_ratio=0.05)),
    "ZenFlow k=0.2": ("zenflow", dict(topk_ratio=0.2)),
}
# Five systems x 3 seeds: about 15 minutes on the 2-core machine.
DEFAULT_SYSTEMS = list(SYSTEMS)[:5]


@dataclass(frozen=True)
class Setting:
    pretrain_steps: int = 1500
    pretrain_lr: float = 1e-3
    steps: int = 300
    lr: float = 5e-4
    warmup: int = 20
    batch_size: int = 32
    max_grad_norm: float = 1.0
    weight_decay: float = 0.01
    eval_windows: int = 512


# -- data -------------------------------------------------------------------------------------
def corpora() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{'old': Shakespeare (train, test), 'new': BBC News (train, test)} as uint8 byte tensors.
    Held-out text is whole plays / whole articles never seen in training."""
    from zenflow.tools.finetune.data import bbc_news_articles, shakespeare_bytes, split_by_article

    def as_tensor(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    old_train, old_test, _ = shakespeare_bytes(seed=0, n_test=4)
    new_train, new_test = split_by_article(bbc_news_articles(), test_fraction=0.2, seed=0)
    join = lambda ex: "\n\n".join(e.text_a for e in ex).encode("utf-8")
    return {"old": (as_tensor(old_train), as_tensor(old_test)),
            "new": (as_tensor(join(new_train)), as_tensor(join(new_test)))}


def batch(stream: torch.Tensor, batch_size: int, generator: torch.Generator):
    starts = torch.randint(len(stream) - MODEL.seq_len - 1, (batch_size,), generator=generator)
    seq = torch.stack([stream[s:s + MODEL.seq_len + 1] for s in starts.tolist()])
    return seq[:, :-1], seq[:, 1:]


@torch.no_grad()
def held_out_loss(model: GPT, stream: torch.Tensor, windows: int) -> float:
    """Mean next-byte loss over `windows` evenly spaced windows of the held-out stream."""
    model.eval()
    span = MODEL.seq_len + 1
    starts = torch.linspace(0, len(stream) - span - 1, windows).long().tolist()
    total = 0.0
    for i in range(0, windows, 128):
        seq = torch.stack([stream[s:s + span] for s in starts[i:i + 128]])
        total += float(model(seq[:, :-1], seq[:, 1:])) * len(seq)
    model.train()
    return total / windows


def schedule(step: int, warmup: int, total: int) -> float:
    """Linear warm-up, then linear decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


# -- pretraining (cached) -----------------------------------------------------------------------
def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "zenflow" / "finetune_quality"


def pretrained(setting: Setting, data, progress: bool) -> dict[str, torch.Tensor]:
    key = json.dumps([asdict(MODEL), setting.pretrain_steps, setting.pretrain_lr,
                      setting.batch_size, torch.__version__], sort_keys=True)
    path = cache_dir() / f"pretrained-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=setting.pretrain_lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1234)
    train = data["old"][0]
    for step in range(setting.pretrain_steps):
        for group in opt.param_groups:
            group["lr"] = setting.pretrain_lr * schedule(step, 50, setting.pretrain_steps)
        loss = model(*batch(train, setting.batch_size, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if progress and (step % 100 == 0 or step == setting.pretrain_steps - 1):
            print(f"  pretrain {step + 1}/{setting.pretrain_steps}  loss {float(loss):.3f}",
                  flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model.state_dict()


# -- one fine-tune (the optimizers built as every example and benchmark builds them) ---------------
def finetune(name: str, seed: int, weights, setting: Setting, data) -> dict:
    kind, kwargs = SYSTEMS[name]
    model = GPT(MODEL)
    model.load_state_dict(weights)
    opt = make_optimizer(kind, model.parameters(), lr=setting.lr,
                         weight_decay=setting.weight_decay, max_grad_norm=setting.max_grad_norm,
                         **kwargs)
    gen = torch.Generator().manual_seed(seed)
    train = data["new"][0]
    losses, times = [], []
    try:
        for step in range(setting.steps):
            for group in opt.param_groups:
                group["lr"] = setting.lr * schedule(step, setting.warmup, setting.steps)
            x, y = batch(train, setting.batch_size, gen)
            start = time.perf_counter()
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if kind == "adamw":
                torch.nn.utils.clip_grad_norm_(model.parameters(), setting.max_grad_norm)
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        stats = opt.stats() if hasattr(opt, "stats") else {}
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return {
        "system": name, "seed": seed,
        "new_loss": held_out_loss(model, data["new"][1], setting.eval_windows),
        "old_loss": held_out_loss(model, data["old"][1], setting.eval_windows),
        "train_loss_last20": statistics.fmean(losses[-20:]),
        "median_step_s": statistics.median(times[min(10, len(times) // 2):]),  # warmed up
        "reselections": stats.get("reselections"),
        "windows": stats.get("windows"),
        "losses": losses,
    }


# -- report ---------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(runs: list[dict], systems: list[str]) -> dict:
    out = {}
    base = [r for r in runs if r["system"] == "AdamW"]
    base_new = statistics.fmean(r["new_loss"] for r in base) if base else None
    base_step = statistics.median(r["median_step_s"] for r in base) if base else None
    for name in systems:
        mine = [r for r in runs if r["system"] == name]
        if not mine:
            continue
        new = spread([r["new_loss"] for r in mine])
        entry = {"new_loss": new, "old_loss": spread([r["old_loss"] for r in mine]),
                 "median_step_s": statistics.median(r["median_step_s"] for r in mine),
                 "reselections": [r["reselections"] for r in mine]}
        if base_new:
            entry["new_gap_pct"] = 100.0 * (new["mean"] / base_new - 1.0)
            entry["step_time_vs_adamw"] = entry["median_step_s"] / base_step
        out[name] = entry
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    summary = result["summary"]
    names = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, title in ((ax1, "new_loss", "held-out BBC News (new domain)"),
                           (ax2, "old_loss", "held-out Shakespeare (old domain)")):
        means = [summary[n][key]["mean"] for n in names]
        stds = [summary[n][key]["std"] for n in names]
        ax.barh(range(len(names)), means, xerr=stds, color="tab:blue", alpha=0.7)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        lo, hi = min(means), max(means)
        ax.set_xlim(lo - 0.2 * (hi - lo + 1e-3), hi + 0.2 * (hi - lo + 1e-3))
        if "AdamW" in summary:
            base = summary["AdamW"][key]["mean"]
            ax.axvline(base, color="k", lw=0.8, label="AdamW")
            if key == "new_loss":
                ax.axvline(1.01 * base, color="tab:red", ls="--", lw=0.8, label="AdamW + 1%")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel("loss (nats/byte), mean ± std over seeds")
        ax.set_title(title)
        ax.invert_yaxis()
    fig.suptitle(f"fine-tune {result['setting']['steps']} steps, {result['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> str:
    info = machine_info("cpu")
    return f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--systems", nargs="*", default=DEFAULT_SYSTEMS, choices=list(SYSTEMS))
    ap.add_argument("--zenflow", nargs="+", default=[], metavar="JSON",
                    help='extra ZenFlow systems given as keyword arguments, e.g. '
                         '\'{"topk_ratio": 0.2, "update_interval": 2}\'')
    ap.add_argument("--steps", type=int, default=Setting.steps)
    ap.add_argument("--name", default="finetune_quality")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny run to check the script works (40 pretraining steps, 10 "
                         "fine-tuning steps, 64 evaluation windows); not a measurement")
    args = ap.parse_args(argv)
    setting = Setting(steps=args.steps)
    if args.quick:
        setting = Setting(pretrain_steps=40, steps=10, warmup=2, eval_windows=64)
    for text in args.zenflow:
        kwargs = json.loads(text)
        name = "ZenFlow " + " ".join(f"{k}={v}" for k, v in kwargs.items())
        SYSTEMS[name] = ("zenflow", kwargs)
        args.systems.append(name)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    start = time.perf_counter()
    data = corpora()
    weights = pretrained(setting, data, progress=not args.quiet)
    runs = []
    total = len(args.seeds) * len(args.systems)
    for i, seed in enumerate(args.seeds):
        order = args.systems[i % len(args.systems):] + args.systems[:i % len(args.systems)]
        for name in order:
            run = finetune(name, seed, weights, setting, data)
            runs.append(run)
            if not args.quiet:
                print(f"[{len(runs)}/{total}] seed {seed} {name:34s} new {run['new_loss']:.4f}  "
                      f"old {run['old_loss']:.4f}  step {1e3 * run['median_step_s']:.1f} ms  "
                      f"reselections {run['reselections']}  "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    result = {"benchmark": "finetune_quality", "machine": machine(), "setting": asdict(setting),
              "model": asdict(MODEL), "seeds": args.seeds,
              "systems": {n: {"kind": SYSTEMS[n][0], "kwargs": SYSTEMS[n][1]}
                          for n in args.systems},
              "summary": summarize(runs, args.systems), "runs": runs,
              "wall_s": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{args.name}.png")
    print(f"\n{'system':36s} {'new domain':>18s} {'gap':>8s} {'old domain':>18s} {'step':>7s}")
    for name, s in result["summary"].items():
        gap = s.get("new_gap_pct")
        print(f"{name:36s} {s['new_loss']['mean']:.4f} ± {s['new_loss']['std']:.4f} "
              f"{'' if gap is None else f'{gap:+.2f}%':>8s} "
              f"{s['old_loss']['mean']:.4f} ± {s['old_loss']['std']:.4f} "
              f"{s.get('step_time_vs_adamw', math.nan):6.2f}x")
    print(f"wrote {out / (args.name + '.json')} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
