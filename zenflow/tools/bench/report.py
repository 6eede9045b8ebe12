"""The benchmark's report from its rounds (zenflow/tools/bench/harness.py runs them): statistics of
each system's steps, the telemetry counters, speed ratios, the targets, and the terminal table.
"""
from __future__ import annotations

import statistics
from typing import Any

# Speed targets: (system, reference, at least this much faster per step). 1/0.90 against AdamW
# is "ZenFlow's step time at most 0.90x plain AdamW's".
CPU_TARGETS = [("zenflow", "adamw", 1 / 0.90), ("zenflow", "ds-zenflow", 1.65),
               ("zenflow", "ds-offload", 1.75), ("zenflow", "offload", 1.3)]
GPU_TARGETS = [("zenflow", "ds-offload", 5.0), ("zenflow", "ds-zenflow", 1.0)]


def _quantile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return float("nan")
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def describe(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "median": _quantile(s, 0.5), "p10": _quantile(s, 0.1),
            "p90": _quantile(s, 0.9), "min": s[0] if s else float("nan"),
            "max": s[-1] if s else float("nan"),
            "mean": statistics.fmean(s) if s else float("nan")}


# ----------------------------------------------------------------------------------------------
# telemetry from our optimizers' opt.stats() (zenflow.host.telemetry): cumulative counters in seconds.
STALL_KEY = "stall_s_total"   # time step() spent blocked on the host
BUSY_KEY = "host_busy_s"      # time the host side spent updating


def counter(stats: dict | None, key: str) -> float | None:
    value = stats.get(key) if isinstance(stats, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def per_step_over_measured(result: dict, key: str, steps: int) -> float | None:
    """Mean per measured step of a cumulative counter, from its values at start and end."""
    m = result.get("stats_measured") or {}
    start, end = counter(m.get("start"), key), counter(m.get("end"), key)
    if start is None or end is None:
        return None
    return (end - start) / max(steps, 1)


def window_means(step_s: list[float], window: int) -> list[float]:
    """Mean step time of each complete update window.

    A windowed optimizer has cheap steps and one expensive window-end step, so the median step
    flatters it; the mean over whole windows is the time per step that training actually pays.
    """
    n = len(step_s) // window
    return [statistics.fmean(step_s[i * window:(i + 1) * window]) for i in range(n)]


def summarise(rounds: list[dict], spec: dict) -> dict[str, Any] | None:
    ok = [r for r in rounds if r.get("ok")]
    if not ok:
        return None
    step_s = [s for r in ok for s in r["step_s"]]
    U = spec["zenflow"]["update_interval"]
    windows = [w for r in ok for w in window_means(r["step_s"], U)]
    phases = {k: describe([p[k] for r in ok for p in r["phases"]])["median"]
              for k in ("forward", "backward", "step")}
    last = ok[-1]
    stalls = [per_step_over_measured(r, STALL_KEY, spec["steps"]) for r in ok]
    stalls = [s for s in stalls if s is not None]
    busy = [per_step_over_measured(r, BUSY_KEY, spec["steps"]) for r in ok]
    busy = [b for b in busy if b is not None]
    return {
        # Headline: time per step averaged over whole update windows (see window_means).
        "window_step_s": describe(windows) if windows else describe(step_s),
        "step_s": describe(step_s),
        "round_medians_s": [describe(r["step_s"])["median"] for r in ok],
        "phase_median_s": phases,
        "phase_mean_s": {k: statistics.fmean(p[k] for r in ok for p in r["phases"])
                         for k in ("forward", "backward", "step")},
        "stall_per_step_s": statistics.median(stalls) if stalls else None,
        "host_busy_per_step_s": statistics.median(busy) if busy else None,
        "rss_peak_mb": max(r["rss_peak_mb"] for r in ok),
        "rss_peak_children_mb": max(r["rss_peak_children_mb"] for r in ok),
        "rss_after_model_mb": max(r["rss_after_model_mb"] for r in ok),
        "device_peak_mb": max((r["device_peak_mb"] for r in ok if "device_peak_mb" in r), default=None),
        "setup_s": statistics.median(r["setup_s"] for r in ok),
        "loss_given_weights": last["loss_given_weights"],
        # Differs from loss_given_weights when a system changed the weights it was given.
        "loss_first_step": last["losses"][0],
        "loss_final": last["losses"][-1],
        # Mean of the last update window: less sensitive to where a window boundary falls.
        "loss_final_window": statistics.fmean(last["losses"][-spec["zenflow"]["update_interval"]:])
        if isinstance(spec["zenflow"]["update_interval"], int) else last["losses"][-1],
        "eval_loss": last.get("eval_loss"),
        "num_params": last["num_params"],
    }


def speed_ratios(per_system: dict[str, dict]) -> dict[str, dict[str, float]]:
    """ratios[a][b] = time per step of b / time per step of a ("a is x times faster").

    Time per step is the median over update windows of the window's mean step time.
    """
    med = {n: e["summary"]["window_step_s"]["median"] for n, e in per_system.items() if e.get("summary")}
    return {a: {b: med[b] / med[a] for b in med if b != a} for a in med}


def check_targets(report: dict, device: str) -> list[dict[str, Any]]:
    ratios = report["ratios"]
    targets = []
    for system, ref, at_least in (GPU_TARGETS if device == "cuda" else CPU_TARGETS):
        measured = ratios.get(system, {}).get(ref)
        targets.append({"claim": f"{system} >= {at_least}x faster per step than {ref}",
                        "measured": measured,
                        "met": None if measured is None else measured >= at_least})
    zenflow = report["systems"].get("zenflow", {}).get("summary")
    if zenflow and zenflow.get("stall_per_step_s") is not None:
        share = zenflow["stall_per_step_s"] / zenflow["window_step_s"]["median"]
        targets.append({"claim": "zenflow stall within 5% of the step", "measured": share,
                        "met": share <= 0.05})
    # Final losses of the ZenFlow runs within 2% of each other (held-out eval loss: the training
    # loss of one 32-token batch is too noisy to compare).
    finals = {n: e["summary"]["eval_loss"] for n, e in report["systems"].items()
              if e.get("summary") and n in ("zenflow", "zenflow-sync", "ds-zenflow")}
    if len(finals) >= 2:
        spread = (max(finals.values()) - min(finals.values())) / min(finals.values())
        targets.append({"claim": "ZenFlow final losses within 2% of each other",
                        "measured": spread, "losses": finals, "met": spread <= 0.02})
    return targets


def format_table(report: dict) -> str:
    errors: list[str] = []
    rows = [("system", "ms/step", "p10-p90", "median", "fwd", "bwd", "step()", "stall", "busy",
             "RSS MB", "child MB", "dev MB", "loss@w0", "start", "final", "eval")]
    for name, e in report["systems"].items():
        s = e.get("summary")
        if not s:
            rows.append((name, "-", "-", "-", *[""] * 12))
            errors.append(f"{name}: {(e.get('error') or 'no result').splitlines()[0][:200]}")
            continue
        st, ph = s["window_step_s"], s["phase_median_s"]
        stall, busy = s["stall_per_step_s"], s["host_busy_per_step_s"]
        rows.append((
            name, f"{st['median'] * 1e3:.1f}", f"{st['p10'] * 1e3:.0f}-{st['p90'] * 1e3:.0f}",
            f"{s['step_s']['median'] * 1e3:.1f}",
            f"{ph['forward'] * 1e3:.0f}", f"{ph['backward'] * 1e3:.0f}", f"{ph['step'] * 1e3:.0f}",
            "-" if stall is None else f"{stall * 1e3:.1f}",
            "-" if busy is None else f"{busy * 1e3:.1f}",
            f"{s['rss_peak_mb']:.0f}", f"{s['rss_peak_children_mb']:.0f}",
            "-" if s["device_peak_mb"] is None else f"{s['device_peak_mb']:.0f}",
            f"{s['loss_given_weights']:.4f}", f"{s['loss_first_step']:.4f}",
            f"{s['loss_final_window']:.4f}",
            "-" if s["eval_loss"] is None else f"{s['eval_loss']:.4f}"))
    widths = [max(len(str(r[i])) for r in rows if len(r) > i) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("ms/step: mean step time over an update window (median over windows, p10-p90); "
                 "median: median single step;")
    lines.append("fwd/bwd/step(): median phase times; stall: wait for the host per step; "
                 "busy: host update time per step; RSS / child MB: peak RSS "
                 "of the main process / of its largest child process (shared memory in both); "
                 "loss@w0: loss of the given weights, start: first training loss, final: mean of "
                 "the last window, eval: held-out batch")
    lines.extend(errors)
    ratios = report["ratios"]
    if len(ratios) > 1:
        names = list(ratios)
        lines.append("")
        lines.append("speed-up (row is x times faster per step than column):")
        w = max(len(n) for n in names)
        lines.append(" " * (w + 2) + "  ".join(n.rjust(12) for n in names))
        for a in names:
            cells = ["1.00".rjust(12) if a == b else f"{ratios[a][b]:.2f}".rjust(12) for b in names]
            lines.append(a.ljust(w + 2) + "  ".join(cells))
    if report.get("targets"):
        lines.append("")
        for t in report["targets"]:
            m = t["measured"]
            shown = "n/a" if m is None else (f"{m:.2%}" if "within" in t["claim"] else f"{m:.2f}x")
            verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            lines.append(f"target: {t['claim']}: {shown} ({verdict})")
    return "\n".join(lines)
