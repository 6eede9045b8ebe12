"""`zenflow estimate`'s step-time model: what a step costs each optimizer given the work of
estimate_terms.py, the window update_interval="auto" settles at, and the fine-tune quality that
window costs.

Commands to the host's worker leave as soon as the copies they read have landed (a thread waits
for the copies' CUDA events), so the model has no dispatch delay: a window's host update starts
when its last gradients are on the host, not a step later.
"""
from __future__ import annotations

import math

from zenflow.optim.windows import WINDOW_BUDGET
from zenflow.tools import estimate_terms as cost
from zenflow.tools.estimate_terms import Counts, Speeds

# The backward's share of forward+backward (about 2 of 3 flops: the weight and the input
# gradients). Host-summed rows start their copy in post-accumulate-grad hooks as backward produces
# them (zenflow/host/early_copies.py), so this much of the copy hides behind it.
BACKWARD_SHARE = 2 / 3
# The windows update_interval="auto" chooses from (zenflow/optim/windows.py's bounds).
WINDOW_BOUNDS = (1, 16)

# What a window's length costs in fine-tune quality: the defaults' held-out loss against AdamW's at
# windows of 1, 4 and 8 steps (benchmarks/finetune_quality.py: a byte-level GPT pretrained on
# Shakespeare, fine-tuned 300 steps on BBC News, mean of 3 seeds; benchmarks/README.md). One small
# model's fine-tune: it shows how the cost grows with the window, not what your model will lose.
# "mean" is deferred_credit="mean" (and what "moments" falls back to where a matrix's sums are on
# the host); "moments" where they are on the device.
QUALITY_BY_WINDOW = {"mean": ((1, 0.35), (4, 4.9), (8, 6.1)),
                     "moments": ((1, 0.35), (4, 0.75), (8, 1.17)),
                     # bf16 weights against fp32-master AdamW, bf16 sums (seed 0, new domain;
                     # benchmarks/results/bf16): a one-step window is any rule's; 3, 5, 7, 10
                     # and 14 steps: auto windows (an H100's, attached and not, at install
                     # budgets of 8% and 5%; a Gen4 link's), mean of 3 seeds. 3 steps measured
                     # no better than 4 or 5 here (within the seeds' spread)
                     "factored": ((1, 0.35), (3, 1.14), (4, 0.94), (5, 1.08), (7, 1.16),
                                  (8, 1.24), (10, 1.48), (14, 1.88))}


def expected_quality_gap(window: int, credit: str = "mean") -> float:
    """The held-out loss gap (percent) QUALITY_BY_WINDOW[credit] gives a window of `window`
    steps: linear between the measured lengths, the last measured value beyond them."""
    (first, gap), *rest = QUALITY_BY_WINDOW[credit]
    if window <= first:
        return gap
    for length, next_gap in rest:
        if window <= length:
            return gap + (next_gap - gap) * (window - first) / (length - first)
        first, gap = length, next_gap
    return gap


def quality(window: int, moving_share: float, rule: str = "moments") -> dict:
    """The expected quality cost at `window` steps, where `moving_share` of the deferred
    parameters take `rule` ("moments" or "factored") and the rest "mean": the two measured
    gaps, weighted."""
    moving = rule if rule in QUALITY_BY_WINDOW else "moments"
    gap = (moving_share * expected_quality_gap(window, moving)
           + (1 - moving_share) * expected_quality_gap(window, "mean"))
    return {"window_steps": window, "held_out_loss_gap_pct": gap,
            "moments_share": moving_share, "rule": moving,
            "beyond_measured": window > QUALITY_BY_WINDOW["mean"][-1][0],
            "measured": {credit: dict(table) for credit, table in QUALITY_BY_WINDOW.items()},
            "source": "benchmarks/finetune_quality.py (a small model's fine-tune)"}


def exposed_d2h(t: dict) -> float:
    """The part of the host-summed rows' copy that the compute stream waits for at step()'s end:
    what neither the backward (`d2h_hidden_s`) nor the device update hides."""
    return max(0.0, t["d2h_s"] - t["d2h_hidden_s"] - t["device_update_s"] - t["sum_add_s"])


def device_time(t: dict, cpu: bool, fwd_bwd_s: float) -> float:
    """The compute stream's time per step outside window ends: forward and backward, the device
    update and the sums' add, and what is left of the copy of host-summed rows (started in
    backward, it runs beside the rest of it and the update; step()'s end waits for it). CPU: the
    training thread copies (the proxy this model is calibrated on; not modelled with hooks)."""
    if cpu:
        return fwd_bwd_s + t["device_update_s"] + t["d2h_s"]
    return fwd_bwd_s + t["device_update_s"] + t["sum_add_s"] + exposed_d2h(t)


def window_needs(t: dict, fwd_bwd_s: float, cpu: bool) -> tuple[int, int] | None:
    """(steps to hide the host, steps for the window budget): the fewest steps whose device
    time covers the host's AdamW beside the per-step accumulate, and the fewest over which a
    window's fixed costs (the install the device waits for and the window's fingerprints) take
    at most WINDOW_BUDGET of the time. None: the per-step accumulate alone outlasts the
    device's step, and no window hides the host."""
    T_dev = device_time(t, cpu, fwd_bwd_s)
    if t["accumulate_s"] >= T_dev:
        return None
    cover = math.ceil(t["adamw_s"] / (T_dev - t["accumulate_s"]) - 1e-9)
    fixed = t["install_wait_s"] + t["fingerprint_s"]
    budget = math.ceil(fixed / (WINDOW_BUDGET * T_dev) - 1e-9)
    return max(1, cover), max(1, budget)


def expected_window(t: dict, fwd_bwd_s: float | None, cpu: bool, overlap: bool,
                    bounds: tuple[int, int] = WINDOW_BOUNDS, ranks: int = 1) -> int:
    """The window update_interval="auto" settles at (zenflow/optim/windows.py): long enough for
    the host to finish a window's update behind the device's steps, and for its fixed costs to
    take at most WINDOW_BUDGET of the window's time. On several ranks a window ends one step after
    every rank's rule said so (the step that learns the vote does not wait for it:
    engine/rank_agreement.py), unless it reached its longest."""
    if fwd_bwd_s is None or not overlap:
        return bounds[0]
    needs = window_needs(t, fwd_bwd_s, cpu)
    if needs is None:
        return bounds[1]
    return max(bounds[0], min(bounds[1], max(needs) + (ranks > 1)))


# step()'s Python time over forward+backward's beyond which the estimate warns of a CPU-bound
# step: the training thread also launches the forward and backward (at 1.35B and a 45 ms
# forward+backward on the H100, about as long as the device ran them)
CPU_BOUND_SHARE = 0.5

FORMULAS_CPU = ("T_dev + accumulate + host_adamw/U + (install + fingerprints)/U (a CPU device "
                "shares the host's memory: the host's streaming slows its step by about its own "
                "length, so the two add)")


def formulas(overlap: bool, cpu: bool) -> dict:
    """The step-time formulas, as printed."""
    return {
        "adamw": "fwd_bwd + params / device_adamw",
        "offload": ("fwd_bwd + gradient norm + d2h(all grads) + host accumulate + host AdamW "
                    "+ h2d(all weights) + fingerprints (two passes over every parameter)"),
        "zenflow": (FORMULAS_CPU if cpu and overlap else
                    "max(python, max(T_dev, accumulate + host_adamw/U) + (install + sums_wait + "
                    "fingerprints)/U)" if overlap
                    else "max(python, T_dev + (sums_d2h + host_adamw + install + "
                         "fingerprints)/U)"),
        "python": ("step()'s time on the training thread: its operators at python_operator_s "
                   "and its compiled calls at compiled_call_s, per step and per window / U (the "
                   "forward and backward's own launches not counted)"),
        "fingerprints": ("two passes over the matrices a credit rule does not move per window "
                         "(those: two every step)"),
        "T_dev": ("fwd_bwd + device update + d2h (memcpy)" if cpu else
                  "fwd_bwd + device update + device sums' add + exposed d2h"),
        "exposed d2h": (f"max(0, d2h of host-summed rows - {BACKWARD_SHARE:.2f} fwd_bwd "
                        "(the backward, on one GPU: copies start in its hooks) - device update "
                        "- device sums' add)"),
        "install": "what the device waits per install: h2d of this rank's rows + the all-gather "
                   "on the device (several ranks); with per-layer installs (attach) only the "
                   "part of the h2d (and of the all-gather, several ranks) the forward does not "
                   "hide",
        "sums_wait": "max(0, sums_d2h - fwd_bwd): the next window's first add waits for the copy",
    }


def zenflow_step_s(t: dict, U: int, overlap: bool, cpu: bool, fwd_bwd_s: float) -> float:
    """ZenFlowAdamW's step, per the formula formulas() prints."""
    T_dev = device_time(t, cpu, fwd_bwd_s)
    install = t["install_wait_s"]
    if overlap and cpu:
        # The CPU proxy's "device" and host stream through the same memory, which both saturate:
        # the worker's work beside a step lengthens it by about its own duration (measured on
        # cpu-llama: ZenFlow's forward+backward is longer than AdamW's by the host's busy time).
        # On a GPU the device's memory is its own and the host's work hides behind its step.
        return (T_dev + t["accumulate_s"] + t["adamw_s"] / U
                + (install + t["fingerprint_s"]) / U)
    # the training thread's step() on a GPU: the step takes at least that (a CPU device's step
    # is the training thread's already)
    python = 0.0 if cpu else python_s(t, U)
    if overlap:
        sums_wait = max(0.0, t["sums_d2h_s"] - fwd_bwd_s)   # the next window's first add waits
        return max(python, max(T_dev, t["accumulate_s"] + t["adamw_s"] / U)
                   + (install + sums_wait + t["fingerprint_s"]) / U)
    return max(python, T_dev + (t["sums_d2h_s"] + t["adamw_s"] + install
                                + t["fingerprint_s"]) / U)


def python_s(t: dict, U: int) -> float:
    """The training thread's time in step() per step, a window's own spread over its steps."""
    return t.get("python_step_s", 0.0) + t.get("python_window_s", 0.0) / U


def offload_step_s(t: dict, fwd_bwd_s: float) -> float:
    """ZeRO-Offload waits for all of its work every step."""
    return (fwd_bwd_s + t["offload_norm_s"] + t["offload_d2h_s"] + t["offload_host_s"]
            + t["offload_h2d_s"] + t["offload_fingerprint_s"])


def step_times(t: dict, U: int, overlap: bool, cpu: bool, fwd_bwd_s: float | None) -> dict:
    """Step-time model (per GPU; seconds per step). See the formulas in the returned dict."""
    out = {"formulas": formulas(overlap, cpu)}
    if fwd_bwd_s is None:
        return out
    T_dev = device_time(t, cpu, fwd_bwd_s)
    zen = zenflow_step_s(t, U, overlap, cpu, fwd_bwd_s)
    offload = offload_step_s(t, fwd_bwd_s)
    needs = window_needs(t, fwd_bwd_s, cpu)
    if needs is None:
        min_u, install_u = None, None
        why = "none: the per-step host accumulation alone takes longer than the device's step"
    else:
        min_u, install_u = needs
        why = "with overlap_step=True; the install, install/U per step, stays exposed"
    floor = fwd_bwd_s + t["adamw_device_s"]
    python = python_s(t, U)
    out.update({
        # step()'s Python thread, and whether it takes more than half the forward and backward,
        # whose own launches the model does not count: then the step may be CPU-bound (on the
        # H100 at 1.35B, 36 ms of it beside a 45 ms forward+backward made 1.6x AdamW's)
        "zenflow_python_s": python,
        "cpu_bound_risk": not cpu and python > CPU_BOUND_SHARE * fwd_bwd_s,
        "fwd_bwd_s": fwd_bwd_s, "adamw_step_s": floor,
        "offload_step_s": offload, "offload_stall_s": offload - fwd_bwd_s,
        "zenflow_T_dev_s": T_dev, "zenflow_step_s": zen,
        "zenflow_exposed_d2h_s": t["d2h_s"] if cpu else exposed_d2h(t),
        "zenflow_optimizer_s": zen - fwd_bwd_s,     # time in step(), CPU-proxy: training thread
        # beyond the device's own work (its step and the window end's fingerprints)
        "zenflow_stall_s": zen - T_dev - t["fingerprint_s"] / U,
        "zenflow_stall_s_per_window": (zen - T_dev) * U - t["fingerprint_s"],
        # the part spent blocked on the host (what stats()["stall_s_*"] counts; no install)
        "zenflow_blocked_s": max(0.0, zen - T_dev - (t["install_wait_s"] + t["fingerprint_s"]) / U),
        "zenflow_vs_floor": zen / floor,
        "speedup_vs_offload": offload / zen,
        "min_update_interval_hiding_host": min_u, "min_update_interval_note": why,
        "update_interval_for_install_budget": install_u})
    return out


def work_seconds(c: Counts, s: Speeds, mats, moving: set[int], fwd_bwd_s: float | None,
                 per_layer_installs: bool, batch: int) -> dict:
    """Every cost in seconds, per step or per window, under the names the report uses
    (`batch`: the "factored" kernels' run of matrices a call)."""
    t = {"accumulate_s": cost.host_accumulate_s(c, s), "adamw_s": cost.host_adamw_s(c, s),
         "d2h_s": cost.host_rows_d2h_bytes(c) / s.d2h,
         "h2d_s": cost.install_h2d_bytes(c) / s.h2d,
         "sums_d2h_s": cost.window_sums_d2h_bytes(c) / s.d2h,
         "sum_add_s": cost.sum_add_s(c, s),
         "install_gather_s": cost.install_device_s(c, s),
         "device_update_s": cost.device_update_s(c, s),
         "fingerprint_s": cost.fingerprint_s(c, s),
         "reselect_s": cost.reselect_s(c, s),
         "offload_fingerprint_s": cost.offload_fingerprint_s(c, s),
         "offload_host_s": cost.offload_host_s(c, s),
         "offload_norm_s": cost.offload_norm_s(c, s),
         "offload_d2h_s": cost.offload_d2h_bytes(c) / s.d2h,
         "offload_h2d_s": cost.offload_h2d_bytes(c) / s.h2d,
         "adamw_device_s": cost.adamw_device_s(c, s)}
    # The host-summed rows' copies start in backward hooks in one process only (under data
    # parallel a hook would see the gradient before it is averaged): there the backward hides
    # BACKWARD_SHARE of forward+backward's worth of them.
    t["d2h_hidden_s"] = (BACKWARD_SHARE * fwd_bwd_s if c.world == 1 and fwd_bwd_s is not None
                         else 0.0)
    # What the device waits for per install: the whole copy and its device work, or with
    # per-layer installs the part the forward does not hide: each matrix's copy and, under DDP,
    # its correction and all-gather (queued after the copy, on its stream); one GPU corrects a
    # matrix when its layer reads it, on the compute stream.
    t["install_wait_s"] = t["h2d_s"] + t["install_gather_s"]
    if per_layer_installs and fwd_bwd_s is not None:
        on_copy_stream = t["install_gather_s"] if c.world > 1 else 0.0
        t["install_wait_s"] = t["install_gather_s"] - on_copy_stream + \
            cost.per_layer_install_wait_s(mats, moving, c.item, c.rate_item, s.h2d,
                                          fwd_bwd_s / 3, c.world, on_copy_stream)
    t["python_step_s"] = cost.python_step_s(c, s, batch)
    t["python_window_s"] = cost.python_window_s(c, s, batch)
    return t
