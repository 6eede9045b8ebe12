"""What `zenflow estimate` counts of a model, from its shapes, as the optimizer decides it: its
matrices and vectors as the optimizer views them (`split_shapes`), where the window sums of rank
0's rows live and which matrices the deferred-credit rule moves (`place`), and the `Counts` the
costs read (`count`; zenflow/tools/estimate_terms.py)."""
from __future__ import annotations

import math

from zenflow.optim.importance import num_selected
from zenflow.tools import estimate_memory as memory
from zenflow.tools import estimate_terms as cost
from zenflow.tools.estimate_terms import Counts


def split_shapes(shapes, topk_ratio: float) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(rows, columns, k selected columns) of each matrix (a tensor of 2 or more dimensions,
    viewed [rows, the rest]) and the length of each vector, as the optimizer views them."""
    mats, vecs = [], []
    for _, shape in shapes:
        n = math.prod(shape)
        if len(shape) >= 2:
            rows, cols = shape[0], n // shape[0]
            mats.append((rows, cols, num_selected(topk_ratio, cols)))
        else:
            vecs.append(n)
    return mats, vecs


def count(mats, vecs, item: int, rate_item: int, sum_item: int, world: int,
          on_device: set[int], moving: set[int], rule: str = "moments",
          replicas: bool = False, fused: bool = False) -> Counts:
    """The Counts of rank 0, where `on_device` and `moving` index the deferred matrices (k <
    columns) whose sums are on the device, and of those the ones under `rule` ("moments" or
    "factored"). `replicas`: every rank holds the whole model (DDP), so "factored" holds and
    moves every rank's rows (host/credit_replicas.py). `fused`: the rule's step is a compiled
    kernel a matrix (Credit.fuses, on a device in host/compiled.py's COMPILE_ON)."""
    deferred = [(r, c) for r, c, k in mats if k < c]
    share = [memory.rank_rows(r, 0, world) * c for r, c in deferred]
    replicated = [deferred[i] for i in moving] if rule == "factored" and replicas else []
    other_rows = [r - memory.rank_rows(r, 0, world) for r, _ in replicated]

    def total(where) -> int:
        return sum(n for i, n in enumerate(share) if where(i))
    return Counts(
        item=item, rate_item=rate_item, sum_item=sum_item, world=world,
        params=sum(r * c for r, c, _ in mats) + sum(vecs), vector_params=sum(vecs),
        selected_params=sum(r * k for r, _, k in mats),
        # gathering a column reads every 64-byte line that holds one of its values: sparse
        # columns cost nearly the whole matrix's traffic
        touched_bytes=sum(r * min(c * item, k * cost.CACHE_LINE) for r, c, k in mats if k),
        rank_matrix_params=sum(memory.rank_rows(r, 0, world) * c for r, c, _ in mats),
        deferred_params_all=sum(r * c for r, c in deferred),
        host_summed=total(lambda i: i not in on_device),
        device_plain=total(lambda i: i in on_device and i not in moving),
        device_moments=total(lambda i: i in moving) if rule == "moments" else 0,
        device_factored=total(lambda i: i in moving) if rule == "factored" else 0,
        fused_factored=fused and rule == "factored",
        factored_rows=sum(memory.rank_rows(deferred[i][0], 0, world) for i in moving)
        if rule == "factored" else 0,
        factored_cols=sum(deferred[i][1] for i in moving) if rule == "factored" else 0,
        factored_other_factors=sum(n + (world - 1) * c
                                   for n, (_, c) in zip(other_rows, replicated)),
        factored_other_params=sum(n * c for n, (_, c) in zip(other_rows, replicated)),
        offload_params=(sum(memory.rank_rows(r, 0, world) * c for r, c, _ in mats)
                        + sum(memory.rank_rows(1, 0, world) * n for n in vecs)),
        matrices=len(mats), device_summed_matrices=len(on_device),
        factored_matrices=len(moving) if rule == "factored" else 0)


def place(rule, mats, world: int, budget: int, sum_item: int, dtype) -> tuple[list, list]:
    """(summed on the device, moving) of rank 0's rows of the deferred matrices (k < columns;
    indices into those) under `rule`, as the optimizer places them: every sum first, then, with
    what is left, the rule's own state ("moments": the square, fp32, and the rate; "factored":
    row and column statistics and factors)."""
    deferred = [(memory.rank_rows(r, 0, world), c) for r, c, k in mats if k < c]
    return rule.place([n * c for n, c in deferred], budget, sum_item, [dtype] * len(deferred), deferred)
