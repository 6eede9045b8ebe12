"""Stall benchmark: how long the training process waits for the optimizer's host work.

Runs, alternating round by round in one process, four optimizers on identical GPT-style models:
torch.optim.AdamW (fused, no offload), zenflow.OffloadAdamW (synchronous ZeRO-Offload),
ZenFlowAdamW(overlap_step=False) and ZenFlowAdamW(overlap_step=True). The model is wide and each
step sees few tokens, so the step is optimizer-bound. On CPU the training process is pinned to
its share of the cores and uses one thread; the ZenFlow worker gets the other cores.

Reported per system: median iteration time (forward + backward + step + zero_grad), median time
inside step(), stall per step (time blocked on host work: all of OffloadAdamW's step, the wait for
the worker in ZenFlow), and ratios. A cProfile of ZenFlow's step() splits the training process's
own work (accumulation, column gather/scatter, selection) from waiting. Writes JSON under
benchmarks/results/ and a timeline PNG of a few steps.

    python benchmarks/stall.py                 # ~117M parameters, CPU
    python benchmarks/stall.py --quick         # a small model, to check it runs
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import zenflow
from zenflow.bench.harness import machine_info
from zenflow.worker import split_cores

SYSTEMS = ["adamw", "offload", "zenflow_sync", "zenflow_overlap"]


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_optimizer(name: str, params, args):
    common = dict(lr=1e-4, weight_decay=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, fused=True, **common)
    if name == "offload":
        return zenflow.OffloadAdamW(params, **common)
    return zenflow.ZenFlowAdamW(params, topk_ratio=args.topk_ratio,
                                update_interval=args.update_interval,
                                overlap_step=(name == "zenflow_overlap"), **common)


def profile_step(system, steps: int) -> dict:
    """cProfile of `steps` iterations' step() calls: seconds per step in the optimizer's parts."""
    model, opt, batch = system["model"], system["opt"], system["batch"]
    profiler = cProfile.Profile()
    for _ in range(steps):
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        profiler.enable()
        opt.step()
        profiler.disable()
        opt.zero_grad(set_to_none=True)
    stats = pstats.Stats(profiler)
    parts = {}
    for (file, _, func), (_, _, _, cumulative, _) in stats.stats.items():
        if "zenflow" in file and func in ("step", "stage", "accumulate", "_device_update",
                                          "_end_window", "_install_in_flight", "install",
                                          "_maybe_select", "wait", "clip_coefficient",
                                          "gradient_norms", "_gradients", "fence"):
            parts[func] = parts.get(func, 0.0) + cumulative / steps
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per step (batch 1)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=8)
    parser.add_argument("--topk-ratio", type=float, default=0.1)
    parser.add_argument("--update-interval", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.layers, args.vocab, args.rounds = 256, 2, 1024, 2

    host = machine_info("cpu")   # before pinning, so it names every CPU this run may use
    training_cores, worker_cores = split_cores(0.5)
    os.sched_setaffinity(0, training_cores)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    systems = {}
    for name in SYSTEMS:
        torch.manual_seed(0)
        model = GPT(args.vocab, args.d_model, args.layers, heads=max(1, args.d_model // 64),
                    context=args.tokens + 1)
        batch = torch.randint(0, args.vocab, (1, args.tokens + 1))
        systems[name] = {"model": model, "opt": make_optimizer(name, model.parameters(), args),
                         "batch": batch, "iter_s": [], "step_s": [], "stall_s": [],
                         "events": []}
    num_params = sum(p.numel() for p in systems["adamw"]["model"].parameters())
    print(f"GPT d={args.d_model} layers={args.layers} vocab={args.vocab}: "
          f"{num_params / 1e6:.1f}M parameters, {args.tokens} tokens/step; training cores "
          f"{training_cores}, worker cores {worker_cores}", flush=True)

    def run_round(name: str, record: bool) -> None:
        s = systems[name]
        model, opt, batch = s["model"], s["opt"], s["batch"]
        for _ in range(args.steps_per_round):
            t0 = time.perf_counter()
            logits = model(batch[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
            t1 = time.perf_counter()
            stall_before = opt.stats()["stall_s_total"] if name != "adamw" else 0.0
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if not record:
                continue
            if name == "adamw":
                stall = 0.0
            elif name == "offload":
                stall = t2 - t1       # all of it is host work the training waits for
            else:
                stall = opt.stats()["stall_s_total"] - stall_before
            s["iter_s"].append(t3 - t0)
            s["step_s"].append(t2 - t1)
            s["stall_s"].append(stall)
            s["events"].append((t0, t1, t2, t3, stall))

    # Round 0 warms up (and lets the workers finish starting); rounds alternate systems.
    for r in range(args.rounds + 1):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        for name in order:
            run_round(name, record=r > 0)
        if r > 0:
            print(f"round {r}/{args.rounds}: " + ", ".join(
                f"{n} {statistics.median(systems[n]['iter_s']) * 1e3:.0f} ms"
                for n in SYSTEMS), flush=True)

    profile = profile_step(systems["zenflow_overlap"], args.steps_per_round)
    results = {}
    for name in SYSTEMS:
        s = systems[name]
        results[name] = {"iteration_s_median": statistics.median(s["iter_s"]),
                         "step_s_median": statistics.median(s["step_s"]),
                         "stall_s_per_step_mean": statistics.fmean(s["stall_s"]),
                         "stall_s_per_step_median": statistics.median(s["stall_s"]),
                         "steps": len(s["iter_s"])}
        if name != "adamw":
            st = s["opt"].stats()
            results[name]["stats"] = {k: v for k, v in st.items() if not isinstance(v, (list, dict))}
    fwd_bwd = statistics.median(
        t1 - t0 for t0, t1, *_ in systems["adamw"]["events"])
    ratios = {
        "stall_reduction_overlap_vs_offload": 1 - results["zenflow_overlap"]["stall_s_per_step_mean"]
        / results["offload"]["stall_s_per_step_mean"],
        "speedup_overlap_vs_offload": results["offload"]["iteration_s_median"]
        / results["zenflow_overlap"]["iteration_s_median"],
        "overlap_vs_adamw_iteration": results["zenflow_overlap"]["iteration_s_median"]
        / results["adamw"]["iteration_s_median"],
        "sync_vs_adamw_iteration": results["zenflow_sync"]["iteration_s_median"]
        / results["adamw"]["iteration_s_median"],
        "offload_vs_adamw_iteration": results["offload"]["iteration_s_median"]
        / results["adamw"]["iteration_s_median"],
    }
    targets = {"stall_reduction>=0.90": ratios["stall_reduction_overlap_vs_offload"] >= 0.90,
               "speedup_vs_offload>=1.8": ratios["speedup_overlap_vs_offload"] >= 1.8,
               "within_1.2x_of_adamw": ratios["overlap_vs_adamw_iteration"] <= 1.2}
    report = {"benchmark": "stall", "machine": host, "config": vars(args),
              "num_params": num_params, "forward_backward_s_median": fwd_bwd,
              "load_average_1m_at_end": os.getloadavg()[0],
              "results": results, "ratios": ratios, "targets_met": targets,
              "zenflow_overlap_step_profile_s": profile}

    for name in SYSTEMS:
        r = results[name]
        print(f"{name:16s} iteration {r['iteration_s_median'] * 1e3:7.1f} ms  step() "
              f"{r['step_s_median'] * 1e3:7.1f} ms  stall/step {r['stall_s_per_step_mean'] * 1e3:7.1f} ms")
    print(f"forward+backward {fwd_bwd * 1e3:.1f} ms")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    print("ZenFlow overlap step() profile (ms/step): " + ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in sorted(profile.items(), key=lambda kv: -kv[1])))
    print("targets:", targets)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"stall_{report['machine']['device']}_{report['machine']['cpus']}cpu_t{args.tokens}" + (
        "_quick" if args.quick else "")
    (out / f"{tag}.json").write_text(json.dumps(report, indent=2))
    plot_timeline(systems, out / f"{tag}_timeline.png", steps=2 * args.update_interval)
    print(f"wrote {out / (tag + '.json')} and {out / (tag + '_timeline.png')}")
    for s in systems.values():
        if hasattr(s["opt"], "close"):
            s["opt"].close()
    return 0


def plot_timeline(systems, path: Path, steps: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("offload", "OffloadAdamW"), ("zenflow_overlap", "ZenFlowAdamW overlap")]
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 2.4 * len(rows)))
    for ax, (name, title) in zip(axes, rows):
        events = systems[name]["events"][-steps:]
        origin = events[0][0]
        end = events[-1][3]
        for t0, t1, t2, t3, stall in events:
            ax.broken_barh([(t0 - origin, t1 - t0)], (10, 8), color="tab:blue")
            ax.broken_barh([(t1 - origin, t2 - t1 - stall)], (10, 8), color="tab:orange")
            ax.broken_barh([(t2 - stall - origin, stall)], (10, 8), color="tab:red")
        if name == "offload":
            ax.text(0.005, 0.05, "all of step() is host AdamW + copies (counted as stall)",
                    fontsize=8, transform=ax.transAxes)
        updates = systems[name]["opt"].timeline()["host_updates"] if name != "offload" else []
        for start, stop in updates:
            if stop >= origin and start <= end:
                ax.broken_barh([(start - origin, stop - start)], (0, 8), color="tab:green")
        ax.set_yticks([4, 14], ["worker", "training"])
        ax.set_xlim(0, end - origin)
        ax.set_title(title, fontsize=10)
    axes[-1].set_xlabel("seconds (blue: forward+backward, orange: step() own work, "
                        "red: stall, green: worker host AdamW)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
