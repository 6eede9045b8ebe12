"""What `zenflow estimate` prints: the answer (estimate_answer.py), then the estimate() dict as
tables. No torch: plain formatting."""
from __future__ import annotations

from zenflow.tools.estimate_answer import answer

GIB = 1 << 30


def _quality_line(q: dict) -> str:
    measured = "; ".join(f"{credit} " + ", ".join(f"{u}: {g:+.1f}%" for u, g in table.items())
                         for credit, table in q["measured"].items())
    at_least = " or more" if q["beyond_measured"] else ""
    return (f"Quality at windows of {q['window_steps']} steps: about {q['held_out_loss_gap_pct']:+.1f}%"
            f"{at_least} held-out loss against AdamW on the fine-tune benchmark, with "
            f"{100 * q['moments_share']:.0f}% of the deferred parameters under '{q['rule']}' (by "
            f"window: {measured}; a small model's fine-tune, for the trend: benchmarks/README.md)")


def _quality_by_step_time(r: dict) -> str:
    by = ", ".join(f"{row['window']} steps at {row['fwd_bwd_s']:g} s {row['quality_gap_pct']:+.1f}%"
                   for row in r["by_step_time"])
    return (f"Quality at windows of {by} (forward+backward): held-out loss against AdamW on the "
            f"fine-tune benchmark, with {100 * r['quality']['moments_share']:.0f}% of the "
            f"deferred parameters under '{r['quality']['rule']}' (a small model's, for the "
            "trend)")


def _gib(n) -> str:
    return f"{n / GIB:8.2f} GiB"


def _s(x) -> str:
    return "      n/a" if x is None else (f"{x * 1e3:7.1f} ms" if x < 10 else f"{x:7.2f} s ")


def format_report(r: dict) -> str:
    """The answer (estimate_answer.py), then the tables it is drawn from."""
    m, s, g, h, b = r["model"], r["settings"], r["per_gpu"], r["per_host"], r["bus"]
    cols = ("adamw", "adamw_fp32_master", "offload", "zenflow")
    unit = "GPU" if s["target"] == "cuda" else "CPU device"   # what trains
    known = s["window_known"]
    window = (f"{s['update_interval']}" + (" (expected auto window)" if
                                          s["update_interval_asked"] == "auto" else "")
              if known else "auto (the window needs --fwd-bwd-seconds)")
    out = [f"Model: {m['params'] / 1e9:.3f} B params ({m['matrices']} matrices, {m['vectors']} "
           f"vectors), {m['dtype']}; {m['source']}", "", *answer(r), "", "Details",
           f"Settings: {s['gpus']} GPU(s), topk_ratio {s['topk_ratio']}, update_interval "
           f"{window}, overlap_step {s['overlap_step']}, device {s['target']}",
           _quality_line(r["quality"]) if known else _quality_by_step_time(r), "",
           f"{f'Per {unit} (' + format(g['gpu_memory_bytes'] / GIB, '.1f') + ' GiB)':<30}" +
           "".join(f"{h:>16}" for h in ("AdamW", "AdamW fp32 mstr", "OffloadAdamW",
                                         "ZenFlowAdamW"))]
    rows = [("weights", [g["weights_bytes"]] * 4), ("gradients", [g["grads_bytes"]] * 4),
            ("optimizer state on GPU", [g["state_bytes"][c] for c in cols]),
            ("reserved (context, slack)", [g["reserve_bytes"]] * 4),
            ("left for activations", [g["left_for_activations_bytes"][c] for c in cols])]
    for name, vals in rows:
        out.append(f"  {name:<28}" + "".join(f"{_gib(v):>16}" for v in vals))
    out.append(f"  {'fits':<28}" + "".join(f"{'yes' if g['fits'][c] else 'NO':>16}" for c in cols))
    out.append(f"  window sums on the device: {g['device_sum_matrices']} matrices "
               f"({g['moments_matrices']} under '{g['credit_rule']}'), "
               f"{g['device_sum_bytes'] / GIB:.2f} GiB ({g['device_sum_dtype']} sums); on the "
               f"host: {g['host_sum_matrices']}")
    out += ["", f"{'Per host (' + str(s['gpus']) + f' {unit}(s))':<32}{'OffloadAdamW':>16}"
            f"{'ZenFlowAdamW':>16}"]
    locked = ("page-locked (for copies)" if s["target"] == "cuda" else
              "copy buffers (CPU: unlocked)")
    for name, key in (("host memory (state)", "host_bytes"), ("reserved (page-rounded)",
                                                                "arena_bytes"),
                      (locked, "pinned_bytes")):
        out.append(f"  {name:<30}{_gib(h['offload'][key]):>16}{_gib(h['zenflow'][key]):>16}")
    out.append(f"  {'fits in available RAM':<30}{'yes' if h['fits']['offload'] else 'NO':>16}"
               f"{'yes' if h['fits']['zenflow'] else 'NO':>16}   "
               f"(available {h['available_host_bytes'] / GIB:.1f} GiB; /dev/shm not used)")
    z, o = b["zenflow"], b["offload"]
    # ZenFlow's bytes a step are its bytes a window over the window: unknown without one
    zen_step = ((lambda key: _gib(z[key])) if known else (lambda key: "per window / U"))
    both = ((z["d2h_bytes_per_step"] + z["h2d_bytes_per_step"]) / z["model_bytes"])
    out += ["", f"{'Bus per ' + unit:<32}{'OffloadAdamW':>16}{'ZenFlowAdamW':>16}",
            f"  {'device->host per step':<30}{_gib(o['d2h_bytes_per_step']):>16}"
            f"{zen_step('d2h_bytes_per_step'):>16}",
            f"  {'host->device per step':<30}{_gib(o['h2d_bytes_per_step']):>16}"
            f"{zen_step('h2d_bytes_per_step'):>16}",
            f"  {'per window (d2h / h2d)':<30}{'':>16}   {z['d2h_bytes_per_window'] / GIB:.2f} / "
            f"{z['h2d_bytes_per_window'] / GIB:.2f} GiB",
            f"  {'both ways per step / model':<30}"
            f"{(o['d2h_bytes_per_step'] + o['h2d_bytes_per_step']) / z['model_bytes']:>15.2f}x"
            + (f"{both:>15.2f}x" if known else f"{'per window / U':>16}")]
    t, tm = r["seconds"], r["time"]
    out += ["", f"Work per {unit} per step / window",
            f"  host accumulate {_s(t['accumulate_s'])}/step, host AdamW {_s(t['adamw_s'])}/window, "
            f"d2h {_s(t['d2h_s'])}/step, h2d {_s(t['h2d_s'])}/window, device update "
            f"{_s(t['device_update_s'])}/step",
            f"  device sums: add {_s(t['sum_add_s'])}/step, d2h {_s(t['sums_d2h_s'])}/window; "
            f"install all-gather {_s(t['install_gather_s'])}/window; the device waits "
            f"{_s(t['install_wait_s'])}/window for installs",
            f"  OffloadAdamW: d2h {_s(t['offload_d2h_s'])}, host {_s(t['offload_host_s'])}, "
            f"h2d {_s(t['offload_h2d_s'])} per step"]
    out += ["", "Step time (model)"]
    if "fwd_bwd_s" not in tm:
        out.append("  give --fwd-bwd-seconds (your forward+backward time per step) for step times")
    else:
        out += [f"  forward+backward (given)      {_s(tm['fwd_bwd_s'])}",
                f"  AdamW                         {_s(tm['adamw_step_s'])}"
                + ("" if g["fits"]["adamw"] else "   (does NOT fit)"),
                f"  ZeRO-Offload (OffloadAdamW)   {_s(tm['offload_step_s'])}   stall "
                f"{_s(tm['offload_stall_s'])}",
                f"  ZenFlowAdamW                  {_s(tm['zenflow_step_s'])}   stall "
                f"{_s(tm['zenflow_stall_s'])}/step, of it blocked on the host "
                f"{_s(tm['zenflow_blocked_s'])}   ({tm['speedup_vs_offload']:.2f}x ZeRO-Offload, "
                f"{tm['zenflow_vs_floor']:.2f}x the AdamW floor)",
                f"    its host-summed rows' d2h left exposed: {_s(tm['zenflow_exposed_d2h_s'])}"
                f"/step of {_s(t['d2h_s'])} (the rest runs beside backward and the update)",
                f"  smallest update_interval hiding the host: "
                f"{tm['min_update_interval_hiding_host'] or '-'} "
                f"({tm['min_update_interval_note']})"]
    out += [f"  {k}: {v}" for k, v in tm["formulas"].items()]
    if r.get("per_rank"):
        out += [""] + _format_per_rank(r["per_rank"])
    out += ["", "Assumptions"] + [f"  - {a}" for a in r["assumptions"]]
    return "\n".join(out)


def _format_per_rank(pr: dict) -> list[str]:
    d, f = pr["ddp"], pr["fsdp2"]
    out = [f"{'ZenFlowAdamW per rank, ' + str(pr['world_size']) + ' ranks (rank 0)':<40}"
           f"{'DDP (replicas)':>18}{'FSDP2 (shards)':>18}"]
    for name, key in (("device: weights", "weights_bytes"), ("device: gradients", "grads_bytes"),
                      ("device: ZenFlow state", "state_bytes"), ("device: total", "total_bytes"),
                      ("device: left for activations", "left_for_activations_bytes"),
                      ("device: window sums, rule's state", "device_sum_bytes"),
                      ("host: ZenFlow state", "host_bytes"),
                      ("bus per window: fp32 sums down", "sums_d2h_bytes_per_window"),
                      ("bus per window: rows up", "install_h2d_bytes_per_window"),
                      ("network per window: install", "install_allgather_bytes_per_window")):
        out.append(f"  {name:<38}{_gib(d[key]):>18}{_gib(f[key]):>18}")
    out.append(f"  {'fits':<38}{'yes' if d['fits'] else 'NO':>18}"
               f"{'yes' if f['fits'] else 'NO':>18}")
    out.append(f"  {'deferred credit (matrices moving)':<38}"
               f"{d['credit_rule'] + ' (' + str(d['moments_matrices']) + ')':>18}"
               f"{f['credit_rule'] + ' (' + str(f['moments_matrices']) + ')':>18}")
    out.append("  (FSDP2 also holds one unsharded block's weights while it computes; both "
               "exchange column norms, and FSDP2 two numbers per step for clipping)")
    return out
