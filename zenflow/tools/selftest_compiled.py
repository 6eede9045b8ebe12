"""The selftest's "compiled" section (a GPU run needs it: zenflow/tools/selftest_gpu.py lists
the others): deferred_credit="factored"'s step and an install's correction compiled for the
device (host/compiled.py: Triton on CUDA) against the same functions run eagerly, on bf16
matrices of three shapes, fp32 and bf16 sums, and a skipped step; the batched calls a
model's step and an install take for each run of matrices; and a DDP replica's step. Skipped
where the device takes no compiled kernels.
"""
from __future__ import annotations

import time

import torch

from zenflow.tools.selftest_checks import Check, _Ctx


def compiled(ctx: _Ctx) -> list[Check]:
    """See the module doc; skipped on a device that takes no compiled kernels (COMPILE_ON)."""
    from zenflow.host.compiled import COMPILE_ON
    name = "compiled 'factored' step and correction == eager"
    if ctx.device.type not in COMPILE_ON:
        return [Check(name, "skip", f"{ctx.device.type}: no compiled kernels here "
                                    f"(zenflow/host/compiled.py COMPILE_ON = {sorted(COMPILE_ON)})")]
    start = time.perf_counter()
    worst, bad = {}, []
    for sum_dtype in (torch.float32, torch.bfloat16):
        for rows, cols in ((256, 512), (1000, 300), (4096, 1024)):
            for key, (diff, ok) in _compiled_against_eager(ctx.device, rows, cols,
                                                           sum_dtype).items():
                worst[key] = max(worst.get(key, 0.0), diff)
                if not ok:
                    bad.append(f"{key} of {rows}x{cols} ({str(sum_dtype)[6:]} sums)")
    detail = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    return [Check(name, "fail" if bad else "pass",
                  f"largest differences: {detail}" + (f"; OFF: {', '.join(bad)}" if bad else ""),
                  seconds=time.perf_counter() - start, measured={"max_diff": worst}),
            _batch_against_eager(ctx.device), _replica_against_eager(ctx.device)]


def _replica_against_eager(device: torch.device) -> Check:
    """replica_step_ (DDP's replicas: the sums of this rank's rows, every row moved at its
    rank's block's factors) compiled against eager, on a bf16 replica of 1000 x 300 rows split
    between two ranks, as rank 1: the weights within a bf16 ulp, the sum and the statistics as
    factored_step_'s are held, and the fingerprints exactly each run's own weights'."""
    from zenflow.host.compiled import compiled_for, scalar
    from zenflow.host.factored_kernels import replica_step_
    from zenflow.host.fingerprints import masked_bit_sum
    start = time.perf_counter()
    step = compiled_for(replica_step_, device)
    gen = torch.Generator(device=device).manual_seed(11)
    rows, cols, own = 1000, 300, slice(500, 1000)

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=gen)
    grad = (rand(rows, cols) - 0.5).bfloat16()
    eager = dict(weight=((rand(rows, cols) - 0.5) * 0.04).bfloat16(), grad=grad, own=grad[own],
                 grad_sum=(rand(500, cols) - 0.5).bfloat16(), row_sq=torch.zeros(500, device=device),
                 col_sq=torch.zeros(cols, device=device), alpha=rand(rows) + 0.5,
                 beta=rand(2, cols) * 10,
                 block_of_row=torch.arange(rows, device=device) // 500,
                 host_cols=(rand(cols) > 0.1).float())
    fused = {k: v.clone() for k, v in eager.items()}
    fused["own"] = fused["grad"][own]
    scalars = [scalar(v, device) for v in (0.7, -0.05, 3.0)]
    prints = [torch.zeros(2, dtype=torch.int32, device=device) for _ in range(2)]
    before = masked_bit_sum(eager["weight"], eager["host_cols"])
    replica_step_(*eager.values(), *scalars, prints[0])
    step(*fused.values(), *scalars, prints[1])
    worst, ok = {}, True
    for key, rtol in (("weight", 2.0 ** -7), ("grad_sum", 2.0 ** -7), ("row_sq", 1e-5),
                      ("col_sq", 1e-5)):
        worst[key], close = _within(eager[key], fused[key], rtol)
        ok = ok and close
    ok = ok and all(torch.equal(p, torch.stack([before, masked_bit_sum(run["weight"],
                                                                       run["host_cols"])]))
                    for p, run in zip(prints, (eager, fused)))
    detail = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    return Check("compiled 'factored' DDP replica step == eager", "pass" if ok else "fail",
                 f"largest differences: {detail}", seconds=time.perf_counter() - start,
                 measured={"max_diff": worst})


def _batch_against_eager(device: torch.device) -> Check:
    """factored_steps_ and factored_corrects_ compiled for a run of BATCH matrices of three
    shapes (one call each: what a model's step and an install take for each run) against
    factored_step_ and factored_correct_ run eagerly on each: after the step and the correction
    the weights within a bf16 ulp, the sums within one of theirs, the statistics within fp32
    rounding; and each matrix's fingerprints exactly its own weights' before and after the
    step, and after the correction."""
    from zenflow.host.compiled import compiled_for, scalar
    from zenflow.host.credit_factored import BATCH
    from zenflow.host.factored_kernels import (
        factored_correct_,
        factored_corrects_,
        factored_step_,
        factored_steps_,
    )
    from zenflow.host.fingerprints import masked_bit_sum
    start = time.perf_counter()
    batch = compiled_for(factored_steps_, device, batch=True)
    corrects = compiled_for(factored_corrects_, device, batch=True)
    gen = torch.Generator(device=device).manual_seed(7)
    shapes = [((256, 512), (512, 256), (384, 384))[j % 3] for j in range(BATCH)]

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=gen)
    runs = [[dict(weight=((rand(r, c) - 0.5) * 0.04).bfloat16(), grad=(rand(r, c) - 0.5).bfloat16(),
                  grad_sum=(rand(r, c) - 0.5).bfloat16(), row_sq=torch.zeros(r, device=device),
                  col_sq=torch.zeros(c, device=device), alpha=rand(r) + 0.5, beta=rand(c) * 10,
                  host_cols=(rand(c) > 0.1).float()) for r, c in shapes]]
    runs.append([{k: v.clone() for k, v in m.items()} for m in runs[0]])
    # moves of many bf16 ulps of the weights (0.02): a kernel 1% off is seen
    coef, neg_lr, bound = (scalar(v, device) for v in (0.7, -0.05, 3.0))
    before = [masked_bit_sum(m["weight"], m["host_cols"]) for m in runs[0]]
    prints = [torch.zeros(len(shapes), 2, dtype=torch.int32, device=device) for _ in runs]
    for j, m in enumerate(runs[0]):
        factored_step_(*m.values(), coef, neg_lr, bound, prints[0][j])
    lists = [[m[k] for m in runs[1]] for k in runs[1][0]]
    batch(*lists, coef, [neg_lr] * len(shapes), [bound] * len(shapes), prints[1],
          signature=("selftest", tuple(shapes)))
    wants = [torch.stack([torch.stack([b, masked_bit_sum(m["weight"], m["host_cols"])])
                          for b, m in zip(before, run)]) for run in runs]
    most = scalar(6.0, device)
    corrected = [torch.zeros(len(shapes), dtype=torch.int32, device=device) for _ in runs]
    for j, m in enumerate(runs[0]):
        factored_correct_(m["weight"], m["grad_sum"], m["alpha"], m["beta"], neg_lr, most,
                          m["host_cols"], corrected[0][j])
    corrects(*[[m[k] for m in runs[1]] for k in ("weight", "grad_sum", "alpha", "beta")],
             [neg_lr] * len(shapes), [most] * len(shapes), [m["host_cols"] for m in runs[1]],
             corrected[1], signature=("selftest", tuple(shapes)))
    wants.append(torch.stack([masked_bit_sum(m["weight"], m["host_cols"]) for m in runs[0]]))
    wants.append(torch.stack([masked_bit_sum(m["weight"], m["host_cols"]) for m in runs[1]]))
    prints += corrected
    worst, ok = {}, True
    for key, rtol in (("weight", 2.0 ** -7), ("grad_sum", 2.0 ** -7), ("row_sq", 1e-5),
                      ("col_sq", 1e-5)):
        for eager, fused in zip(*runs):
            diff, close = _within(eager[key], fused[key], rtol)
            worst[key] = max(worst.get(key, 0.0), diff)
            ok = ok and close
    ok = ok and all(torch.equal(printed, want) for printed, want in zip(prints, wants))
    detail = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    return Check(f"compiled 'factored' batch of {len(shapes)} == eager", "pass" if ok else "fail",
                 f"largest differences: {detail}", seconds=time.perf_counter() - start,
                 measured={"max_diff": worst})


def _within(eager: torch.Tensor, fused: torch.Tensor, rtol: float) -> tuple[float, bool]:
    """(largest difference, whether `fused` is within `rtol` of `eager`): NaN where the other
    has NaN, and each value within rtol of itself or, where it nearly cancelled (a weight moved
    to about 0), of the tensor's typical magnitude: a fused multiply-add rounds once where eager
    rounds twice."""
    a, b = eager.float().cpu(), fused.float().cpu()
    same_nan = torch.equal(a.isnan(), b.isnan())
    a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    diff = float((a - b).abs().max())
    return diff, same_nan and bool(((a - b).abs() <= (b.abs() + b.abs().mean()) * rtol).all())


def _compiled_against_eager(device: torch.device, rows: int, cols: int,
                            sum_dtype: torch.dtype) -> dict[str, tuple[float, bool]]:
    """{tensor: (largest difference, within bounds)} after a step, a correction and a skipped
    step (coef 0 and an inf gradient), compiled against eager: the weights within a bf16 ulp
    and finite, the sums within an ulp of their dtype (NaN where the skipped step's inf went,
    alike), the statistics within fp32 rounding of a reduction's order; each relative to the
    value or, near 0, to the tensor's mean magnitude; and the step's fingerprints of the moved
    columns, each run's exactly its own weights' before and after ("prints": how many differ)."""
    from zenflow.host.compiled import compiled_for, scalar
    from zenflow.host.factored_kernels import factored_correct_, factored_step_
    from zenflow.host.fingerprints import masked_bit_sum as fingerprints
    step, correct = (compiled_for(f, device) for f in (factored_step_, factored_correct_))
    gen = torch.Generator(device=device).manual_seed(rows)

    def rand(*shape):
        return torch.rand(*shape, device=device, generator=gen)
    eager = dict(weight=((rand(rows, cols) - 0.5) * 0.04).bfloat16(),
                 grad=(rand(rows, cols) - 0.5).bfloat16(),
                 grad_sum=(rand(rows, cols) - 0.5).to(sum_dtype),
                 row_sq=torch.zeros(rows, device=device), col_sq=torch.zeros(cols, device=device),
                 alpha=rand(rows) + 0.5, beta=rand(cols) * 10,
                 host_cols=(rand(cols) > 0.1).float())
    fused = {k: v.clone() for k, v in eager.items()}
    sizes, most = (scalar(-1e-3, device), scalar(3.0, device)), scalar(6.0, device)
    prints = [torch.zeros(2, dtype=torch.int32, device=device) for _ in range(2)]
    before = fingerprints(eager["weight"], eager["host_cols"])
    factored_step_(*eager.values(), scalar(0.7, device), *sizes, prints[0])
    step(*fused.values(), scalar(0.7, device), *sizes, prints[1])
    # each run's fingerprints are its own weights' (a weight may round apart: so its print)
    wants = [torch.stack([before, fingerprints(run["weight"], run["host_cols"])])
             for run in (eager, fused)]
    corrected = [torch.zeros((), dtype=torch.int32, device=device) for _ in range(2)]
    factored_correct_(eager["weight"], eager["grad_sum"], eager["alpha"], eager["beta"],
                      sizes[0], most, eager["host_cols"], corrected[0])
    correct(fused["weight"], fused["grad_sum"], fused["alpha"], fused["beta"], sizes[0], most,
            fused["host_cols"], corrected[1])
    prints += corrected   # and the correction's, the weights' after it
    wants += [fingerprints(run["weight"], run["host_cols"]) for run in (eager, fused)]
    # a skipped step: its gradient may hold inf; it moves nothing (its window is dropped)
    eager["grad"][0, 0] = fused["grad"][0, 0] = float("inf")
    factored_step_(*eager.values(), scalar(0.0, device), *sizes)
    step(*fused.values(), scalar(0.0, device), *sizes)
    out = {}
    for key, rtol in (("weight", 2.0 ** -7), ("grad_sum", 2.0 ** -7 if sum_dtype ==
                                              torch.bfloat16 else 1e-6),
                      ("row_sq", 1e-5), ("col_sq", 1e-5)):
        diff, ok = _within(eager[key], fused[key], rtol)
        if key == "weight":
            ok = ok and bool(torch.isfinite(fused[key]).all())
        out[key] = (diff, ok)
    # the moved columns' fingerprints, before and after: the weights' as they were and are
    differ = float(sum(int((p != w).sum()) for p, w in zip(prints, wants)))
    out["prints"] = (differ, differ == 0)
    return out
