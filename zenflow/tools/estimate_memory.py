"""Memory for `zenflow estimate`: bytes per GPU (each optimizer's state beside the weights and
gradients), per host (from the optimizer's own HostLayout, so exact) and per rank under FSDP2.
Exact where the package decides it; no time here."""
from __future__ import annotations

import math

import torch

from zenflow.distributed import Partition
from zenflow.host.arena import plan
from zenflow.host.layout import HostLayout, rate_dtype

GIB = 1 << 30
RESERVE_BYTES = int(1.5 * GIB)   # per GPU: the CUDA context, kernels' workspace, allocator slack


def column_state_bytes(rows: int, k: int) -> int:
    """ZenFlowAdamW's device state of one matrix: its k selected columns' fp32 master, exp_avg,
    exp_avg_sq and gradient scratch (16 B a value), and the columns' int64 indices."""
    return rows * k * 16 + k * 8


def fp32_adam_state_bytes(numel: int, item: int) -> int:
    """AdamW state in fp32: two moments, and a master copy unless the weights are fp32 (what
    ZenFlowAdamW keeps of each vector on the device, and mixed-precision AdamW of everything)."""
    return (8 if item == 4 else 12) * numel


def device_state_bytes(mats: list[tuple[int, int, int]], vecs: list[int], item: int) -> dict:
    """Optimizer state on the GPU, by optimizer: torch's AdamW (moments in the weights' dtype),
    AdamW with fp32 master weights and moments, OffloadAdamW (none) and ZenFlowAdamW."""
    params = sum(r * c for r, c, _ in mats) + sum(vecs)
    return {"adamw": 2 * item * params, "adamw_fp32_master": fp32_adam_state_bytes(params, item),
            "offload": 0,
            "zenflow": (sum(column_state_bytes(r, k) for r, _, k in mats)
                        + sum(fp32_adam_state_bytes(n, item) for n in vecs))}


def per_gpu(mats: list[tuple[int, int, int]], vecs: list[int], item: int,
            gpu_memory_bytes: int) -> dict:
    """Weights, gradients and each optimizer's state on one GPU, and what is left of it for
    activations after RESERVE_BYTES."""
    params = sum(r * c for r, c, _ in mats) + sum(vecs)
    state = device_state_bytes(mats, vecs, item)
    left = {k: gpu_memory_bytes - (2 * item * params + v + RESERVE_BYTES)
            for k, v in state.items()}
    return {"weights_bytes": item * params, "grads_bytes": item * params, "state_bytes": state,
            "reserve_bytes": RESERVE_BYTES, "gpu_memory_bytes": gpu_memory_bytes,
            "left_for_activations_bytes": left, "fits": {k: v > 0 for k, v in left.items()}}


def rank_rows(rows: int, rank: int, world: int) -> int:
    """The rows of a matrix a rank keeps on the host (zenflow.distributed.Partition.rows)."""
    return len(range(rows)[Partition(rank=rank, world_size=world).rows(rows)])


def pinned_bytes(layout: HostLayout, device_summed: set[int], host_summed: set[int]) -> int:
    """What the optimizer page-locks on CUDA, of one rank's layout (zenflow/host/pipeline.py
    _lock_copied_spans): only what device copies touch. Always the install buffers, the rates
    ("moments") and the steps' factors. Once the sums are placed, each staging slot over the
    matrices summed on the host (`host_summed`: their rows cross every step) and each fp32 sum
    slot over those summed on the device (`device_summed`: their sums cross at window ends, a
    bf16 sum in the first half of its fp32 span). Each is one span, from the first of those
    matrices to the end of the last (per dtype for staging), so a matrix between two of them is
    locked too. Indices are into the layout."""
    typed = sum(dtype.itemsize * numel for dtype, _, numel in layout.groups)
    install = typed
    rates = (sum(rate_dtype(dtype).itemsize * numel for dtype, _, numel in layout.groups)
             if layout.rates else 0)
    step_coef = 4 * layout.staging_slots
    staging = layout.staging_slots * sum(
        dtype.itemsize * _span([layout.matrices[i] for i in host_summed
                                if layout.matrices[i].dtype == dtype], typed=True)
        for dtype, _, _ in layout.groups)
    sums = layout.sum_slots * 4 * _span([layout.matrices[i] for i in device_summed])
    return install + rates + step_coef + staging + sums


def _span(matrices: list, typed: bool = False) -> int:
    """Elements from the first of `matrices` to the end of the last, in the fp32 buffers or
    (typed) in their dtype's buffers (zenflow/host/buffers.py HostState.span)."""
    starts = [m.typed_offset if typed else m.offset for m in matrices]
    return max((a + m.numel for a, m in zip(starts, matrices)), default=0) - min(starts, default=0)


def host_memory(entries: list[tuple[int, int, torch.dtype]], gpus: int, sum_slots: int,
                staging_slots: int, rates: bool = False, device_summed: set[int] = frozenset(),
                factors: bool = False, moments_dtype: torch.dtype = torch.float32) -> dict:
    """Host memory of every rank on the host, from the optimizer's own HostLayout (two staging
    buffers where copies outlive the step, as on CUDA: zenflow/host/pipeline.py; "moments": the
    rates, and always two sum slots; `factors`: "factored"'s factors buffer; `moments_dtype`:
    host_moments_dtype), and what of it is
    page-locked (`pinned_bytes`; every rank
    with rank 0's placement of the sums: `device_summed`, indices into `entries`, the others
    summed on the host). `entries`: (rows, columns, dtype) of each matrix."""
    total = arena = pinned = first = 0
    for rank in range(gpus):
        layout = HostLayout.build([(rank_rows(rows, rank, gpus), cols, dtype)
                                   for rows, cols, dtype in entries],
                                  2 if rates else sum_slots, staging_slots=staging_slots,
                                  rates=rates, factors=factors, moments_dtype=moments_dtype)
        regions, size = plan(layout.regions())
        nbytes = sum(r.nbytes for r in regions)
        total, arena = total + nbytes, arena + size
        on_host = set(range(len(entries))) - set(device_summed)
        pinned += pinned_bytes(layout, set(device_summed), on_host)
        first = first or nbytes
    return {"host_bytes": total, "arena_bytes": arena, "pinned_bytes": pinned,
            "host_bytes_rank0": first}


def per_rank(mats: list[tuple[int, int, int]], vecs: list[int], dtype: torch.dtype, world: int,
             overlap: bool, staging_slots: int, shard_credit: str = "mean",
             replica_credit: str = "mean") -> dict:
    """Bytes per rank of ZenFlowAdamW on `world` ranks, replicas (DDP) against row shards (FSDP2),
    for rank 0, which holds the largest share (ceil(rows / world) rows of every matrix, as both
    split them): the table of docs/fsdp2.md, exactly. `mats` holds (rows, columns, k) per matrix,
    `vecs` each vector's length; `shard_credit`, `replica_credit`: the deferred-credit rule
    FSDP2's shards and DDP's replicas take (DDP's: "factored" or "mean"). Under FSDP2 a rank
    also holds one unsharded block's weights while it computes (not counted: it depends on how
    the model was wrapped)."""
    item = torch.empty((), dtype=dtype).element_size()

    def rows0(n: int) -> int:
        return min(n, math.ceil(n / world))

    def device(rows, vec_len) -> dict:
        weights = item * (sum(rows(r) * c for r, c, _ in mats) + sum(vec_len(n) for n in vecs))
        state = (sum(column_state_bytes(rows(r), k) for r, _, k in mats)
                 + sum(fp32_adam_state_bytes(vec_len(n), item) for n in vecs))
        return {"weights_bytes": weights, "grads_bytes": weights, "state_bytes": state,
                "total_bytes": 2 * weights + state}

    entries = [(r, c, dtype) for r, c, _ in mats]
    # Each rank's host keeps its rule's own state of its rows: "moments"' rates (FSDP2's shards
    # only: DDP's replicas take "mean" for it), "factored"'s factors
    host = host_memory(entries, world, 2 if overlap else 1, staging_slots,
                       factors=replica_credit == "factored")["host_bytes_rank0"]
    host_fsdp2 = host_memory(entries, world, 2 if overlap else 1, staging_slots,
                             rates=shard_credit == "moments",
                             factors=shard_credit == "factored")["host_bytes_rank0"]
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


def fits_per_rank(sharded: dict, gpu_memory_bytes: int) -> dict:
    """`per_rank`'s result with what each layout leaves for activations, and whether it fits."""
    for layout in ("ddp", "fsdp2"):
        left = gpu_memory_bytes - RESERVE_BYTES - sharded[layout]["total_bytes"]
        sharded[layout]["left_for_activations_bytes"] = left
        sharded[layout]["fits"] = left > 0
    return sharded
