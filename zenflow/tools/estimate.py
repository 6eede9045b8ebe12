"""`zenflow estimate`: will it fit, and will it help? Memory per GPU and per host, bus bytes, and
a step-time model for AdamW, ZeRO-Offload (OffloadAdamW) and ZenFlowAdamW, from parameter shapes
alone (a Hugging Face config, a bench preset or a shape list) plus measured figures from
`zenflow selftest --json` when given (else stated assumptions).

`estimate()` puts together: the memory (estimate_memory.py: exact where the package decides it,
the host's from the optimizer's own HostLayout), where the window sums live (the optimizer's own
placement rule, estimate_counts.py, which counts what the costs read), the costs
(estimate_terms.py: one function per cost, its formula in code) and the step-time model
(estimate_time.py). The command is estimate_cli.py; what it prints,
estimate_report.py.
"""
from __future__ import annotations

import math

import torch

from zenflow.distributed import Partition
from zenflow.host.arena import available_host_bytes
from zenflow.host.compiled import COMPILE_ON
from zenflow.host.credit import credit_for, on_replicas
from zenflow.host.credit_factored import BATCH
from zenflow.host.device_sums import sum_dtype
from zenflow.host.layout import rate_dtype
from zenflow.tools import estimate_memory as memory
from zenflow.tools import estimate_terms as cost
from zenflow.tools import estimate_time as timing
from zenflow.tools.estimate_counts import count, place, split_shapes
from zenflow.tools.estimate_host import COMPACT_PASSES, HostMachine, host_figures
from zenflow.tools.estimate_memory import GIB, RESERVE_BYTES, per_rank
from zenflow.tools.estimate_terms import Speeds
from zenflow.tools.estimate_terms import exposed_install_s as _exposed_install_s
from zenflow.tools.estimate_time import QUALITY_BY_WINDOW, expected_quality_gap

__all__ = ["ASSUMED", "GIB", "QUALITY_BY_WINDOW", "RESERVE_BYTES", "estimate",
           "expected_quality_gap", "per_rank", "_exposed_install_s"]

# Used where no --selftest-json supplies a measured figure; each is printed as an assumption. The
# host's three (None here) follow from the server stated (estimate_host.py: --host-*).
ASSUMED = {
    "host_adamw_params_per_s": (None, "host AdamW over the workers' cores"),
    "host_accumulate_params_per_s": (None, "host gradient accumulation over the workers' cores"),
    "host_factored_params_per_s": (None, "the workers' deferred_credit=\"factored\" update"),
    "host_reselect_params_per_s": (None, "a reselection's column moves in the host state, on "
                                         "the training thread with the workers' cores lent"),
    "device_adamw_params_per_s": (5.0e10, "fused AdamW on the GPU (HBM-bound, ~28 B/param)"),
    "device_norm_bytes_per_s": (2.0e12, "gradient bytes read per second by the norm kernel "
                                        "on the GPU (HBM)"),
    "device_copy_bytes_per_s": (1.0e12, "bytes copied per second on the GPU (HBM)"),
    "device_pass_bytes_per_s": (None, "bytes a pointwise pass reads plus writes per second on "
                                      "the device; unmeasured, twice the copy figure (a copy "
                                      "reads each byte it writes)"),
    "device_fingerprint_bytes_per_s": (None, "weight bytes read per second by the window end's "
                                             "fingerprint (per-column integer sums); unmeasured, "
                                             "the norm kernel's figure"),
    "d2h_bytes_per_s": (25e9, "device->host, page-locked (PCIe Gen4 x16)"),
    "h2d_bytes_per_s": (25e9, "host->device, page-locked (PCIe Gen4 x16)"),
    "memcpy_bytes_per_s": (5e9, "host memcpy (the CPU device's copies)"),
    # The training thread (zenflow/tools/estimate_terms.py python_step_s): from the H100's
    # speed check (benchmarks/results/gpu-check-nvidia-h100-80gb-hbm3.json, torch 2.11), where
    # "mean" with bf16 sums at 1.35B took 36 ms a step more than AdamW(fused) for about 1,360
    # operators (170 matrices, 11-step windows), and a compiled kernel's call about 0.25 ms plus
    # its launches.
    "python_operator_s": (25e-6, "the training thread per operator step() dispatches, the "
                                 "Python between them included (an H100's host)"),
    "compiled_call_s": (0.5e-3, "the training thread per call of a compiled \"factored\" "
                                "kernel (an H100's host)"),
}
# Forward+backward times the window and step are shown at when none is given (seconds).
SAMPLE_FWD_BWD_S = (0.25, 0.5, 1.0, 2.0)
# A CPU device's own figures where the selftest measured none (its "device" is this host)
CPU_DEVICE = {"device_adamw_params_per_s": 1.0e9, "device_norm_bytes_per_s": 5e9,
              "device_copy_bytes_per_s": 5e9}


def _figures(measured: dict | None, target: str, host: HostMachine, ranks: int,
             compact_moments: bool = False) -> tuple[dict, dict]:
    """The figures the model uses and where each came from: measured by the selftest, else
    ASSUMED (the host's from the server `host` with `ranks` workers, its moments bf16 with
    `compact_moments`; a CPU device has memcpy for its bus, a GPU d2h and h2d)."""
    values, sources = {}, {}
    measured = measured or {}
    placed = host_figures(host, ranks, compact_moments)
    if compact_moments:   # the selftest measures the update with fp32 moments
        measured = {k: v for k, v in measured.items() if k not in COMPACT_PASSES}
    for key, (value, what) in ASSUMED.items():
        if key in placed:
            value, what = placed[key][0], f"{what} ({placed[key][1]})"
        if key == ("d2h_bytes_per_s" if target == "cpu" else "memcpy_bytes_per_s") or \
                (key == "h2d_bytes_per_s" and target == "cpu"):
            continue
        got = measured.get(key)
        if key == "device_fingerprint_bytes_per_s" and not got:
            value = values["device_norm_bytes_per_s"]   # an older selftest's figures
        elif key == "device_pass_bytes_per_s" and not got:
            value = 2 * values["device_copy_bytes_per_s"]
        elif target == "cpu" and got is None and key.startswith("device_"):
            value = CPU_DEVICE[key]
        values[key] = float(got) if got else value
        sources[key] = f"measured by selftest ({what})" if got else f"ASSUMED: {what}"
    return values, sources


def speeds(fig: dict, cpu: bool, world: int) -> Speeds:
    """The figures as the terms divide by them; each rank's worker has 1/world of the host."""
    d2h, h2d = ((fig["memcpy_bytes_per_s"],) * 2 if cpu else
                (fig["d2h_bytes_per_s"], fig["h2d_bytes_per_s"]))
    return Speeds(host_adamw=fig["host_adamw_params_per_s"] / world,
                  host_accumulate=fig["host_accumulate_params_per_s"] / world,
                  host_factored=fig["host_factored_params_per_s"] / world,
                  host_reselect=fig["host_reselect_params_per_s"] / world,
                  device_adamw=fig["device_adamw_params_per_s"],
                  norm=fig["device_norm_bytes_per_s"], copy=fig["device_pass_bytes_per_s"],
                  fingerprint=fig["device_fingerprint_bytes_per_s"], d2h=d2h, h2d=h2d,
                  operator=fig["python_operator_s"], compiled_call=fig["compiled_call_s"])


def _budget(asked: int | str, left_for_activations: int, activation_bytes: int,
            gpu_memory_bytes: int, cpu: bool) -> int:
    """device_sum_budget in bytes: as asked, or "auto" as the optimizer decides it (what the
    device has left after its peak, less a tenth of its memory; 0 on a CPU device)."""
    if asked != "auto":
        return int(asked)
    spare = left_for_activations - activation_bytes - int(0.1 * gpu_memory_bytes)
    return 0 if cpu else max(0, spare)


def per_host(mats, vecs, dtype: torch.dtype, world: int, overlap: bool, staging: int,
             moments: bool, device_summed: set[int], measured: dict | None,
             moments_dtype: torch.dtype = torch.float32) -> dict:
    """Host memory of ZenFlowAdamW and OffloadAdamW (every matrix has host state whatever
    topk_ratio is; OffloadAdamW has its vectors there too and no device sums), what of it is
    page-locked, and whether it fits the RAM available (this machine's, or the selftest's)."""
    zen = memory.host_memory([(r, c, dtype) for r, c, _ in mats], world, 2 if overlap else 1,
                             staging, rates=moments, device_summed=device_summed,
                             moments_dtype=moments_dtype)
    off = memory.host_memory([(r, c, dtype) for r, c, _ in mats] + [(1, n, dtype) for n in vecs],
                             world, 1, staging)
    avail = (measured or {}).get("available_host_bytes")
    where = "the selftest's machine" if avail else "this machine"
    avail = avail or available_host_bytes()
    return {"zenflow": zen, "offload": off, "available_host_bytes": avail, "available_from": where,
            "fits": {"zenflow": zen["arena_bytes"] <= avail,
                     "offload": off["arena_bytes"] <= avail}}


def estimate(shapes, dtype: torch.dtype = torch.bfloat16, *, gpus: int = 1,
             gpu_memory_bytes: int | None = None, topk_ratio: float = 0.1,
             update_interval: int | str = "auto", overlap: bool = True,
             fwd_bwd_s: float | None = None, measured: dict | None = None, target: str = "cuda",
             source: str = "", device_sum_budget: int | str = "auto",
             activation_bytes: int = 0, fsdp: int | None = None,
             deferred_credit: str = "factored", attached: bool = False,
             device_sum_dtype: str = "auto", activation_note: str = "",
             host: HostMachine | None = None, host_moments_dtype: str = "float32") -> dict:
    """The estimate as a dict (see estimate_report.format_report); `shapes` is [(name, shape),
    ...]. `fsdp`: also the bytes per rank of the model sharded that many ways with FSDP2
    (`per_rank`), beside DDP's on as many GPUs (`gpus` must then be that number).
    `device_sum_budget`: bytes, or "auto" as the optimizer decides it (what the device has left
    after its peak, here the weights, gradients, device state, reserve and `activation_bytes`,
    less a tenth of its memory; 0 on a CPU device). `deferred_credit`: the optimizer's; "moments"
    and "factored" apply to the matrices summed on the device, each rank on its own rows (FSDP2's
    shards: `per_rank`); DDP's replicas hold every rank's "factored" factors and take "mean" for
    "moments". `attached`: the model is
    attached to the optimizer (`ZenFlowAdamW.attach`, or the framework callbacks' attach=True),
    so each block's forward waits only for its own install; else (the default, as
    zenflow.initialize runs) the step waits for the whole install.
    `device_sum_dtype`: the optimizer's ("bfloat16": half the bytes of every device sum not
    under "moments", which the host widens once per window). `activation_note`: where
    `activation_bytes` came from (printed with it). `host`: the server whose cores and memory
    the host figures assume where `measured` has none (estimate_host.py). `host_moments_dtype`:
    the optimizer's ("bfloat16": 4 bytes less host memory a parameter, and the host update's
    own figures, COMPACT_PASSES, in place of any the selftest measured)."""
    _check_arguments(gpus=gpus, gpu_memory_bytes=gpu_memory_bytes, topk_ratio=topk_ratio,
                     update_interval=update_interval, fwd_bwd_s=fwd_bwd_s, target=target,
                     device_sum_budget=device_sum_budget, activation_bytes=activation_bytes,
                     deferred_credit=deferred_credit, device_sum_dtype=device_sum_dtype,
                     host_moments_dtype=host_moments_dtype)
    # "auto", as the optimizer resolves it: bf16 sums for bf16 weights
    device_sum_dtype = str(sum_dtype(device_sum_dtype, [dtype])).removeprefix("torch.")
    if fsdp is not None and (isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1
                             or fsdp != gpus):
        raise ValueError(f"fsdp must be the number of GPUs the model is sharded over (>= 1, "
                         f"equal to gpus={gpus}), got {fsdp!r}")
    item = torch.empty((), dtype=dtype).element_size()
    world, cpu = gpus, target == "cpu"
    # as the optimizer decides it: each rank runs the rule on its own rows; DDP's replicas
    # (world > 1) hold every rank's "factored" factors too, and take "mean" for "moments"
    rule = credit_for(deferred_credit, device_sum_budget, not cpu, splits_rows=world > 1)
    shard_rule = credit_for(deferred_credit, device_sum_budget, not cpu, splits_rows=False)
    moments = rule.name == "moments"   # per-value squares and rates: the host keeps rates too
    budget_asked = device_sum_budget
    rate_item = rate_dtype(dtype).itemsize
    fig, fig_source = _figures(measured, target, host or HostMachine(), gpus,
                               compact_moments=host_moments_dtype == "bfloat16")
    gpu_memory_bytes = gpu_memory_bytes or int((measured or {}).get("gpu_memory_bytes") or 80 * GIB)
    mats, vecs = split_shapes(shapes, topk_ratio)
    # (placed with rank 0's rows and every rank's factors of the deferred matrices)
    rule = on_replicas(rule, Partition(rank=0, world_size=world), [r for r, c, k in mats if k < c])
    P_mat, P_vec = sum(r * c for r, c, _ in mats), sum(vecs)
    gpu = memory.per_gpu(mats, vecs, item, gpu_memory_bytes)

    # -- where the window sums live (rank 0's rows: the largest share), as the optimizer decides
    device_sum_budget = _budget(budget_asked, gpu["left_for_activations_bytes"]["zenflow"],
                                activation_bytes, gpu_memory_bytes, cpu)
    sum_item = 2 if device_sum_dtype == "bfloat16" else 4
    summed, moving = place(rule, mats, world, device_sum_budget, sum_item, dtype)
    counts = count(mats, vecs, item, rate_item, sum_item, world, set(summed), set(moving),
                   rule.name, replicas=True, fused=rule.fuses and target in COMPILE_ON)
    # two staging slots where copies outlive the step (CUDA), one on a CPU device
    staging = 2 if target == "cuda" else 1
    deferred_index = [i for i, (_, cols, k) in enumerate(mats) if k < cols]   # into mats
    host = per_host(mats, vecs, dtype, world, overlap, staging, moments,
                    {deferred_index[d] for d in summed}, measured,
                    moments_dtype=getattr(torch, host_moments_dtype))
    gpu.update({"device_sum_bytes": cost.device_sums_bytes(counts),
                "device_sum_dtype": device_sum_dtype, "moments_matrices": len(moving),
                "credit_rule": rule.name,
                "device_sum_matrices": len(summed),
                "host_sum_matrices": len(deferred_index) - len(summed)})

    # -- the costs, the window and the step
    spd = speeds(fig, cpu, world)
    moving_share = counts.moving / max(1, counts.deferred)

    def model_at(fwd: float | None, per_layer: bool = attached and not cpu
                 ) -> tuple[dict, int, dict]:
        """The costs in seconds, the window and the step times at forward+backward `fwd`."""
        t = timing.work_seconds(counts, spd, mats, set(moving) if moments else set(), fwd,
                                per_layer_installs=per_layer, batch=BATCH)
        U = (timing.expected_window(t, fwd, cpu, overlap, ranks=world)
             if update_interval == "auto" else update_interval)
        return t, U, timing.step_times(t, U, overlap, cpu, fwd)
    t, U, times = model_at(fwd_bwd_s)
    if not attached and not cpu and fwd_bwd_s is not None and update_interval == "auto":
        # what attach(model) would give: each layer waits for its own installs only
        _, times["attached_window"], attached_times = model_at(fwd_bwd_s, per_layer=True)
        times["attached_vs_floor"] = attached_times["zenflow_vs_floor"]
    # The auto window follows the step time: without one, the window (and every per-step
    # figure of ZenFlow's) is shown at a few forward+backward times instead of being guessed.
    window_known = update_interval != "auto" or fwd_bwd_s is not None or not overlap
    by_step_time = [] if fwd_bwd_s is not None else [
        {"fwd_bwd_s": fwd, "window": u, "quality_gap_pct":
         timing.quality(u, moving_share, rule.name)["held_out_loss_gap_pct"],
         **{k: tm[k] for k in ("zenflow_step_s", "offload_step_s", "adamw_step_s",
                               "zenflow_vs_floor", "speedup_vs_offload")}}
        for fwd in SAMPLE_FWD_BWD_S for _, u, tm in [model_at(fwd)]]
    d2h_step, sums_window = cost.host_rows_d2h_bytes(counts), cost.window_sums_d2h_bytes(counts)
    install = cost.install_h2d_bytes(counts)
    bus = {"zenflow": {"d2h_bytes_per_step": d2h_step + sums_window / U,
                       "h2d_bytes_per_step": install / U,
                       "d2h_bytes_per_window": U * d2h_step + sums_window,
                       "h2d_bytes_per_window": install,
                       "model_bytes": counts.params * item},
           "offload": {"d2h_bytes_per_step": cost.offload_d2h_bytes(counts),
                       "h2d_bytes_per_step": cost.offload_h2d_bytes(counts)}}
    sharded = None
    if fsdp:
        sharded = memory.fits_per_rank(per_rank(mats, vecs, dtype, world, overlap, staging,
                                                shard_rule.name, rule.name), gpu_memory_bytes)
        # Each shard places the sums of its rows, and its rule's state beside them ("factored":
        # 8 rows + 12 cols bytes a matrix, of its own rows), in what its device has left.
        budget = _budget(budget_asked, sharded["fsdp2"]["left_for_activations_bytes"],
                         activation_bytes, gpu_memory_bytes, cpu)
        shard_summed, shard_moving = place(shard_rule, mats, world, budget, sum_item, dtype)
        shard_counts = count(mats, vecs, item, rate_item, sum_item, world, set(shard_summed),
                             set(shard_moving), shard_rule.name,
                             fused=shard_rule.fuses and target in COMPILE_ON)
        for layout, rule_name, sums_bytes, moved in (
                ("ddp", rule.name, gpu["device_sum_bytes"], moving),
                ("fsdp2", shard_rule.name, cost.device_sums_bytes(shard_counts), shard_moving)):
            sharded[layout].update(credit_rule=rule_name, device_sum_bytes=sums_bytes,
                                   moments_matrices=len(moved))
        # the replicas' rows, and their "factored" factors, as the rows' placement has them
        sharded["ddp"]["install_allgather_bytes_per_window"] = cost.install_allgather_bytes(counts)
    return {"per_rank": sharded,
            "model": {"params": counts.params, "matrices": len(mats), "matrix_params": P_mat,
                      "vectors": len(vecs), "vector_params": P_vec,
                      "dtype": str(dtype).removeprefix("torch."), "source": source},
            "quality": timing.quality(U, moving_share, rule.name),
            "settings": {"gpus": world, "topk_ratio": topk_ratio, "update_interval": U,
                         "update_interval_asked": update_interval, "window_known": window_known,
                         "overlap_step": overlap, "target": target, "fwd_bwd_s": fwd_bwd_s,
                         "deferred_credit": deferred_credit, "host_rates": moments,
                         "host_moments_dtype": host_moments_dtype,
                         "activation_bytes": activation_bytes,
                         "activation_note": activation_note},
            "by_step_time": by_step_time,
            "per_gpu": gpu, "per_host": host, "bus": bus,
            "seconds": t, "time": times, "figures": fig,
            "figures_assumed": [k for k, v in fig_source.items() if v.startswith("ASSUMED")],
            "assumptions": _assumptions(world, cpu, attached, device_sum_dtype,
                                        int(device_sum_budget), activation_bytes, fig,
                                        fig_source, activation_note)}


def _check_arguments(**given) -> None:
    """ValueError naming the first argument of estimate() out of its range, and its value."""
    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    rules = {
        "gpus": (lambda x: whole(x) and x >= 1, "an integer >= 1"),
        "gpu_memory_bytes": (lambda x: x is None or (number(x) and x > 0), "None or bytes > 0"),
        "topk_ratio": (lambda x: number(x) and 0 <= x <= 1, "a number in [0, 1]"),
        "update_interval": (lambda x: x == "auto" or (whole(x) and x >= 1),
                            '"auto" or an integer >= 1'),
        "fwd_bwd_s": (lambda x: x is None or (number(x) and x > 0), "None or seconds > 0"),
        "target": (lambda x: x in ("cuda", "cpu"), '"cuda" or "cpu"'),
        "device_sum_budget": (lambda x: x == "auto" or (number(x) and x >= 0),
                              '"auto" or bytes >= 0'),
        "activation_bytes": (lambda x: number(x) and x >= 0, "bytes >= 0"),
        "deferred_credit": (lambda x: x in ("moments", "factored", "mean", "window"),
                            '"moments", "factored", "mean" or "window"'),
        "device_sum_dtype": (lambda x: x in ("auto", "float32", "bfloat16"),
                             '"auto", "float32" or "bfloat16"'),
        "host_moments_dtype": (lambda x: x in ("float32", "bfloat16"),
                               '"float32" or "bfloat16"'),
    }
    for name, value in given.items():
        ok, what = rules[name]
        if not ok(value):
            raise ValueError(f"estimate(): {name} must be {what}, got {value!r}")


def _assumptions(world: int, cpu: bool, attached: bool, device_sum_dtype: str,
                 device_sum_budget: int, activation_bytes: int, fig: dict,
                 fig_source: dict, activation_note: str = "") -> list[str]:
    return [
        f"{world} GPU(s), all on one host, data parallel: each holds the full weights, gradients "
        "and device column state; the host state is split by rows across the ranks",
        f"{RESERVE_BYTES / GIB:.1f} GiB per GPU reserved for the CUDA context, kernels' workspace "
        "and allocator slack; activations must fit in what is left",
        "AdamW = torch.optim.AdamW on the model's weights (moments in the weights' dtype); "
        "'AdamW fp32 master' = mixed precision with fp32 master weights and moments",
        "host throughput is a host-wide resource: each of the GPUs' workers gets 1/GPUs of it",
        "ZenFlow sums each matrix's window gradient on the device where the device-sum budget "
        f"allows (one fused add per step; the {device_sum_dtype} sum crosses once per window, "
        "and the next window's first add waits for that copy); the other matrices' rows cross "
        "every step and the worker sums them"
        + ("; the host widens a bf16 sum to fp32 once per window, and the quality model does "
           "not count its rounding (about 2**-9 relative per add; not measured)"
           if device_sum_dtype == "bfloat16" else ""),
        f"device-sum budget: {device_sum_budget / GIB:.1f} GiB (activations counted: "
        f"{activation_bytes / GIB:.1f} GiB, {activation_note or 'as given'}; give "
        "--activation-gib for yours)",
        ("CPU device: copies are synchronous memcpy in the training thread" if cpu else
         ("a step's device->host copy of host-summed rows starts in backward, each matrix's as "
          f"its gradient is produced ({timing.BACKWARD_SHARE:.2f} of fwd_bwd is backward), and the "
          "compute stream waits at the end of step() for what is left of it after the device "
          "update (a script that rewrites gradients after backward, such as clip_grad_norm_, "
          "moves them all back to step()); " if world == 1 else
          "a step's device->host copy of host-summed rows starts at step() (data parallel: the "
          "gradients are averaged only then) and the compute stream waits for what the device "
          "update does not hide; ")
         + ("installs are copied matrix by matrix from the end of step() and each layer's "
            "forward waits for its own (the model attached to the optimizer; a matrix's share "
            "of the forward, a third of forward+backward, is its share of the parameters)"
            + ("; under data parallel a matrix's correction and all-gather follow its copy on "
               "the copy stream, and its layer waits for those too" if world > 1 else "")
            if attached else
            "the compute stream waits for each whole install (host->device: this rank's rows, "
            "then an all-gather on the device) once per window")),
        "no compute/communication overlap of data-parallel gradient reduction is modelled",
        "commands reach the host's worker as soon as the copies they read have landed (no "
        "dispatch delay: a window's host update starts when its last gradients are on the host)",
    ] + [f"{k} = {fig[k]:.3g}: {v}" for k, v in fig_source.items()]
