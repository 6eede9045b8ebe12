"""Accuracy parity: does ZenFlow train as well as AdamW?

Runs the BBC News fine-tune of all-MiniLM-L6-v2 (held-out accuracy) and the byte-level GPT on
Shakespeare (held-out loss) with torch AdamW, OffloadAdamW (synchronous ZeRO-Offload),
ZenFlowAdamW (topk_ratio=0.1, update_interval=4, overlap_step=True) and ZenFlowAdamW all-auto
(update_interval "auto", reselection on drift; "all-auto" before select_strategy "auto" took
DeepSpeed's once-per-epoch meaning), over several seeds. The seed sets the
classifier head / model initialisation and the batch order; the data split never changes. Within
each seed the optimizers run in a rotated order. Writes benchmarks/results/accuracy.json and
accuracy.png.

Targets (issue 7): ZenFlow's mean accuracy within 0.5 points of AdamW's; ZenFlow's mean held-out
LM loss within 1% of AdamW's.

    python benchmarks/accuracy.py                     # full setting: 3 seeds, the demo's setting
    python benchmarks/accuracy.py --bbc-steps 60 --lm-steps 200   # reduced (stated in the JSON)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from zenflow.tools.bench.harness import machine_info
from zenflow.tools.finetune.experiments import BBCExperiment, BBCSetting, LMExperiment, LMSetting

SYSTEMS = {
    "AdamW": ("adamw", {}),
    "OffloadAdamW": ("offload", {}),
    "ZenFlowAdamW defaults": ("zenflow", {}),
    # The defaults before 2026-11-22 (DeepSpeed's paper setting) and DeepSpeed's all-auto.
    "ZenFlowAdamW k=0.1 U=4 overlap": ("zenflow", dict(topk_ratio=0.1, update_interval=4,
                                                        overlap_step=True, install_lookahead=0.0)),
    "ZenFlowAdamW all-auto": ("zenflow-auto", dict(topk_ratio=0.1, overlap_step=True,
                                                   auto_ratio=0.99, install_lookahead=0.0)),
    "ZenFlowAdamW U=1 lookahead 1": ("zenflow", dict(update_interval=1, install_lookahead=1.0)),
    "ZenFlowAdamW sync window credit": ("zenflow", dict(overlap_step=False,
                                                         deferred_credit="window")),
    # deferred_credit "moments" (the default) where a GPU keeps every window sum on the device
    # (emulated: the CPU "device" gets a budget for them all), at a GPU's windows.
    "ZenFlowAdamW moments U=4": ("zenflow", dict(update_interval=4, deferred_credit="moments",
                                                 device_sum_budget=1 << 40)),
    "ZenFlowAdamW moments U=8": ("zenflow", dict(update_interval=8, deferred_credit="moments",
                                                 device_sum_budget=1 << 40)),
}

def spread(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def run_all(exp, seeds, systems, progress) -> dict:
    runs = {name: [] for name in systems}
    errors = {}
    names = list(systems)
    for i, seed in enumerate(seeds):
        order = names[i % len(names):] + names[: i % len(names)]  # rotate: no system always first
        for name in order:
            if name in errors:
                continue
            kind, kw = systems[name]
            t0 = time.perf_counter()
            try:
                r = exp.run(kind, seed, progress=progress, desc=f"{name} s{seed}", **kw)
            except Exception as e:  # record and go on: one system failing must not hide the others
                errors[name] = f"{type(e).__name__}: {e}"
                print(f"  {name}: FAILED ({errors[name]})", flush=True)
                traceback.print_exc(limit=2)
                continue
            runs[name].append({"seed": seed, "metric": r.metric, **r.train.summary(),
                               "wall_incl_eval_s": time.perf_counter() - t0,
                               "losses": r.train.losses})
            print(f"  {name} seed {seed}: {r.metric:.4f}", flush=True)
    summary = {name: spread([r["metric"] for r in rs]) for name, rs in runs.items()}
    return {"runs": runs, "summary": summary, "errors": errors}


def compared(part: dict | None, name: str) -> bool:
    """Whether `part` (a task's results) has runs of both `name` and AdamW."""
    return bool(part) and all(part["summary"].get(n, {}).get("n") for n in (name, "AdamW"))


def verdicts(bbc: dict | None, lm: dict | None) -> dict:
    """Each system against AdamW, for the systems that ran."""
    out = {}
    ran = {name for part in (bbc, lm) if part for name in part["summary"]}
    for name in [n for n in SYSTEMS if n in ran and n != "AdamW"]:
        v = {}
        if compared(bbc, name):
            d = 100 * (bbc["summary"][name]["mean"] - bbc["summary"]["AdamW"]["mean"])
            v["bbc_accuracy_diff_points"] = d
            v["bbc_within_0.5_points"] = d >= -0.5  # better than AdamW also passes
        if compared(lm, name):
            rel = lm["summary"][name]["mean"] / lm["summary"]["AdamW"]["mean"] - 1
            v["lm_loss_rel_diff_percent"] = 100 * rel
            v["lm_within_1_percent"] = rel <= 0.01
        out[name] = v
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, lbl) for k, lbl in (("bbc", "BBC News held-out accuracy"),
                                      ("lm", "Shakespeare held-out loss (nats/byte)"))
              if result.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        part = result[key]
        names = [n for n in SYSTEMS if part["runs"].get(n)]
        for x, name in enumerate(names):
            vals = [r["metric"] for r in part["runs"][name]]
            ax.scatter([x] * len(vals), vals, color="C0", alpha=0.6)
            ax.errorbar(x + 0.15, statistics.fmean(vals),
                        yerr=statistics.stdev(vals) if len(vals) > 1 else 0, fmt="o", color="C3",
                        capsize=4)
        ax.set_xticks(range(len(names)), [n.replace(" k=", "\nk=").replace(" all", "\nall")
                                          for n in names], fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(f"{label}\n(dots: seeds; red: mean +- std)", fontsize=9)
    m = result["machine"]
    fig.suptitle(f"Accuracy parity on {m['cpu']} ({m['cores']} CPUs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tasks", nargs="+", default=["bbc", "lm"], choices=["bbc", "lm"])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS)[:4], choices=list(SYSTEMS))
    ap.add_argument("--bbc-steps", type=int, default=BBCSetting.steps)
    ap.add_argument("--bbc-max-length", type=int, default=BBCSetting.max_length)
    ap.add_argument("--lm-steps", type=int, default=LMSetting.steps)
    ap.add_argument("--lm-batch-size", type=int, default=LMSetting.batch_size)
    ap.add_argument("--name", default="accuracy", help="stem of the JSON and PNG file names")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    systems = {n: SYSTEMS[n] for n in args.systems}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = {"machine": {**machine_info(device), "node": platform.node(), "device": device},
              "seeds": args.seeds, "systems": {n: {"optimizer": k, **kw} for n, (k, kw) in systems.items()}}
    t0 = time.perf_counter()
    if "bbc" in args.tasks:
        s = BBCSetting(steps=args.bbc_steps, max_length=args.bbc_max_length)
        result["bbc_setting"] = vars(s)
        print(f"BBC News: {vars(s)}", flush=True)
        result["bbc"] = run_all(BBCExperiment(s), args.seeds, systems, not args.no_progress)
    if "lm" in args.tasks:
        s = LMSetting(steps=args.lm_steps, batch_size=args.lm_batch_size)
        result["lm_setting"] = vars(s)
        print(f"Shakespeare LM: {vars(s)}", flush=True)
        result["lm"] = run_all(LMExperiment(s), args.seeds, systems, not args.no_progress)
    if "AdamW" in systems:
        result["verdicts"] = verdicts(result.get("bbc"), result.get("lm"))
    result["total_wall_s"] = time.perf_counter() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{args.name}.png")
    for key, unit in (("bbc", "accuracy"), ("lm", "held-out loss")):
        if key in result:
            print(f"\n{key}: {unit} over seeds {args.seeds}")
            for name, s in result[key]["summary"].items():
                if s.get("n"):
                    print(f"  {name:<32} mean {s['mean']:.4f}  std {s['std']:.4f}  "
                          f"[{s['min']:.4f}, {s['max']:.4f}]")
                else:
                    print(f"  {name:<32} no result: {result[key]['errors'].get(name, 'not run')}")
    if "verdicts" in result:
        print("\nvs AdamW:", json.dumps(result["verdicts"], indent=2))
    print(f"\nwrote {out / (args.name + '.json')} and {out / (args.name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
