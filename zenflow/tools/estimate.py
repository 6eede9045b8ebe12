"""`zenflow estimate`: will it fit, and will it help? Memory per GPU and per host, bus bytes, and
a step-time model for AdamW, ZeRO-Offload (OffloadAdamW) and ZenFlowAdamW, from parameter shapes
alone (a Hugging Face config, a bench preset or a shape list) plus measured figures from
`zenflow selftest --json` when given (else stated assumptions).

Memory is exact where the package decides it: the host figure is computed by building the same
`HostLayout` the optimizer builds (per rank, with the rows each rank owns), and the device state
is the optimizer's own: per matrix rows*k*(3 fp32 + 1 fp32 gradient scratch) + k indices; per
vector its two fp32 moments (and an fp32 master when the weights are not fp32). Times are a model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from zenflow.distributed import Partition
from zenflow.host.arena import available_host_bytes, plan
from zenflow.host.buffers import HostLayout, rate_dtype
from zenflow.host.device_sums import choose_placement, takes_moments
from zenflow.optim.importance import num_selected
from zenflow.optim.windows import INSTALL_BUDGET
from zenflow.tools import estimate_shapes as shapes_from

GIB = 1 << 30
RESERVE_BYTES = int(1.5 * GIB)

# What a window's length costs in fine-tune quality: the defaults' held-out loss against AdamW's at
# windows of 1, 4 and 8 steps (benchmarks/finetune_quality.py: a byte-level GPT pretrained on
# Shakespeare, fine-tuned 300 steps on BBC News, mean of 3 seeds; benchmarks/README.md). One small
# model's fine-tune: it shows how the cost grows with the window, not what your model will lose.
# "mean" is deferred_credit="mean" (and what "moments" falls back to where a matrix's sums are on
# the host); "moments" where they are on the device.
QUALITY_BY_WINDOW = {"mean": ((1, 0.35), (4, 4.9), (8, 6.1)),
                     "moments": ((1, 0.35), (4, 0.75), (8, 1.17))}


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
# Used where no --selftest-json supplies a measured figure; each is printed as an assumption.
ASSUMED = {
    "host_adamw_params_per_s": (1.0e9, "host AdamW over the worker's cores (fused kernel, "
                                       "memory-bound; a few server cores)"),
    "host_accumulate_params_per_s": (2.0e9, "host gradient accumulation over the worker's cores"),
    "device_adamw_params_per_s": (5.0e10, "fused AdamW on the GPU (HBM-bound, ~28 B/param)"),
    "device_norm_bytes_per_s": (2.0e12, "gradient bytes read per second by the norm kernel "
                                        "on the GPU (HBM)"),
    "device_copy_bytes_per_s": (1.0e12, "bytes copied per second on the GPU (HBM)"),
    "device_fingerprint_bytes_per_s": (None, "weight bytes read per second by the window end's "
                                             "fingerprint (per-column integer sums); unmeasured, "
                                             "the norm kernel's figure"),
    "d2h_bytes_per_s": (25e9, "device->host, page-locked (PCIe Gen4 x16)"),
    "h2d_bytes_per_s": (25e9, "host->device, page-locked (PCIe Gen4 x16)"),
    "memcpy_bytes_per_s": (5e9, "host memcpy (the CPU device's copies)"),
}


def _figures(measured: dict | None, target: str) -> tuple[dict, dict]:
    values, sources = {}, {}
    measured = measured or {}
    for key, (value, what) in ASSUMED.items():
        if key == ("d2h_bytes_per_s" if target == "cpu" else "memcpy_bytes_per_s") or \
                (key == "h2d_bytes_per_s" and target == "cpu"):
            continue
        got = measured.get(key)
        if key == "device_fingerprint_bytes_per_s" and not got:
            value = values["device_norm_bytes_per_s"]   # an older selftest's figures
        elif target == "cpu" and got is None and key.startswith("device_"):
            value = {"device_adamw_params_per_s": 1.0e9, "device_norm_bytes_per_s": 5e9,
                     "device_copy_bytes_per_s": 5e9}[key]
        values[key] = float(got) if got else value
        sources[key] = f"measured by selftest ({what})" if got else f"ASSUMED: {what}"
    return values, sources


def _host(entries, gpus: int, sum_slots: int, staging_slots: int, rates: bool = False) -> dict:
    """Host memory of every rank on the host, from the optimizer's own HostLayout (two staging
    buffers where copies outlive the step, as on CUDA: zenflow/host/pipeline.py; "moments": the
    rates, and always two sum slots)."""
    total = arena = pinned = first = 0
    for rank in range(gpus):
        part = Partition(rank=rank, world_size=gpus)
        layout = HostLayout.build([(len(range(rows)[part.rows(rows)]), cols, dtype)
                                   for rows, cols, dtype in entries],
                                  2 if rates else sum_slots, staging_slots=staging_slots,
                                  rates=rates)
        regions, size = plan(layout.regions())
        dma = set(layout.dma_regions())
        nbytes = sum(r.nbytes for r in regions)
        total, arena = total + nbytes, arena + size
        pinned += sum(r.nbytes for r in regions if r.name in dma)
        first = first or nbytes
    return {"host_bytes": total, "arena_bytes": arena, "pinned_bytes": pinned,
            "host_bytes_rank0": first}


def per_rank(mats: list[tuple[int, int, int]], vecs: list[int], dtype: torch.dtype, world: int,
             overlap: bool, staging_slots: int, moments: bool = False) -> dict:
    """Bytes per rank of ZenFlowAdamW on `world` ranks, replicas (DDP) against row shards (FSDP2),
    for rank 0, which holds the largest share (ceil(rows / world) rows of every matrix, as both
    split them): the table of docs/fsdp2.md, exactly. `mats` holds (rows, columns, k) per matrix,
    `vecs` each vector's length. Under FSDP2 a rank also holds one unsharded block's weights while
    it computes (not counted: it depends on how the model was wrapped)."""
    item = torch.empty((), dtype=dtype).element_size()
    vector_state = 8 if item == 4 else 12    # fp32 moments (+ an fp32 master unless fp32)

    def rows0(n: int) -> int:
        return min(n, math.ceil(n / world))

    def device(rows, vec_len) -> dict:
        weights = item * (sum(rows(r) * c for r, c, _ in mats) + sum(vec_len(n) for n in vecs))
        state = (sum(rows(r) * k * 16 + k * 8 for r, _, k in mats)
                 + vector_state * sum(vec_len(n) for n in vecs))
        return {"weights_bytes": weights, "grads_bytes": weights, "state_bytes": state,
                "total_bytes": 2 * weights + state}

    entries = [(r, c, dtype) for r, c, _ in mats]
    host = _host(entries, world, 2 if overlap else 1, staging_slots)["host_bytes_rank0"]
    # "moments" applies to FSDP2's shards (not to DDP's replicas, whose ranks sum their rows)
    host_fsdp2 = _host(entries, world, 2 if overlap else 1, staging_slots,
                       rates=moments)["host_bytes_rank0"]
    deferred = [(r, c) for r, c, k in mats if k < c]
    own = sum(rows0(r) * c for r, c in deferred)
    # with device sums: the fp32 sums of the rank's rows down, its rows (weights' dtype) up
    bus = {"sums_d2h_bytes_per_window": 4 * own, "install_h2d_bytes_per_window": item * own}
    gather = item * (sum(r * c for r, c in deferred) - own) if world > 1 else 0
    return {"world_size": world, "rank": 0,
            "ddp": {**device(lambda r: r, lambda n: n), "host_bytes": host, **bus,
                    "install_allgather_bytes_per_window": gather},
            "fsdp2": {**device(rows0, rows0), "host_bytes": host_fsdp2, **bus,
                      "install_allgather_bytes_per_window": 0}}


def estimate(shapes, dtype: torch.dtype = torch.bfloat16, *, gpus: int = 1,
             gpu_memory_bytes: int | None = None, topk_ratio: float = 0.1,
             update_interval: int | str = "auto", overlap: bool = True,
             fwd_bwd_s: float | None = None, measured: dict | None = None, target: str = "cuda",
             source: str = "", device_sum_budget: int | str = "auto",
             activation_bytes: int = 0, fsdp: int | None = None,
             deferred_credit: str = "moments", attached: bool = True,
             device_sum_dtype: str = "float32") -> dict:
    """The estimate as a dict (see `format_report`); `shapes` is [(name, shape), ...]. `fsdp`:
    also the bytes per rank of the model sharded that many ways with FSDP2 (`per_rank`), beside
    DDP's on as many GPUs (`gpus` must then be that number).
    `device_sum_budget`: bytes, or "auto" as the optimizer decides it (what the device has left
    after its peak, here the weights, gradients, device state, reserve and `activation_bytes`,
    less a tenth of its memory; 0 on a CPU device). `deferred_credit`: the optimizer's; "moments"
    applies to the matrices summed on the device, on one GPU (data-parallel replicas take
    "mean"). `attached`: the model is attached to the optimizer (`ZenFlowAdamW.attach`, which
    zenflow.initialize and the framework callbacks do), so each layer's forward waits only for
    its own install; else the step waits for the whole install. `device_sum_dtype`: the
    optimizer's ("bfloat16": half the bytes of every device sum not under "moments", which the
    host widens once per window)."""
    if fsdp is not None and (isinstance(fsdp, bool) or not isinstance(fsdp, int) or fsdp < 1
                             or fsdp != gpus):
        raise ValueError(f"fsdp must be the number of GPUs the model is sharded over (>= 1, "
                         f"equal to gpus={gpus}), got {fsdp!r}")
    item = torch.empty((), dtype=dtype).element_size()
    U, world = update_interval, gpus
    # as the optimizer decides it: DDP's replicas (world > 1) split rows, FSDP2's shards do not
    cpu = target == "cpu"
    moments = takes_moments(deferred_credit, device_sum_budget, not cpu, splits_rows=world > 1)
    sharded_moments = takes_moments(deferred_credit, device_sum_budget, not cpu,
                                    splits_rows=False)
    rate_item = rate_dtype(dtype).itemsize
    fig, fig_source = _figures(measured, target)
    gpu_memory_bytes = gpu_memory_bytes or int((measured or {}).get("gpu_memory_bytes") or 80 * GIB)
    mats, vecs = [], []
    for _, shape in shapes:
        n = math.prod(shape)
        if len(shape) >= 2:
            rows, cols = shape[0], n // shape[0]
            mats.append((rows, cols, num_selected(topk_ratio, cols)))
        else:
            vecs.append(n)
    P_mat, P_vec = sum(r * c for r, c, _ in mats), sum(vecs)
    P = P_mat + P_vec
    rank0 = Partition(rank=0, world_size=world)

    def share(rows: int) -> int:
        return len(range(rows)[rank0.rows(rows)])
    # -- per GPU
    zen_state = sum(r * k * 16 + k * 8 for r, _, k in mats) + P_vec * (8 if item == 4 else 12)
    state = {"adamw": 2 * item * P, "adamw_fp32_master": (8 if item == 4 else 12) * P,
             "offload": 0, "zenflow": zen_state}
    used = {k: 2 * item * P + v + RESERVE_BYTES for k, v in state.items()}
    left = {k: gpu_memory_bytes - v for k, v in used.items()}
    per_gpu = {"weights_bytes": item * P, "grads_bytes": item * P, "state_bytes": state,
               "reserve_bytes": RESERVE_BYTES, "gpu_memory_bytes": gpu_memory_bytes,
               "left_for_activations_bytes": left, "fits": {k: v > 0 for k, v in left.items()}}
    # -- per host: every matrix has host state whatever topk_ratio is; OffloadAdamW adds vectors
    staging = 2 if target == "cuda" else 1
    zen_host = _host([(r, c, dtype) for r, c, _ in mats], world, 2 if overlap else 1, staging,
                     rates=moments)
    off_host = _host([(r, c, dtype) for r, c, _ in mats] + [(1, n, dtype) for n in vecs], world, 1,
                     staging)
    avail = (measured or {}).get("available_host_bytes") or available_host_bytes()
    per_host = {"zenflow": zen_host, "offload": off_host, "available_host_bytes": avail,
                "fits": {"zenflow": zen_host["arena_bytes"] <= avail,
                         "offload": off_host["arena_bytes"] <= avail}}
    # -- where the window sums live (rank 0's rows: the largest share), as the optimizer decides
    deferred = [(r, c) for r, c, k in mats if k < c]
    if device_sum_budget == "auto":
        spare = left["zenflow"] - activation_bytes - int(0.1 * gpu_memory_bytes)
        device_sum_budget = 0 if cpu else max(0, spare)
    # every sum first; then, with what is left, "moments" (the square, fp32, and the rate)
    sum_item = 2 if device_sum_dtype == "bfloat16" else 4
    summed, moving = choose_placement([share(r) * c for r, c in deferred], int(device_sum_budget),
                                      4 + rate_item if moments else 0, sum_item)
    on_device = set(summed)
    dev_sum_params = sum(share(r) * c for i, (r, c) in enumerate(deferred) if i in on_device)
    host_sum_params = sum(share(r) * c for i, (r, c) in enumerate(deferred) if i not in on_device)
    moment_params = sum(share(r) * c for i, (r, c) in enumerate(deferred) if i in set(moving))
    plain_params = dev_sum_params - moment_params   # summed in device_sum_dtype ("moments": fp32)
    narrow_params = plain_params if sum_item < 4 else 0   # the host widens them once per window
    per_gpu["device_sum_bytes"] = (sum_item * plain_params + 4 * moment_params
                                   + (4 + rate_item) * moment_params)
    per_gpu["device_sum_dtype"] = device_sum_dtype
    per_gpu["moments_matrices"] = len(moving)
    per_gpu["device_sum_matrices"] = len(on_device)
    per_gpu["host_sum_matrices"] = len(deferred) - len(on_device)
    # -- bus bytes per GPU: host-summed rows every step in the weights' dtype; device sums once
    # per window in fp32; installs: this rank's rows (NCCL all-gathers the rest on the device)
    zen_d2h_step = host_sum_params * item
    zen_d2h_window_sums = (sum_item * plain_params + 4 * moment_params
                           + 4 * moment_params)   # "moments": the squares
    install_rows = sum((share(r) if world > 1 else r) * c for r, c in deferred)
    zen_h2d_window = install_rows * item + rate_item * moment_params   # and the rates
    off_d2h = (sum(share(r) * c for r, c, _ in mats) + sum(share(1) * n for n in vecs)) * item
    # -- host work per GPU: each rank's worker has 1/gpus of the host's measured throughput
    A = fig["host_adamw_params_per_s"] / world
    C = fig["host_accumulate_params_per_s"] / world
    G = fig["device_adamw_params_per_s"]
    Bd, Bh = ((fig["memcpy_bytes_per_s"],) * 2 if cpu else
              (fig["d2h_bytes_per_s"], fig["h2d_bytes_per_s"]))
    zen_host_params = host_sum_params + dev_sum_params
    # Gathering the selected columns reads, and scattering them back reads and writes, every
    # 64-byte line that holds one: sparse columns cost nearly the whole matrix's traffic.
    touched = sum(r * min(c * item, k * 64) for r, c, k in mats if k)
    off_host_params = off_d2h // item
    gather = sum(r * c for r, c in deferred) * item - zen_h2d_window if world > 1 else 0
    # (the host's window work: AdamW, and widening the bf16 sums, a pass like an accumulate's)
    t = {"accumulate_s": host_sum_params / C, "adamw_s": zen_host_params / A + narrow_params / C,
         "d2h_s": zen_d2h_step / Bd, "h2d_s": zen_h2d_window / Bh,
         "sums_d2h_s": zen_d2h_window_sums / Bd,
         # per step, as device_sums.add writes it: one addcmul of the gradient times the step's
         # factor (a device tensor, never read) into the sum (a skipped step's window is dropped
         # at its end, so no pass keeps its inf/NaN out); "moments": the squares (the gradient
         # to fp32, times the factor, one addcmul of it with itself), and the bounded interim
         # step (device_sums.move: the gradient zeroed on a skipped step, as the step writes
         # the weights, its product with the rate, scaled and clamped in place, added to the
         # weight)
         "sum_add_s": (plain_params * (item + 2 * sum_item) + moment_params * (item + 8)
                       + moment_params * (
             (item + 24) + 5 * item + rate_item + 8 * max(item, rate_item))
         ) / fig["device_copy_bytes_per_s"],
         # an all-gather of the other ranks' rows; "moments": the install's bounded correction
         # (the sum times the rate into an fp32 temporary, clamped in place, added to the weight)
         "install_gather_s": (gather + moment_params * (4 + rate_item + 4 + 16 + 4 + 2 * item)
                              ) / fig["device_copy_bytes_per_s"],
         # AdamW on the selected columns and vectors, plus one read of every gradient (the global
         # norm) by the norm kernel, and the selected columns' gather and scatter (3 passes over
         # the touched lines = 1.5 copies)
         "device_update_s": ((sum(r * k for r, _, k in mats) + P_vec) / G +
                             P * item / fig["device_norm_bytes_per_s"] +
                             1.5 * touched / fig["device_copy_bytes_per_s"]),
         # the window end's fingerprints of what the optimizer wrote (OutsideWrites): two
         # passes over every matrix not under "moments" (OffloadAdamW: every parameter, every
         # step, its windows being one step)
         "fingerprint_s": 2 * item * (sum(share(r) * c for r, c, _ in mats) - moment_params)
         / fig["device_fingerprint_bytes_per_s"],
         "offload_fingerprint_s": 2 * P * item / fig["device_fingerprint_bytes_per_s"],
         # OffloadAdamW clips too: one read of every gradient by the norm kernel
         "offload_host_s": off_host_params / C + off_host_params / A,
         "offload_norm_s": P * item / fig["device_norm_bytes_per_s"],
         "offload_d2h_s": off_d2h / Bd, "offload_h2d_s": P * item / Bh, "adamw_device_s": P / G}
    # The host-summed rows' copies start in backward hooks in one process only (under data
    # parallel a hook would see the gradient before it is averaged): there the backward hides
    # BACKWARD_SHARE of forward+backward's worth of them.
    t["d2h_hidden_s"] = (BACKWARD_SHARE * fwd_bwd_s if world == 1 and fwd_bwd_s is not None
                         else 0.0)
    # What the device waits for per install: the whole copy, or with per-layer installs on one
    # GPU the part the forward does not hide (NCCL's all-gather waits for each copy at once).
    t["install_wait_s"] = t["h2d_s"] + t["install_gather_s"]
    if attached and world == 1 and not cpu and fwd_bwd_s is not None:
        deferred_of = [i for i, (_, c, k) in enumerate(mats) if k < c]   # mats' index of each
        copy_s = [0.0] * len(mats)
        with_rates = set(moving)
        for d, i in enumerate(deferred_of):
            r, c, _ = mats[i]
            copy_s[i] = (r * c * item + (rate_item * r * c if d in with_rates else 0)) / Bh
        forward_s = [fwd_bwd_s / 3 * r * c / P_mat for r, c, _ in mats]
        t["install_wait_s"] = _exposed_install_s(copy_s, forward_s) + t["install_gather_s"]
    U = _expected_window(t, fwd_bwd_s, cpu, overlap) if U == "auto" else U
    bus = {"zenflow": {"d2h_bytes_per_step": zen_d2h_step + zen_d2h_window_sums / U,
                       "h2d_bytes_per_step": zen_h2d_window / U,
                       "d2h_bytes_per_window": U * zen_d2h_step + zen_d2h_window_sums,
                       "h2d_bytes_per_window": zen_h2d_window,
                       "model_bytes": P * item},
           "offload": {"d2h_bytes_per_step": off_d2h, "h2d_bytes_per_step": P * item}}
    times = _step_times(t, U, overlap, cpu, fwd_bwd_s)
    assumptions = [
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
        f"device-sum budget: {int(device_sum_budget) / GIB:.1f} GiB (activations counted: "
        f"{activation_bytes / GIB:.1f} GiB; give --activation-gib for yours)",
        ("CPU device: copies are synchronous memcpy in the training thread" if cpu else
         ("a step's device->host copy of host-summed rows starts in backward, each matrix's as "
          f"its gradient is produced ({BACKWARD_SHARE:.2f} of fwd_bwd is backward), and the "
          "compute stream waits at the end of step() for what is left of it after the device "
          "update (a script that rewrites gradients after backward, such as clip_grad_norm_, "
          "moves them all back to step()); " if world == 1 else
          "a step's device->host copy of host-summed rows starts at step() (data parallel: the "
          "gradients are averaged only then) and the compute stream waits for what the device "
          "update does not hide; ")
         + ("installs are copied matrix by matrix from the end of step() and each layer's "
            "forward waits for its own (the model attached to the optimizer; a matrix's share "
            "of the forward, a third of forward+backward, is its share of the parameters)"
            if attached and world == 1 else
            "the compute stream waits for each whole install (host->device: this rank's rows, "
            "then an all-gather on the device) once per window")),
        "no compute/communication overlap of data-parallel gradient reduction is modelled",
    ] + [f"{k} = {fig[k]:.3g}: {v}" for k, v in fig_source.items()]
    sharded = per_rank(mats, vecs, dtype, world, overlap, staging, moments=sharded_moments) \
        if fsdp else None
    if sharded:
        left = gpu_memory_bytes - RESERVE_BYTES - sharded["fsdp2"]["total_bytes"]
        sharded["fsdp2"]["left_for_activations_bytes"] = left
        sharded["ddp"]["left_for_activations_bytes"] = left_ddp = (
            gpu_memory_bytes - RESERVE_BYTES - sharded["ddp"]["total_bytes"])
        sharded["fsdp2"]["fits"], sharded["ddp"]["fits"] = left > 0, left_ddp > 0
    return {"per_rank": sharded,
            "model": {"params": P, "matrices": len(mats), "matrix_params": P_mat,
                      "vectors": len(vecs), "vector_params": P_vec,
                      "dtype": str(dtype).removeprefix("torch."), "source": source},
            "quality": _quality(U, moment_params / max(1, dev_sum_params + host_sum_params)),
            "settings": {"gpus": world, "topk_ratio": topk_ratio, "update_interval": U,
                         "update_interval_asked": update_interval,
                         "overlap_step": overlap, "target": target, "fwd_bwd_s": fwd_bwd_s},
            "per_gpu": per_gpu, "per_host": per_host, "bus": bus,
            "seconds": t, "time": times, "figures": fig, "assumptions": assumptions}


def _exposed_install_s(copy_s: list[float], forward_s: list[float]) -> float:
    """How long the forward waits for installs copied matrix by matrix in the model's order from
    the end of step() (copy_s) while each matrix's layer, taking forward_s, waits for its own:
    the largest lead of the copies up to a matrix over the forward before it. At least the first
    matrix's copy; at most the whole copy."""
    waited = copied = forwarded = 0.0
    for copy, forward in zip(copy_s, forward_s):
        copied += copy
        if copy:
            waited = max(waited, copied - forwarded)
        forwarded += forward
    return waited


def _quality(window: int, moments_share: float) -> dict:
    """The expected quality cost at `window` steps, where `moments_share` of the deferred
    parameters take "moments" and the rest "mean": the two measured gaps, weighted."""
    gap = (moments_share * expected_quality_gap(window, "moments")
           + (1 - moments_share) * expected_quality_gap(window, "mean"))
    return {"window_steps": window, "held_out_loss_gap_pct": gap,
            "moments_share": moments_share,
            "beyond_measured": window > QUALITY_BY_WINDOW["mean"][-1][0],
            "measured": {credit: dict(table) for credit, table in QUALITY_BY_WINDOW.items()},
            "source": "benchmarks/finetune_quality.py (a small model's fine-tune)"}


# The backward's share of forward+backward (about 2 of 3 flops: the weight and the input
# gradients). Host-summed rows start their copy in post-accumulate-grad hooks as backward produces
# them (zenflow/host/early_copies.py), so this much of the copy hides behind it.
BACKWARD_SHARE = 2 / 3


def exposed_d2h(t: dict) -> float:
    """The part of the host-summed rows' copy that the compute stream waits for at step()'s end:
    what neither the backward (`d2h_hidden_s`) nor the device update hides."""
    return max(0.0, t["d2h_s"] - t["d2h_hidden_s"] - t["device_update_s"] - t["sum_add_s"])


def _device_time(t: dict, cpu: bool, fwd_bwd_s: float) -> float:
    """The compute stream's time per step outside window ends: forward and backward, the device
    update and the sums' add, and what is left of the copy of host-summed rows (started in
    backward, it runs beside the rest of it and the update; step()'s end waits for it). CPU: the
    training thread copies (the proxy this model is calibrated on; not modelled with hooks)."""
    if cpu:
        return fwd_bwd_s + t["device_update_s"] + t["d2h_s"]
    return fwd_bwd_s + t["device_update_s"] + t["sum_add_s"] + exposed_d2h(t)


def _expected_window(t: dict, fwd_bwd_s: float | None, cpu: bool, overlap: bool,
                     bounds: tuple[int, int] = (1, 16)) -> int:
    """The window update_interval="auto" settles at (zenflow/optim/windows.py): long enough for
    the host to finish a window's update behind the device's steps, and for the install to take
    at most INSTALL_BUDGET of the window's time."""
    if fwd_bwd_s is None or not overlap:
        return bounds[0]
    T_dev = _device_time(t, cpu, fwd_bwd_s)
    if t["accumulate_s"] >= T_dev:
        return bounds[1]
    cover = math.ceil(t["adamw_s"] / (T_dev - t["accumulate_s"]) - 1e-9)
    install = math.ceil(t["install_wait_s"] / (INSTALL_BUDGET * T_dev) - 1e-9)
    return max(bounds[0], min(bounds[1], max(1, cover, install)))


def _step_times(t: dict, U: int, overlap: bool, cpu: bool, fwd_bwd_s: float | None) -> dict:
    """Step-time model (per GPU; seconds per step). See the formulas in the returned dict."""
    formulas = {
        "adamw": "fwd_bwd + params / device_adamw",
        "offload": ("fwd_bwd + gradient norm + d2h(all grads) + host accumulate + host AdamW "
                    "+ h2d(all weights) + fingerprints (two passes over every parameter)"),
        "zenflow": ("T_dev + accumulate + host_adamw/U + (install + fingerprints)/U (a CPU "
                    "device shares the host's memory: the host's streaming slows its step by "
                    "about its own length, so the two add)" if cpu and overlap else
                    "max(T_dev, accumulate + host_adamw/U) + (install + sums_wait + "
                    "fingerprints)/U" if overlap
                    else "T_dev + (sums_d2h + host_adamw + install + fingerprints)/U"),
        "fingerprints": "two passes over the matrices not under 'moments' per window",
        "T_dev": ("fwd_bwd + device update + d2h (memcpy)" if cpu else
                  "fwd_bwd + device update + device sums' add + exposed d2h"),
        "exposed d2h": (f"max(0, d2h of host-summed rows - {BACKWARD_SHARE:.2f} fwd_bwd "
                        "(the backward, on one GPU: copies start in its hooks) - device update "
                        "- device sums' add)"),
        "install": "what the device waits per install: h2d of this rank's rows + the all-gather "
                   "on the device (several ranks); with per-layer installs (attach, one GPU) only "
                   "the part of the h2d the forward does not hide",
        "sums_wait": "max(0, sums_d2h - fwd_bwd): the next window's first add waits for the copy",
    }
    out = {"formulas": formulas}
    if fwd_bwd_s is None:
        return out
    T_dev = _device_time(t, cpu, fwd_bwd_s)
    install = t["install_wait_s"]
    if overlap and cpu:
        # The CPU proxy's "device" and host stream through the same memory, which both saturate:
        # the worker's work beside a step lengthens it by about its own duration (measured on
        # cpu-llama: ZenFlow's forward+backward is longer than AdamW's by the host's busy time).
        # On a GPU the device's memory is its own and the host's work hides behind its step.
        zen = (T_dev + t["accumulate_s"] + t["adamw_s"] / U
               + (install + t["fingerprint_s"]) / U)
    elif overlap:
        sums_wait = max(0.0, t["sums_d2h_s"] - fwd_bwd_s)
        zen = (max(T_dev, t["accumulate_s"] + t["adamw_s"] / U)
               + (install + sums_wait + t["fingerprint_s"]) / U)
    else:
        zen = T_dev + (t["sums_d2h_s"] + t["adamw_s"] + install + t["fingerprint_s"]) / U
    offload = (fwd_bwd_s + t["offload_norm_s"] + t["offload_d2h_s"] + t["offload_host_s"]
               + t["offload_h2d_s"] + t["offload_fingerprint_s"])
    min_u, why = None, ""
    if t["accumulate_s"] >= T_dev:
        why = "none: the per-step host accumulation alone takes longer than the device's step"
    else:
        min_u = max(1, math.ceil(t["adamw_s"] / (T_dev - t["accumulate_s"]) - 1e-9))
        why = "with overlap_step=True; the install, install/U per step, stays exposed"
    floor = fwd_bwd_s + t["adamw_device_s"]
    out.update({
        "fwd_bwd_s": fwd_bwd_s, "adamw_step_s": floor,
        "offload_step_s": offload, "offload_stall_s": offload - fwd_bwd_s,
        "zenflow_T_dev_s": T_dev, "zenflow_step_s": zen,
        "zenflow_exposed_d2h_s": t["d2h_s"] if cpu else exposed_d2h(t),
        "zenflow_optimizer_s": zen - fwd_bwd_s,     # time in step(), CPU-proxy: training thread
        # beyond the device's own work (its step and the window end's fingerprints)
        "zenflow_stall_s": zen - T_dev - t["fingerprint_s"] / U,
        "zenflow_stall_s_per_window": (zen - T_dev) * U - t["fingerprint_s"],
        # the part spent blocked on the host (what stats()["stall_s_*"] counts; no install)
        "zenflow_blocked_s": max(0.0, zen - T_dev - (install + t["fingerprint_s"]) / U),
        "zenflow_vs_floor": zen / floor,
        "speedup_vs_offload": offload / zen,
        "min_update_interval_hiding_host": min_u, "min_update_interval_note": why})
    return out


# ---------------------------------------------------------------------------------- output
def _quality_line(q: dict) -> str:
    measured = "; ".join(f"{credit} " + ", ".join(f"{u}: {g:+.1f}%" for u, g in table.items())
                         for credit, table in q["measured"].items())
    at_least = " or more" if q["beyond_measured"] else ""
    return (f"Quality at windows of {q['window_steps']} steps: about {q['held_out_loss_gap_pct']:+.1f}%"
            f"{at_least} held-out loss against AdamW on the fine-tune benchmark, with "
            f"{100 * q['moments_share']:.0f}% of the deferred parameters under 'moments' (by "
            f"window: {measured}; a small model's fine-tune, for the trend: benchmarks/README.md)")


def _gib(n) -> str:
    return f"{n / GIB:8.2f} GiB"


def _s(x) -> str:
    return "      n/a" if x is None else (f"{x * 1e3:7.1f} ms" if x < 10 else f"{x:7.2f} s ")


def format_report(r: dict) -> str:
    m, s, g, h, b = r["model"], r["settings"], r["per_gpu"], r["per_host"], r["bus"]
    cols = ("adamw", "adamw_fp32_master", "offload", "zenflow")
    unit = "GPU" if s["target"] == "cuda" else "CPU device"   # what trains
    out = [f"Model: {m['params'] / 1e9:.3f} B params ({m['matrices']} matrices, {m['vectors']} "
           f"vectors), {m['dtype']}; {m['source']}",
           f"Settings: {s['gpus']} GPU(s), topk_ratio {s['topk_ratio']}, update_interval "
           f"{s['update_interval']}" + (" (expected auto window)" if
                                        s["update_interval_asked"] == "auto" else "") +
           f", overlap_step {s['overlap_step']}, device {s['target']}",
           _quality_line(r["quality"]), "",
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
               f"({g['moments_matrices']} under 'moments', with squares and rates), "
               f"{g['device_sum_bytes'] / GIB:.2f} GiB ({g['device_sum_dtype']} sums); on the "
               f"host: {g['host_sum_matrices']}")
    out += ["", f"{'Per host (' + str(s['gpus']) + f' {unit}(s))':<32}{'OffloadAdamW':>16}"
            f"{'ZenFlowAdamW':>16}"]
    for name, key in (("host memory (state)", "host_bytes"), ("reserved (page-rounded)",
                                                                "arena_bytes"),
                      ("page-locked (staging+install)", "pinned_bytes")):
        out.append(f"  {name:<30}{_gib(h['offload'][key]):>16}{_gib(h['zenflow'][key]):>16}")
    out.append(f"  {'fits in available RAM':<30}{'yes' if h['fits']['offload'] else 'NO':>16}"
               f"{'yes' if h['fits']['zenflow'] else 'NO':>16}   "
               f"(available {h['available_host_bytes'] / GIB:.1f} GiB; /dev/shm not used)")
    z, o = b["zenflow"], b["offload"]
    out += ["", f"{'Bus per ' + unit:<32}{'OffloadAdamW':>16}{'ZenFlowAdamW':>16}",
            f"  {'device->host per step':<30}{_gib(o['d2h_bytes_per_step']):>16}"
            f"{_gib(z['d2h_bytes_per_step']):>16}",
            f"  {'host->device per step':<30}{_gib(o['h2d_bytes_per_step']):>16}"
            f"{_gib(z['h2d_bytes_per_step']):>16}",
            f"  {'per window (d2h / h2d)':<30}{'':>16}   {z['d2h_bytes_per_window'] / GIB:.2f} / "
            f"{z['h2d_bytes_per_window'] / GIB:.2f} GiB",
            f"  {'both ways per step / model':<30}{'':>16}"
            f"{(z['d2h_bytes_per_step'] + z['h2d_bytes_per_step']) / z['model_bytes']:>15.2f}x"]
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
                      ("host: ZenFlow state", "host_bytes"),
                      ("bus per window: fp32 sums down", "sums_d2h_bytes_per_window"),
                      ("bus per window: rows up", "install_h2d_bytes_per_window"),
                      ("network per window: install", "install_allgather_bytes_per_window")):
        out.append(f"  {name:<38}{_gib(d[key]):>18}{_gib(f[key]):>18}")
    out.append(f"  {'fits':<38}{'yes' if d['fits'] else 'NO':>18}"
               f"{'yes' if f['fits'] else 'NO':>18}")
    out.append("  (FSDP2 also holds one unsharded block's weights while it computes; both "
               "exchange column norms, and FSDP2 two numbers per step for clipping)")
    return out


# ---------------------------------------------------------------------------------- command
def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", metavar="PATH", default=None,
                     help="a Hugging Face config.json or model folder (read offline; no weights)")
    src.add_argument("--preset", default=None, help="a `zenflow bench` preset name (e.g. cpu-llama)")
    src.add_argument("--shapes", default=None,
                     help='parameter shapes, e.g. "4096x4096*128,11008x4096*64,4096*65"')
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs (data-parallel ranks) on the host (default 1, or --fsdp's N)")
    p.add_argument("--fsdp", type=int, default=None, metavar="N",
                   help="also print the bytes per rank with the model sharded N ways by FSDP2, "
                        "beside DDP's on N GPUs")
    p.add_argument("--gpu-memory", type=float, default=None,
                   help="GiB per GPU (default: the selftest's GPU, else 80)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="weight dtype (default: the config's or preset's, else bf16)")
    p.add_argument("--topk-ratio", type=float, default=0.1, help="ZenFlow topk_ratio")
    p.add_argument("--update-interval", type=_interval, default="auto",
                   help='ZenFlow update_interval, or "auto": the window the optimizer settles at')
    p.add_argument("--device-sum-budget", type=_budget, default="auto",
                   help='GiB of device memory for window sums, or "auto" as the optimizer '
                        "decides it (what is left less a tenth of the GPU)")
    p.add_argument("--activation-gib", type=float, default=0.0,
                   help="GiB of activations at the peak of forward and backward (for the "
                        "auto device-sum budget)")
    p.add_argument("--deferred-credit", choices=("moments", "mean", "window"), default="moments",
                   help="ZenFlow deferred_credit (default: the optimizer's, moments)")
    p.add_argument("--device-sum-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="ZenFlow device_sum_dtype (default: the optimizer's, float32)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="ZenFlow overlap_step")
    p.add_argument("--attach", action=argparse.BooleanOptionalAction, default=True,
                   help="the model is attached to the optimizer (opt.attach(model); "
                        "zenflow.initialize and the framework callbacks do it): each layer's "
                        "forward waits only for its own install")
    p.add_argument("--fwd-bwd-seconds", type=float, default=None,
                   help="forward+backward seconds per step on one GPU (needed for step times)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="what trains: cuda, or cpu for the CPU proxy (default: the selftest "
                        "JSON's device type, else cuda)")
    p.add_argument("--selftest-json", metavar="FILE", default=None,
                   help="measured figures from `zenflow selftest --json FILE`")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the estimate as JSON")


def _interval(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be "auto" or an integer >= 1, got {text}')
    return value


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f'must be "auto" or GiB >= 0, got {text}')
    return int(value * GIB)


def required_modules(args: argparse.Namespace) -> list[str]:
    """Optional packages this run needs, checked by `zenflow` before any work starts."""
    return ["transformers"] if args.hf_config else []


def run(args: argparse.Namespace) -> int:
    try:
        measured = None
        if args.selftest_json:
            with open(args.selftest_json) as f:
                measured = json.load(f).get("measured", {})
        if args.hf_config:
            shapes, dtype, how = shapes_from.hf_shapes(args.hf_config)
            source = f"{args.hf_config} ({how})"
        elif args.preset:
            shapes, dtype = shapes_from.preset_shapes(args.preset)
            source = f"bench preset {args.preset}"
        else:
            shapes, dtype, source = shapes_from.parse_shapes(args.shapes), None, "--shapes"
        if args.dtype:
            dtype = shapes_from.DTYPES[args.dtype]
        if args.fsdp is not None and (args.fsdp < 1 or args.gpus not in (None, args.fsdp)):
            raise ValueError(f"--fsdp N shards the model over N GPUs: N must be >= 1 and --gpus "
                             f"left out or equal to it, got --fsdp {args.fsdp} --gpus {args.gpus}")
        gpus = args.fsdp or args.gpus or 1
        if gpus < 1 or not 0 <= args.topk_ratio <= 1:
            raise ValueError("--gpus must be >= 1 and --topk-ratio in [0, 1]")
        target = args.device or ("cpu" if measured and str(measured.get("device", "")
                                                             ).startswith("cpu") else "cuda")
        report = estimate(shapes, dtype or torch.bfloat16, gpus=gpus, fsdp=args.fsdp,
                          gpu_memory_bytes=int(args.gpu_memory * GIB) if args.gpu_memory else None,
                          topk_ratio=args.topk_ratio, update_interval=args.update_interval,
                          overlap=args.overlap, fwd_bwd_s=args.fwd_bwd_seconds,
                          measured=measured, target=target, source=source,
                          device_sum_budget=args.device_sum_budget,
                          activation_bytes=int(args.activation_gib * GIB),
                          deferred_credit=args.deferred_credit, attached=args.attach,
                          device_sum_dtype=args.device_sum_dtype)
    except (ValueError, OSError) as exc:
        print(f"zenflow estimate: error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"\nwrote {args.json}")
    return 0
