"""The bf16 table of issue 36: combine benchmarks/results/bf16/*.json (finetune_quality.py --dtype
bf16 runs, one file per direction, learning rate, seed and set of systems) into one table.

For each direction and learning rate, each system's held-out losses over the seeds it ran, its gap
to the baseline (OffloadAdamW: fp32 master weights and moments, the same bf16 model) computed seed
by seed against that seed's baseline run (mean ± std over seeds), the old domain's gap, and its
share of the baseline's improvement over the pretrained model, (L0 - L) / (L0 - L_base). Runs on
several data-parallel ranks (finetune_quality.py --ranks N) are rows of their own, the system's
name suffixed " (N ranks)", against the same single-process baseline. Writes
benchmarks/results/finetune_quality_bf16.json (the table and every run, the machines named) and
finetune_quality_bf16.png, and prints the table as markdown.

    python benchmarks/bf16_table.py [--dir benchmarks/results/bf16] [--name finetune_quality_bf16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def spread(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def load(folder: Path) -> dict:
    """{(direction, lr): {"runs": {(system, seed): run}, "pretrained": ..., "machines": set}}."""
    groups: dict = defaultdict(lambda: {"runs": {}, "machines": set(), "files": []})
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        if result.get("setting", {}).get("dtype") != "bf16":
            continue
        key = (result["direction"], result["setting"]["lr"])
        group = groups[key]
        group.update(pretrained=result["pretrained_loss"], baseline=result["baseline"],
                     lr_in_bf16_ulps=result["lr_in_bf16_ulps"],
                     median_matrix_weight=result["median_matrix_weight"],
                     compute=result["setting"]["compute"], steps=result["setting"]["steps"])
        group["machines"].add(result["machine"])
        group["files"].append(path.name)
        for run in result["runs"]:
            run = dict(run, machine=result["machine"], system_settings=result["systems"].get(
                run["system"]))
            if run.get("ranks", 1) > 1:   # --ranks N: N data-parallel replicas, a row of its own
                run["system"] = f"{run['system']} ({run['ranks']} ranks)"
            group["runs"][(run["system"], run["seed"])] = run   # a rerun replaces an older one
    return groups


def table(group: dict) -> dict:
    runs, base_name = group["runs"], group["baseline"]
    base = {seed: r for (system, seed), r in runs.items() if system == base_name}
    l0 = group["pretrained"]["new"]
    systems: list[str] = []
    for system, _ in runs:
        if system not in systems:
            systems.append(system)
    out = {}
    for system in systems:
        mine = sorted((r for (s, _), r in runs.items() if s == system), key=lambda r: r["seed"])
        paired = [r for r in mine if r["seed"] in base]
        if not paired:
            continue
        entry = {
            "seeds": [r["seed"] for r in paired],
            "new_loss": spread([r["new_loss"] for r in paired]),
            "old_loss": spread([r["old_loss"] for r in paired]),
            "new_gap_pct": spread([100 * (r["new_loss"] / base[r["seed"]]["new_loss"] - 1)
                                   for r in paired]),
            "old_gap_pct": spread([100 * (r["old_loss"] / base[r["seed"]]["old_loss"] - 1)
                                   for r in paired]),
            "share_of_improvement": spread([(l0 - r["new_loss"])
                                            / (l0 - base[r["seed"]]["new_loss"])
                                            for r in paired]),
            "mean_window_steps": [r.get("mean_window_steps") for r in paired],
            "moments_matrices": [r.get("moments_matrices") for r in paired],
        }
        for key in ("per_deferred_param", "bus_bytes_per_window_per_deferred_param"):
            values = [r[key] for r in paired if r.get(key) is not None]
            if values:
                entry[key] = statistics.fmean(values)
        out[system] = entry
    return out


def markdown(direction: str, group: dict, rows: dict) -> str:
    lines = [f"{direction}, peak lr {group['_lr']:.3g} ({group['lr_in_bf16_ulps']:.3g} bf16 ulps "
             f"of the median matrix weight {group['median_matrix_weight']:.3g}), pretrained "
             f"held-out loss {group['pretrained']['new']:.4f}:", "",
             "| system | seeds | window | new domain | vs baseline | old vs baseline | share |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for system, e in rows.items():
        windows = [w for w in e["mean_window_steps"] if w is not None]
        window = f"{statistics.fmean(windows):.1f}" if windows else ""
        lines.append(
            f"| {system} | {len(e['seeds'])} | {window} | {e['new_loss']['mean']:.4f} ± "
            f"{e['new_loss']['std']:.4f} | {e['new_gap_pct']['mean']:+.2f}% ± "
            f"{e['new_gap_pct']['std']:.2f} | {e['old_gap_pct']['mean']:+.2f}% ± "
            f"{e['old_gap_pct']['std']:.2f} | {100 * e['share_of_improvement']['mean']:.0f}% ± "
            f"{100 * e['share_of_improvement']['std']:.0f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    panels = result["tables"]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 0.28 * max(
        len(p["rows"]) for p in panels) + 1.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        names = [n for n in panel["rows"] if n != panel["baseline"]]
        metric = "share_of_improvement" if panel["lr_in_bf16_ulps"] < 1 else "new_gap_pct"
        scale = 100 if metric == "share_of_improvement" else 1
        means = [scale * panel["rows"][n][metric]["mean"] for n in names]
        stds = [scale * panel["rows"][n][metric]["std"] for n in names]
        ax.barh(range(len(names)), means, xerr=stds, color="tab:blue", alpha=0.7)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        if metric == "new_gap_pct":
            ax.axvline(1, color="tab:red", ls="--", lw=0.8, label="+1%")
            ax.axvline(2, color="tab:orange", ls="--", lw=0.8, label="+2%")
            ax.set_xlabel("held-out loss vs OffloadAdamW (%), mean ± std over seeds")
        else:
            ax.axvline(100, color="k", lw=0.8, label="OffloadAdamW")
            ax.set_xlabel("share of OffloadAdamW's improvement (%), mean ± std over seeds")
        ax.legend(fontsize=7)
        ax.set_title(f"{panel['direction']}, lr {panel['lr']:.3g} "
                     f"({panel['lr_in_bf16_ulps']:.2g} ulp)", fontsize=9)
    fig.suptitle("bf16 weights: " + "; ".join(sorted(result["machines"])), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="benchmarks/results/bf16")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="finetune_quality_bf16")
    args = ap.parse_args(argv)
    groups = load(Path(args.dir))
    tables, machines = [], set()
    for (direction, lr), group in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        group["_lr"] = lr
        rows = table(group)
        machines |= group["machines"]
        print(markdown(direction, group, rows) + "\n")
        tables.append({"direction": direction, "lr": lr, "baseline": group["baseline"],
                       "lr_in_bf16_ulps": group["lr_in_bf16_ulps"],
                       "median_matrix_weight": group["median_matrix_weight"],
                       "compute": group["compute"], "steps": group["steps"],
                       "pretrained_loss": group["pretrained"], "machines": sorted(group["machines"]),
                       "files": group["files"], "rows": rows})
    result = {"benchmark": "finetune_quality --dtype bf16 (issue 36)", "machines": sorted(machines),
              "tables": tables,
              "runs": [dict(r, direction=d, lr=lr) for (d, lr), g in groups.items()
                       for r in g["runs"].values()]}
    for run in result["runs"]:
        run.pop("losses", None)   # the per-step losses stay in the per-run files
    out = Path(args.out)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{args.name}.png")
    print(f"wrote {out / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
