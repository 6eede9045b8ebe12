"""Fine-tuning quality: does ZenFlow fine-tune a pretrained causal LM as well as AdamW?

A byte-level GPT (zenflow.tools.bench.model.GPT: 4 layers, context 64) is pretrained with AdamW on
one corpus (cached after the first run), then fine-tuned on the other with each optimizer, over
several seeds (the seed sets the batch order; the pretrained weights and the data split never
change). Two directions: Shakespeare -> BBC News at width 128 (the default) and BBC News ->
Shakespeare at width 256. Each run is scored after `synchronize()` on held-out text of the new
domain and of the old one. Within a seed the systems run in a rotated order. Writes
benchmarks/results/<name>.json and <name>.png.

The default systems are the windows a GPU runs: on a GPU the device is several times faster than
the host, so ZenFlow's windows are 4-16 steps long, where on this CPU machine the host keeps up
after one step. Fixed `update_interval` 4 and 8, and the default auto windows with the host
emulated as slow (`emulated_host_steps`, a benchmark-only setting of
zenflow.tools.finetune.optim.make_optimizer), show what a GPU user gets.

    python benchmarks/finetune_quality.py                       # the default comparison
    python benchmarks/finetune_quality.py --direction bbc-to-shakespeare --seeds 0
    python benchmarks/finetune_quality.py --systems AdamW "ZenFlow default" --seeds 0
"""
from __future__ import annotations

import argparse
import hashlib
import json
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


@dataclass(frozen=True)
class Direction:
    pretrain: str        # corpus the model is pretrained on (the old domain)
    finetune: str        # corpus it is fine-tuned on (the new domain)
    model: GPTConfig


DIRECTIONS = {
    "shakespeare-to-bbc": Direction("shakespeare", "bbc", GPTConfig(
        n_layer=4, n_embd=128, n_head=4, vocab_size=256, seq_len=64)),
    "bbc-to-shakespeare": Direction("bbc", "shakespeare", GPTConfig(
        n_layer=4, n_embd=256, n_head=4, vocab_size=256, seq_len=64)),
}


@dataclass(frozen=True)
class System:
    kind: str                       # make_optimizer's kind
    kwargs: dict                    # ZenFlow settings
    emulated_host_steps: int = 0    # auto windows: the host as slow as on a GPU


# The seeds' ZenFlow block (DeepSpeed's zf_config.json): k=0.05, U=4, overlap, select "auto",
# DeepSpeed's arithmetic (one AdamW step per window on the mean gradient, no lookahead).
SEEDS_BLOCK = dict(topk_ratio=0.05, update_interval=4, install_lookahead=0.0)
MOMENTS = dict(deferred_credit="moments", device_sum_budget=1 << 40)
SYSTEMS = {
    "AdamW": System("adamw", {}),
    "OffloadAdamW": System("offload", {}),
    # The defaults, with the windows this machine gives them (one step: the host keeps up).
    "ZenFlow default": System("zenflow", {}),
    # The windows a GPU runs.
    "seeds' block, U=4": System("zenflow", SEEDS_BLOCK),
    "seeds' block, U=8": System("zenflow", dict(SEEDS_BLOCK, update_interval=8)),
    "defaults, U=4": System("zenflow", dict(update_interval=4)),
    "defaults, U=8": System("zenflow", dict(update_interval=8)),
    "defaults, host 4 steps slow": System("zenflow", {}, emulated_host_steps=4),
    "defaults, host 8 steps slow": System("zenflow", {}, emulated_host_steps=8),
    # deferred_credit="moments" where the window sums fit the device, as a GPU's budget holds
    # them (emulated: the CPU "device", which by default sums nothing, gets a budget for all).
    "moments, one-step windows": System("zenflow", dict(MOMENTS)),
    "moments, U=4": System("zenflow", dict(MOMENTS, update_interval=4)),
    "moments, U=8": System("zenflow", dict(MOMENTS, update_interval=8)),
    "moments, host 4 steps slow": System("zenflow", dict(MOMENTS), emulated_host_steps=4),
    # Options measured before (one-step windows unless said).
    "ZenFlow DeepSpeed auto (auto_ratio=0.99)": System("zenflow", dict(auto_ratio=0.99,
                                                                        install_lookahead=0.0)),
    "ZenFlow sync U=4": System("zenflow", dict(update_interval=4, overlap_step=False)),
    "ZenFlow sync U=4, window credit": System("zenflow", dict(
        update_interval=4, overlap_step=False, deferred_credit="window")),
    "ZenFlow U=4, window credit": System("zenflow", dict(update_interval=4,
                                                         deferred_credit="window")),
    "ZenFlow k=0.2, U=4": System("zenflow", dict(topk_ratio=0.2, update_interval=4)),
}
# The GPU regime: 7 systems x 3 seeds, about 25 minutes on the 2-core machine (width 128).
DEFAULT_SYSTEMS = ["AdamW", "ZenFlow default", "seeds' block, U=4", "defaults, U=4",
                   "seeds' block, U=8", "defaults, U=8", "defaults, host 4 steps slow"]


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
SEQ_LEN = 64   # both directions' context


def corpora(direction: Direction) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{'old': the pretraining corpus (train, test), 'new': the fine-tuning one} as byte tensors.
    Held-out text is whole plays / whole articles never seen in training."""
    from zenflow.tools.finetune.data import bbc_news_articles, shakespeare_bytes, split_by_article

    def as_tensor(data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    shakespeare_train, shakespeare_test, _ = shakespeare_bytes(seed=0, n_test=4)
    bbc_train, bbc_test = split_by_article(bbc_news_articles(), test_fraction=0.2, seed=0)
    join = lambda ex: "\n\n".join(e.text_a for e in ex).encode("utf-8")
    corpus = {"shakespeare": (as_tensor(shakespeare_train), as_tensor(shakespeare_test)),
              "bbc": (as_tensor(join(bbc_train)), as_tensor(join(bbc_test)))}
    return {"old": corpus[direction.pretrain], "new": corpus[direction.finetune]}


def batch(stream: torch.Tensor, batch_size: int, generator: torch.Generator):
    starts = torch.randint(len(stream) - SEQ_LEN - 1, (batch_size,), generator=generator)
    seq = torch.stack([stream[s:s + SEQ_LEN + 1] for s in starts.tolist()])
    return seq[:, :-1], seq[:, 1:]


@torch.no_grad()
def held_out_loss(model: GPT, stream: torch.Tensor, windows: int) -> float:
    """Mean next-byte loss over `windows` evenly spaced windows of the held-out stream."""
    model.eval()
    span = SEQ_LEN + 1
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


def pretrained(setting: Setting, direction: Direction, data,
               progress: bool) -> dict[str, torch.Tensor]:
    key = [asdict(direction.model), setting.pretrain_steps, setting.pretrain_lr,
           setting.batch_size, torch.__version__]
    if direction.pretrain != "shakespeare":   # the first direction's cache keeps its name
        key.append(direction.pretrain)
    key = json.dumps(key, sort_keys=True)
    path = cache_dir() / f"pretrained-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model = GPT(direction.model)
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
def finetune(name: str, seed: int, weights, setting: Setting, direction: Direction,
             data) -> dict:
    system = SYSTEMS[name]
    kind = system.kind
    model = GPT(direction.model)
    model.load_state_dict(weights)
    opt = make_optimizer(kind, model.parameters(), lr=setting.lr,
                         weight_decay=setting.weight_decay, max_grad_norm=setting.max_grad_norm,
                         emulated_host_steps=system.emulated_host_steps, **system.kwargs)
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
        "moments_matrices": stats.get("moments_matrices"),   # deferred_credit "moments" on
        "mean_window_steps": (setting.steps / stats["windows"]) if stats.get("windows") else None,
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
    base_old = statistics.fmean(r["old_loss"] for r in base) if base else None
    base_step = statistics.median(r["median_step_s"] for r in base) if base else None
    for name in systems:
        mine = [r for r in runs if r["system"] == name]
        if not mine:
            continue
        new = spread([r["new_loss"] for r in mine])
        entry = {"new_loss": new, "old_loss": spread([r["old_loss"] for r in mine]),
                 "median_step_s": statistics.median(r["median_step_s"] for r in mine),
                 "reselections": [r["reselections"] for r in mine],
                 "mean_window_steps": [r.get("mean_window_steps") for r in mine]}
        if base_new:
            entry["new_gap_pct"] = 100.0 * (new["mean"] / base_new - 1.0)
            entry["old_gap_pct"] = 100.0 * (entry["old_loss"]["mean"] / base_old - 1.0)
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
    corpus = {"bbc": "BBC News", "shakespeare": "Shakespeare"}
    direction = DIRECTIONS[result["direction"]]
    for ax, key, title in ((ax1, "new_loss", f"held-out {corpus[direction.finetune]} (new domain)"),
                           (ax2, "old_loss", f"held-out {corpus[direction.pretrain]} (old domain)")):
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
    fig.suptitle(f"{result['direction']}, width {direction.model.n_embd}, "
                 f"{result['setting']['steps']} steps, {result['machine']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths: list[str], out: Path, name: str) -> int:
    """Write the runs of result files `paths` (one setting and direction) as one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for key in ("setting", "direction", "model"):
        if any(part[key] != first[key] for part in parts):
            raise SystemExit(f"--merge: the files differ in {key!r}; merge only runs of one setting")
    systems = [n for n in first["systems"] if all(n in part["systems"] for part in parts)]
    runs = [r for part in parts for r in part["runs"] if r["system"] in systems]
    result = {**first, "seeds": sorted({r["seed"] for r in runs}),
              "systems": {n: first["systems"][n] for n in systems},
              "summary": summarize(runs, systems), "runs": runs,
              "wall_s": sum(part["wall_s"] for part in parts), "merged_from": paths}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{name}.png")
    for system, summary in result["summary"].items():
        print(f"{system:36s} new {summary['new_loss']['mean']:.4f} "
              f"{summary.get('new_gap_pct', 0.0):+.2f}%  old {summary['old_loss']['mean']:.4f} "
              f"{summary.get('old_gap_pct', 0.0):+.2f}%")
    print(f"wrote {out / (name + '.json')}")
    return 0


def machine() -> str:
    info = machine_info("cpu")
    return f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direction", choices=list(DIRECTIONS), default="shakespeare-to-bbc")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--systems", nargs="*", default=DEFAULT_SYSTEMS, choices=list(SYSTEMS))
    ap.add_argument("--zenflow", nargs="+", default=[], metavar="JSON",
                    help='extra ZenFlow systems given as keyword arguments, e.g. '
                         '\'{"topk_ratio": 0.2, "update_interval": 2}\'')
    ap.add_argument("--steps", type=int, default=Setting.steps)
    ap.add_argument("--name", default=None,
                    help="output file stem (default: finetune_quality, or finetune_quality_<direction> "
                         "for the second direction)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine result files of separate runs (a long comparison run seed by "
                         "seed) into --out/--name: the systems every file has, their runs, a "
                         "new summary and plot; nothing is trained")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny run to check the script works (20 pretraining steps, 10 "
                         "fine-tuning steps of 8 sequences, 64 evaluation windows); not a "
                         "measurement")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out), args.name or "finetune_quality_merged")
    setting = Setting(steps=args.steps)
    if args.quick:
        setting = Setting(pretrain_steps=20, steps=10, warmup=2, eval_windows=64, batch_size=8)
    for text in args.zenflow:
        kwargs = json.loads(text)
        name = "ZenFlow " + " ".join(f"{k}={v}" for k, v in kwargs.items())
        SYSTEMS[name] = System("zenflow", kwargs)
        args.systems.append(name)
    direction = DIRECTIONS[args.direction]
    if args.name is None:
        args.name = ("finetune_quality" if args.direction == "shakespeare-to-bbc"
                     else f"finetune_quality_{args.direction}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    start = time.perf_counter()
    data = corpora(direction)
    weights = pretrained(setting, direction, data, progress=not args.quiet)
    runs = []
    total = len(args.seeds) * len(args.systems)
    for i, seed in enumerate(args.seeds):
        order = args.systems[i % len(args.systems):] + args.systems[:i % len(args.systems)]
        for name in order:
            run = finetune(name, seed, weights, setting, direction, data)
            runs.append(run)
            if not args.quiet:
                print(f"[{len(runs)}/{total}] seed {seed} {name:34s} new {run['new_loss']:.4f}  "
                      f"old {run['old_loss']:.4f}  step {1e3 * run['median_step_s']:.1f} ms  "
                      f"windows {run['windows']}  reselections {run['reselections']}  "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    result = {"benchmark": "finetune_quality", "machine": machine(), "setting": asdict(setting),
              "direction": args.direction, "model": asdict(direction.model), "seeds": args.seeds,
              "systems": {n: asdict(SYSTEMS[n]) for n in args.systems},
              "summary": summarize(runs, args.systems), "runs": runs,
              "wall_s": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{args.name}.png")
    print(f"\n{'system':36s} {'new domain':>18s} {'gap':>8s} {'old domain':>18s} {'gap':>8s} "
          f"{'window':>7s}")
    for name, s in result["summary"].items():
        gaps = [s.get(k) for k in ("new_gap_pct", "old_gap_pct")]
        gaps = ["" if g is None else f"{g:+.2f}%" for g in gaps]
        windows = [w for w in s["mean_window_steps"] if w is not None]
        window = f"{statistics.fmean(windows):.1f}" if windows else "-"
        print(f"{name:36s} {s['new_loss']['mean']:.4f} ± {s['new_loss']['std']:.4f} "
              f"{gaps[0]:>8s} {s['old_loss']['mean']:.4f} ± {s['old_loss']['std']:.4f} "
              f"{gaps[1]:>8s} {window:>7s}")
    print(f"wrote {out / (args.name + '.json')} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
