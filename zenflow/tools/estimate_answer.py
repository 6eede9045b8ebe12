"""The answer `zenflow estimate` prints first: what to use and why (the window, the step time
against ZeRO-Offload and against the floor, device and host memory, the bus), in a few lines
that read the estimate() dict and agree with the tables printed after them. No torch."""
from __future__ import annotations

import textwrap

from zenflow.optim.windows import WINDOW_BUDGET

GIB = 1 << 30
WINDOW_BOUNDS = (1, 16)   # update_interval="auto"'s (estimate_time.WINDOW_BOUNDS: no torch here)
# what each assumed figure is called in the answer
FIGURE_NAMES = {"host_adamw_params_per_s": "host AdamW",
                "host_factored_params_per_s": "host \"factored\" update",
                "host_accumulate_params_per_s": "host accumulate",
                "host_reselect_params_per_s": "host column moves",
                "device_adamw_params_per_s": "device AdamW",
                "device_norm_bytes_per_s": "gradient norm", "device_copy_bytes_per_s":
                "device copies", "device_pass_bytes_per_s": "device passes",
                "device_fingerprint_bytes_per_s": "fingerprints",
                "d2h_bytes_per_s": "device->host", "h2d_bytes_per_s": "host->device",
                "memcpy_bytes_per_s": "memcpy"}


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def num(x: float) -> str:
    """A figure as 2.5e10."""
    return f"{x:.2g}".replace("e+0", "e").replace("e+", "e")


def secs(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def _unit(r: dict) -> str:
    return "GPU" if r["settings"]["target"] == "cuda" else "CPU device"


def verdict(r: dict) -> str:
    """What to use, in one sentence (and what the host needs, where it is short)."""
    h = r["per_host"]
    short = ("" if h["fits"]["zenflow"] else
             f" It needs {gib(h['zenflow']['arena_bytes'])} of host RAM: more than "
             f"{h['available_from']} has (host memory, below).")
    return _verdict(r) + short


def _verdict(r: dict) -> str:
    g, tm, unit = r["per_gpu"], r["time"], _unit(r)
    mem = gib(g["gpu_memory_bytes"])
    left = g["left_for_activations_bytes"]
    cpu = r["settings"]["target"] == "cpu"
    if not cpu and not g["fits"]["zenflow"]:
        return (f"ZenFlowAdamW does not fit on one {unit} of {mem}: weights, gradients and its "
                f"column state need {gib(-left['zenflow'])} more. Shard the model (--fsdp N) or "
                "lower --topk-ratio" + (
                    f"; OffloadAdamW (ZeRO-Offload) fits, leaving {gib(left['offload'])}."
                    if g["fits"]["offload"] else "."))
    if not cpu and g["fits"]["adamw_fp32_master"]:
        return (f"No offload needed: torch's AdamW with fp32 master weights fits on one {unit} "
                f"of {mem} ({gib(left['adamw_fp32_master'])} left for activations); "
                f"ZenFlowAdamW would leave {gib(left['zenflow'])}.")
    where = (f"on one {unit} of {mem} where mixed-precision AdamW does not fit" if not cpu
             else "on the CPU device (the proxy: its 'device' is this host)")
    if "zenflow_step_s" not in tm:
        return (f"ZenFlowAdamW fits {where} ({gib(left['zenflow'])} left for activations); its "
                "window and step time depend on your forward+backward time (below).")
    if tm["zenflow_step_s"] < tm["offload_step_s"]:
        return (f"Use ZenFlowAdamW: {secs(tm['zenflow_step_s'])} a step, "
                f"{tm['speedup_vs_offload']:.1f}x faster than ZeRO-Offload "
                f"({secs(tm['offload_step_s'])}) and {tm['zenflow_vs_floor']:.2f}x the AdamW "
                f"floor ({secs(tm['adamw_step_s'])}), {where}.")
    return (f"ZeRO-Offload (OffloadAdamW) is as fast here: {secs(tm['offload_step_s'])} a step "
            f"against ZenFlowAdamW's {secs(tm['zenflow_step_s'])}, {where}; ZenFlowAdamW's host "
            "work does not hide behind so short a step.")


def window_line(r: dict) -> list[str]:
    """Which window, and why that one (or, without a step time, what it depends on)."""
    s, t, tm, q = r["settings"], r["seconds"], r["time"], r["quality"]
    U, host = s["update_interval"], secs(t["adamw_s"])
    rate = host_rate(r)
    if r["by_step_time"]:   # no forward+backward time given
        ask = ("pass --fwd-bwd-seconds S (forward+backward of one step, as your loop times "
               "it). ")
        if s["window_known"]:
            why = ("as given" if s["update_interval_asked"] != "auto" else
                   "overlap_step off: each window's host update waits in the step")
            head = (f"window: {U} step(s) ({why}); step time: not modelled without your step "
                    f"time: {ask}By forward+backward time:")
        else:
            head = ("window and step time: not modelled without your step time: " + ask
                    + "The window update_interval='auto' settles at is the host's update of a "
                    f"window ({host} here, {rate}) over the device's step, so by "
                    "forward+backward time:")
        return [head] + _by_step_time(r)
    how = ("update_interval 'auto' settles at" if s["update_interval_asked"] == "auto"
           else "update_interval, as given:")
    line = f"window: {how} {U} step(s)"
    if not s["overlap_step"]:
        line += f": overlap_step off, so each window's host update ({host}) waits in the step"
    elif "zenflow_step_s" in tm:
        cover, install = (tm["min_update_interval_hiding_host"],
                          tm["update_interval_for_install_budget"])
        if cover is None:
            line += (f": the host's per-step accumulate ({secs(t['accumulate_s'])}) outlasts "
                     f"the device's step ({secs(tm['zenflow_T_dev_s'])}), so no window hides "
                     "the host" + ("; auto takes its longest"
                                   if s["update_interval_asked"] == "auto" else ""))
        else:
            line += (f": the host's update of a window ({host}, {rate}) needs "
                     f"{cover} step(s) of {secs(tm['zenflow_T_dev_s'])} to hide, and the "
                     f"install and fingerprints ({secs(t['install_wait_s'] + t['fingerprint_s'])} the "
                     f"device waits or works a window) {install} to stay within "
                     f"{WINDOW_BUDGET:.0%} of the time")
            if U < max(cover, install):
                line += (f"; at {U} the step waits {secs(tm['zenflow_stall_s'])} for them"
                         if s["update_interval_asked"] != "auto" else
                         f"; {U} is the longest auto takes")
    gap = f"{q['held_out_loss_gap_pct']:+.1f}%" + (" or more" if q["beyond_measured"] else "")
    if tm.get("attached_window", U) < U:   # (modelled where the model is not attached)
        line += (f". With the model attached (opt.attach(model), or the callbacks' attach=True; "
                 f"--attach) each layer waits only for its own installs: "
                 f"{tm['attached_window']} step(s), {tm['attached_vs_floor']:.2f}x the floor")
    return [line + f". Quality cost at {U} step(s): about {gap} held-out loss against AdamW "
            "(the fine-tune benchmark; a small model's, for the trend)."]


def _by_step_time(r: dict) -> list[str]:
    """The table of window, step times and quality by forward+backward time."""
    out = [f"    {'fwd+bwd':>8} {'window':>7} {'ZenFlowAdamW':>13} {'ZeRO-Offload':>13} "
           f"{'AdamW floor':>12} {'quality':>8}"]
    for row in r["by_step_time"]:
        out.append(f"    {secs(row['fwd_bwd_s']):>8} {row['window']:>7} "
                   f"{secs(row['zenflow_step_s']):>13} {secs(row['offload_step_s']):>13} "
                   f"{secs(row['adamw_step_s']):>12} {row['quality_gap_pct']:>+7.1f}%")
    if any(row["window"] == WINDOW_BOUNDS[1] for row in r["by_step_time"]):
        out.append(f"    ({WINDOW_BOUNDS[1]}: auto's longest window; behind shorter steps "
                   "the host's update stays exposed)")
    return out


def step_line(r: dict) -> list[str]:
    tm = r["time"]
    if "zenflow_step_s" not in tm:
        return []
    lines = [f"step: ZenFlowAdamW {secs(tm['zenflow_step_s'])} (of it waiting "
             f"{secs(tm['zenflow_stall_s'])} beyond the device's own work), ZeRO-Offload "
             f"{secs(tm['offload_step_s'])}, the AdamW floor {secs(tm['adamw_step_s'])} "
             f"(forward+backward {secs(tm['fwd_bwd_s'])} given, plus one device AdamW)."]
    if tm.get("cpu_bound_risk"):
        lines.append(f"CPU-BOUND RISK: step() keeps the training thread "
                     f"{secs(tm['zenflow_python_s'])} a step, more than half the "
                     f"forward+backward, whose own launches come on top: the device may wait "
                     f"for Python (longer steps, a larger batch or fewer, larger matrices "
                     f"help).")
    return lines


def reselect_line(r: dict) -> list[str]:
    """What one reselection costs: the moves of the columns' state while the device waits."""
    cost, tm = r["seconds"].get("reselect_s", 0.0), r["time"]
    if not cost:   # no column can move (topk_ratio 0 or 1)
        return []
    steps = (f" ({cost / tm['zenflow_step_s']:.1f} steps)"
             if "zenflow_step_s" in tm and cost >= 0.05 * tm["zenflow_step_s"] else "")
    return [f"reselection: the device waits about {secs(cost)}{steps} for one, every selected "
            f"column moving its master value and moments between the device and the host (the "
            f"host's column moves at {_figure(r, 'host_reselect_params_per_s', 'params/s')}). "
            "select_strategy 'drift' (the default) reselects when the selection drifts, as often "
            "as your gradients make it: stats()['reselect_s_total'] counts them, and a warning "
            "names the select_interval that keeps them within 5%."]


def device_line(r: dict) -> str:
    g, s, unit = r["per_gpu"], r["settings"], _unit(r)
    left = g["left_for_activations_bytes"]
    names = {"zenflow": "ZenFlowAdamW", "offload": "OffloadAdamW", "adamw": "AdamW",
             "adamw_fp32_master": "AdamW with fp32 master weights"}
    each = ", ".join(f"{name} {gib(left[k]) if g['fits'][k] else 'does NOT fit'}"
                     for k, name in names.items())
    sums = (f"The window sums of {g['device_sum_matrices']} of "
            f"{g['device_sum_matrices'] + g['host_sum_matrices']} matrices live on the device "
            f"({gib(g['device_sum_bytes'])}, {g['moments_matrices']} under "
            f"'{g['credit_rule']}'), out of "
            "what the activations leave (device_sum_budget 'auto' measures it; here "
            f"{s['activation_bytes'] / GIB:.1f} GiB of activations, "
            f"{s.get('activation_note') or 'as given'}; --activation-gib for yours)."
            if g["device_sum_matrices"] else "Every window sum is on the host.")
    return (f"device memory ({unit}, {gib(g['gpu_memory_bytes'])}), left for activations: "
            f"{each}. {sums}")


def host_line(r: dict) -> str:
    h, s = r["per_host"], r["settings"]
    z, o = h["zenflow"], h["offload"]
    where = h["available_from"]
    fits = "fits" if h["fits"]["zenflow"] else "does NOT fit"
    extra = [w for w, on in (("a second fp32 window-sum slot for overlap_step", s["overlap_step"]),
                             ("the 'moments' rates", s["host_rates"])) if on]
    why = (f" (more than OffloadAdamW's: {', and '.join(extra)})"
           if z["host_bytes"] > o["host_bytes"] and extra else "")
    if s.get("host_moments_dtype") == "bfloat16":
        why += " with its moments in bf16 (host_moments_dtype: 4 bytes a parameter less)"
    return (f"host memory: ZenFlowAdamW {gib(z['arena_bytes'])} of RAM{why}, "
            f"{gib(z['pinned_bytes'])} of it page-locked; OffloadAdamW {gib(o['arena_bytes'])}. "
            f"{where.capitalize()} has {gib(h['available_host_bytes'])} available: it {fits}"
            + ("." if h["fits"]["zenflow"] else "; run on a host with more RAM, or more GPUs "
               "(each rank keeps only its rows)."))


def bus_line(r: dict) -> str:
    z, o = r["bus"]["zenflow"], r["bus"]["offload"]
    per_window = (f"{gib(z['d2h_bytes_per_window'])} down and {gib(z['h2d_bytes_per_window'])} "
                  "up a window")
    off = (o["d2h_bytes_per_step"] + o["h2d_bytes_per_step"]) / z["model_bytes"]
    if not r["settings"]["window_known"]:
        return (f"bus: ZenFlowAdamW {per_window} (a step: that over the window); ZeRO-Offload "
                f"{off:.2f}x the model's bytes every step.")
    both = (z["d2h_bytes_per_step"] + z["h2d_bytes_per_step"]) / z["model_bytes"]
    return (f"bus: ZenFlowAdamW {both:.2f}x the model's bytes a step both ways ({per_window}), "
            f"ZeRO-Offload {off:.2f}x.")


def figures_line(r: dict) -> str:
    assumed = r.get("figures_assumed") or []
    if not assumed:
        return "figures: measured by `zenflow selftest` (--selftest-json)."
    return ("figures ASSUMED, not measured: " + ", ".join(
        f"{FIGURE_NAMES.get(k, k)} {num(r['figures'][k])}" for k in assumed)
        + ". Run `zenflow selftest --json FILE` on the training machine and pass "
        "--selftest-json FILE for its own.")


def host_rate(r: dict) -> str:
    """The host figure that sets a window's update: "factored"'s where its matrices are."""
    g = r["per_gpu"]
    if g.get("credit_rule") == "factored" and g.get("moments_matrices"):
        return f"the \"factored\" update at {_figure(r, 'host_factored_params_per_s', 'params/s')}"
    return f"host AdamW at {_figure(r, 'host_adamw_params_per_s', 'params/s')}"


def _figure(r: dict, key: str, unit: str) -> str:
    how = "assumed" if key in (r.get("figures_assumed") or []) else "measured"
    return f"{num(r['figures'][key])} {unit}, {how}"


def answer(r: dict, width: int = 100) -> list[str]:
    """The answer's lines, verdict first, each reason wrapped under its own bullet (the table of
    windows by forward+backward time as it is)."""
    out = textwrap.wrap("Answer: " + verdict(r), width, subsequent_indent="  ",
                        break_on_hyphens=False)
    for line in window_line(r) + step_line(r) + reselect_line(r) + [
            device_line(r), host_line(r), bus_line(r), figures_line(r)]:
        out += ([line] if line.startswith("    ") else
                textwrap.wrap(line, width, initial_indent="  - ", subsequent_indent="    ",
                              break_on_hyphens=False))
    return out
