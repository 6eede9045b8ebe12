"""The correctness sections of `zenflow selftest`: ZenFlowAdamW against the reference
(zenflow/optim/reference.py) for fixed and random settings, the torch.optim.AdamW equivalences,
OffloadAdamW against AdamW, and bf16 parameters against an fp32 run."""
from __future__ import annotations

import random

import torch

from zenflow.optim.offload import OffloadAdamW
from zenflow.optim.optimizer import ZenFlowAdamW
from zenflow.optim.reference import ReferenceZenFlow
from zenflow.tools.selftest_checks import (
    HP,
    SHAPES,
    Check,
    _close,
    _Ctx,
    _diff,
    _grads,
    _params,
    _timed,
    _tol,
    _use_transfers,
    _values,
)

# Every window sum on the device, whatever it has spare: deferred_credit "moments" (or
# "factored") then applies to every matrix, as the reference assumes (it is told no matrix takes
# "mean"); "mean" runs keep theirs on the host, so that both paths are checked. The reference
# sums in fp32: so do these (bf16 weights' default, "auto", would sum in bf16).
ALL_ON_DEVICE = dict(device_sum_budget=1 << 50, device_sum_dtype="float32")
ON_HOST = dict(device_sum_budget=0)


def _against_reference(ctx: _Ctx, settings: dict, steps: int, seed: int) -> Check:
    values, grads = _values(SHAPES, seed), _grads(SHAPES, steps, seed)
    fast = _params(values, ctx)
    slow = [v.to(ctx.dtype).clone() for v in values]
    tol, worst, bad = _tol(ctx, ctx.dtype), 0.0, None
    placement = (ALL_ON_DEVICE if settings.get("deferred_credit") in ("moments", "factored")
                 else ON_HOST)
    opt = ZenFlowAdamW(fast, select_strategy="step", select_interval=4, **placement, **settings)
    _use_transfers(opt, ctx.transfers)
    ref = ReferenceZenFlow(slow, select_interval=4, **settings)
    try:
        for t, gs in enumerate(grads):
            for p, g in zip(fast, gs):
                p.grad = g.to(device=ctx.device, dtype=ctx.dtype)
            opt.step()
            ref.step([g.to(ctx.dtype) for g in gs], reselect=(t, "reselect") in opt.decisions)
            for p, q in zip(fast, slow):
                worst = max(worst, _diff(p, q))
                if bad is None and not _close(p, q, tol):
                    bad = t
        reselections, fused = opt.num_reselections, opt.stats()["fused_steps"]
    finally:
        opt.close()
    # on a GPU "factored" takes its compiled step (host/compiled.py): this check is its check
    unfused = settings.get("deferred_credit") == "factored" and ctx.cuda and not fused
    shown = ", ".join(f"{k}={v}" for k, v in settings.items() if k != "lr")
    detail = (f"{shown}; {steps} steps, {reselections} reselection(s), max |diff| {worst:.1e}"
              + (f", {fused} compiled matrix steps" if fused else "")
              + (f"; first mismatch at step {bad}" if bad is not None else "")
              + ("; the compiled step did NOT run (see the log)" if unfused else ""))
    return Check("", "pass" if bad is None and not unfused else "fail", detail,
                 measured={"max_abs_diff": worst, "reselections": reselections,
                           "fused_steps": fused})


def correctness(ctx: _Ctx, quick: bool) -> list[Check]:
    fixed = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, full_warm_up_rounds=2,
                 max_grad_norm=4.0)
    checks = []
    for overlap in (True, False):
        for credit in ("moments", "mean", "factored"):
            checks.append(_timed(f"vs reference, fixed, overlap {'on' if overlap else 'off'}, "
                                 f"{credit}", _against_reference, ctx,
                                 dict(fixed, overlap_step=overlap, deferred_credit=credit), 24, 1))
    for seed in range(3 if quick else 8):
        rng = random.Random(seed)
        settings = dict(lr=rng.choice([1e-2, 3e-3]), topk_ratio=[0.25, 0.5, 0.0, 1.0][seed % 4],
                        update_interval=rng.choice([1, 2, 3]),
                        overlap_step=seed % 3 != 1,
                        full_warm_up_rounds=rng.choice([0, 2]),
                        max_grad_norm=rng.choice([None, 4.0]), importance=rng.choice(["l2", "l1"]),
                        deferred_credit=("moments", "mean")[seed % 2])
        checks.append(_timed(f"vs reference, random settings #{seed}", _against_reference, ctx,
                             settings, 12, 100 + seed))
    return checks


def _equivalence(ctx: _Ctx, kw: dict, mode: str, steps: int = 12) -> Check:
    """ZenFlowAdamW(**kw) against torch.optim.AdamW on the same device: `mode` is "same",
    "accumulate" (matrices: AdamW every U steps on the mean gradient) or "delayed" (matrices one
    step late); vectors are AdamW every step in all three."""
    values, grads = _values(SHAPES, 7), _grads(SHAPES, steps, 7)
    fast, twin = _params(values, ctx, torch.float32), _params(values, ctx, torch.float32)
    mats, vecs = [p for p in twin if p.ndim >= 2], [p for p in twin if p.ndim < 2]
    opts = ([torch.optim.AdamW(mats, **HP), torch.optim.AdamW(vecs, **HP)] if mode == "accumulate"
            else [torch.optim.AdamW(twin, **HP)])
    sums = [torch.zeros_like(p) for p in mats]
    interval = kw.get("update_interval", 1)
    tol, worst, bad = _tol(ctx), 0.0, None
    opt = kw.pop("cls", ZenFlowAdamW)(fast, **HP, **kw)
    _use_transfers(opt, ctx.transfers)
    try:
        for t, gs in enumerate(grads):
            before = [p.detach().clone() for p in twin]
            for p, q, g in zip(fast, twin, gs):
                p.grad, q.grad = g.to(ctx.device), g.to(ctx.device)
            opt.step()
            if mode == "accumulate":
                opts[1].step()
                for s, p in zip(sums, mats):
                    s += p.grad
                if (t + 1) % interval == 0:
                    for s, p in zip(sums, mats):
                        p.grad = s / interval
                        s.zero_()
                    opts[0].step()
            else:
                opts[0].step()
            for p, q, b in zip(fast, twin, before):
                want = b if mode == "delayed" and p.ndim >= 2 else q
                worst = max(worst, _diff(p, want))
                if bad is None and not _close(p, want, tol):
                    bad = t
    finally:
        opt.close()
    return Check("", "pass" if bad is None else "fail",
                 f"{steps} steps, max |diff| {worst:.1e}" +
                 (f"; first mismatch at step {bad}" if bad is not None else ""),
                 measured={"max_abs_diff": worst})


def equivalences(ctx: _Ctx) -> list[Check]:
    cases = [("topk_ratio=1 == AdamW", dict(topk_ratio=1.0, update_interval=3, overlap_step=True,
                                            select_strategy="step", select_interval=5), "same"),
             ("topk_ratio=0, U=1, no overlap == AdamW",
              dict(topk_ratio=0.0, update_interval=1, overlap_step=False), "same"),
             ("topk_ratio=0, U=1, no overlap, 'moments' on the device == AdamW",
              dict(topk_ratio=0.0, update_interval=1, overlap_step=False,
                   deferred_credit="moments", **ALL_ON_DEVICE), "same"),
             ("topk_ratio=0, U=3, no overlap, 'mean' == accumulated AdamW",
              dict(topk_ratio=0.0, update_interval=3, overlap_step=False, deferred_credit="mean"),
              "accumulate"),
             ("topk_ratio=0, U=1, overlap, 'mean' == AdamW one step late",
              dict(topk_ratio=0.0, update_interval=1, overlap_step=True, install_lookahead=0.0,
                   deferred_credit="mean"), "delayed")]
    return [_timed(name, _equivalence, ctx, kw, mode) for name, kw, mode in cases]


def offload(ctx: _Ctx) -> list[Check]:
    c = _equivalence(ctx, dict(cls=OffloadAdamW), "same")
    c.name = "OffloadAdamW == AdamW"
    return [c]


def bf16(ctx: _Ctx, steps: int = 30) -> list[Check]:
    """The same bf16-representable start and gradients in bf16 and in fp32: the fp32 masters agree,
    so the bf16 weights are the fp32 weights rounded (within an ulp), and finite. Every window
    sum on the device in fp32, so that the default rule's interim steps move the bf16 weights
    (on a GPU they do; a CPU "device" takes no budget by default) and both runs sum alike (bf16
    weights sum in bf16 by default: their masters then differ by that rounding, which the
    quality benchmark measures)."""
    values = [v.to(torch.bfloat16).float() for v in _values(SHAPES, 3)]
    grads = [[g.to(torch.bfloat16) for g in gs] for gs in _grads(SHAPES, steps, 3)]
    kw = dict(lr=1e-2, topk_ratio=0.3, update_interval=3, full_warm_up_rounds=1,
              overlap_step=True, select_strategy="step", select_interval=6, **ALL_ON_DEVICE)
    runs = []
    for dtype in (torch.bfloat16, torch.float32):
        params = _params(values, ctx, dtype)
        opt = ZenFlowAdamW(params, **kw)
        _use_transfers(opt, ctx.transfers)
        try:
            for gs in grads:
                for p, g in zip(params, gs):
                    p.grad = g.to(device=ctx.device, dtype=dtype)
                opt.step()
            opt.synchronize()
        finally:
            opt.close()
        runs.append(params)
    finite = all(bool(torch.isfinite(p).all()) for p in runs[0])
    close = all(_close(a, b, _tol(ctx, torch.bfloat16)) for a, b in zip(*runs))
    worst = max(_diff(a, b) for a, b in zip(*runs))
    return [Check("bf16 weights finite and == fp32 run rounded",
                  "pass" if finite and close else "fail",
                  f"{steps} steps, max |bf16 - fp32| {worst:.1e}" + ("" if finite else "; NOT finite"),
                  measured={"max_abs_diff": worst, "finite": finite})]
