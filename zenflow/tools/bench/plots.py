"""PNG plots of a `zenflow bench` report: step-time bars with the ratio matrix, and a timeline."""
from __future__ import annotations

import os
from typing import Any

from zenflow.tools.bench.report import BUSY_KEY, STALL_KEY, counter

PHASE_COLORS = {"forward": "#4C72B0", "backward": "#55A868", "step": "#C44E52"}


def _title(report: dict) -> str:
    c, m = report["config"], report["machine"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cores']} cores"
    return (f"{c['num_params'] / 1e6:.0f}M-param GPT, batch {c['batch_size']}x{c['model']['seq_len']}, "
            f"{c['dtype']} on {c['device']} ({where})")


def write_plots(report: dict, path: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    root, ext = os.path.splitext(path)
    timeline_path = f"{root}_timeline{ext or '.png'}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plot_step_times(report, path)
    plot_timeline(report, timeline_path)
    return [path, timeline_path]


def plot_step_times(report: dict, path: str) -> None:
    import matplotlib.pyplot as plt
    done = {n: e for n, e in report["systems"].items() if e.get("summary")}
    names = list(done)
    fig, (ax, axr) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.2, 1]})
    # Left: time per step (mean over whole update windows) split into mean phases, with the
    # p10-p90 spread over windows.
    for i, n in enumerate(names):
        s = done[n]["summary"]
        bottom = 0.0
        for phase, color in PHASE_COLORS.items():
            h = s["phase_mean_s"][phase] * 1e3
            ax.bar(i, h, bottom=bottom, color=color, label=phase if i == 0 else None, width=0.65)
            bottom += h
        st = s["window_step_s"]
        med = st["median"] * 1e3
        ax.errorbar(i + 0.38, med, yerr=[[med - st["p10"] * 1e3], [st["p90"] * 1e3 - med]],
                    fmt="_", color="black", capsize=3)
        ax.text(i, max(bottom, med) * 1.02, f"{med:.0f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("ms per step (window mean); whisker: p10-p90 over windows")
    ax.set_title("time per step by phase")
    ax.legend(loc="upper left")
    # Right: how many times faster each row is than each column.
    ratios = report["ratios"]
    import numpy as np
    mat = np.array([[1.0 if a == b else ratios[a][b] for b in names] for a in names])
    im = axr.imshow(np.log2(mat), cmap="RdYlGn", vmin=-3, vmax=3)
    for i in range(len(names)):
        for j in range(len(names)):
            axr.text(j, i, f"{mat[i, j]:.2f}x", ha="center", va="center", fontsize=9)
    axr.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axr.set_yticks(range(len(names)), names)
    axr.set_title("speed-up: row is x times faster than column")
    fig.colorbar(im, ax=axr, fraction=0.046, label="log2 ratio")
    fig.suptitle(_title(report))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _per_step_deltas(stats_per_step: list[Any], key: str, before: Any) -> list[float | None]:
    """Per-step increments of a cumulative telemetry counter (`before`: stats before step 1)."""
    values = [counter(s, key) for s in stats_per_step]
    out: list[float | None] = []
    prev = counter(before, key)
    for v in values:
        out.append(None if v is None or prev is None else max(v - prev, 0.0))
        prev = v if v is not None else prev
    return out


def plot_timeline(report: dict, path: str) -> None:
    """A few consecutive measured steps per system (first round), on a common time axis.

    Each step is drawn as forward, backward and step(); where our optimizers report it, the
    part of step() spent waiting on the host worker (stall) is hatched, and the host updates are
    drawn as a thin bar below (their recorded spans, or else the busy time added in each step).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    done = [(n, e["rounds"][0]) for n, e in report["systems"].items()
            if e.get("summary") and e["rounds"] and e["rounds"][0].get("ok")]
    fig, ax = plt.subplots(figsize=(15, 1.8 + 0.8 * max(len(done), 1)))
    for row, (name, r) in enumerate(done):
        y = len(done) - 1 - row
        tl = r["timeline"]
        if not tl:
            continue
        t0 = tl[0]["start"]
        before = (r.get("stats_measured") or {}).get("start")
        stalls = _per_step_deltas(r.get("stats_per_step") or [], STALL_KEY, before)
        busy = _per_step_deltas(r.get("stats_per_step") or [], BUSY_KEY, before)
        spans = r.get("host_update_spans") or []
        for a, b in spans:  # the host update's own start and end, where the optimizer records it
            ax.barh(y - 0.36, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.12, color="#8172B2")
        for k, st in enumerate(tl):
            x = (st["start"] - t0) * 1e3
            for phase, color in PHASE_COLORS.items():
                w = st[phase] * 1e3
                ax.barh(y, w, left=x, height=0.5, color=color, edgecolor="white", linewidth=0.3)
                if phase == "step" and k < len(stalls) and stalls[k]:
                    ax.barh(y, min(stalls[k] * 1e3, w), left=x, height=0.5, color="none",
                            hatch="////", edgecolor="black", linewidth=0)
                x += w
            if k < len(busy) and busy[k] and not spans:
                ax.barh(y - 0.36, busy[k] * 1e3, left=(st["start"] - t0) * 1e3, height=0.12,
                        color="#8172B2")
    ax.set_yticks(range(len(done)), [n for n, _ in reversed(done)])
    ax.set_xlabel("time since first measured step (ms)")
    fig.legend(handles=[Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
               + [Patch(facecolor="none", hatch="////", edgecolor="black", label="stall in step()"),
                  Patch(color="#8172B2", label="host update running")],
               loc="lower center", ncol=5, frameon=False)
    ax.set_title("timeline of measured steps (round 1): " + _title(report))
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
