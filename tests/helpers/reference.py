"""ZenFlowAdamW against zenflow.optim.reference, step by step: random settings (random_case) and a
run of both on the same random gradients, every weight compared after every step (run_pair); and
deferred_credit="factored" with every sum on the device beside the reference, every step's weights
kept (factored_against_reference)."""
import random

import torch

import zenflow
from zenflow.optim.reference import ReferenceZenFlow

SHAPES = [(7, 9), (5, 3, 2), (11,), (4, 12), (6,), (3, 1)]


def random_case(seed):
    rng = random.Random(seed)
    return dict(
        topk_ratio=rng.choice([rng.uniform(0.01, 0.99), 0.5, 0.1]),
        update_interval=rng.randint(1, 6),
        full_warm_up_rounds=rng.randint(0, 3),
        select_interval=rng.choice([None, rng.randint(1, 12)]),
        max_grad_norm=rng.choice([None, rng.uniform(0.5, 5.0)]),
        overlap_step=rng.random() < 0.5,
        importance=rng.choice(["l2", "l1"]),
        weight_decay=rng.choice([0.0, 0.1]),
        lr_decay=rng.choice([1.0, 0.9]),
        missing_grads=rng.random() < 0.2,
        steps=rng.randint(10, 18),
    )


def run_pair(case, seed):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) for s in SHAPES]
    params = [v.clone().requires_grad_() for v in values]
    ref_params = [v.clone() for v in values]
    lr = 0.02
    kwargs = dict(lr=lr, betas=(0.9, 0.995), eps=1e-8, weight_decay=case["weight_decay"],
                  topk_ratio=case["topk_ratio"], update_interval=case["update_interval"],
                  full_warm_up_rounds=case["full_warm_up_rounds"],
                  overlap_step=case["overlap_step"], max_grad_norm=case["max_grad_norm"],
                  importance=case["importance"],
                  deferred_credit=case.get("deferred_credit", "mean"),
                  install_lookahead=case.get("install_lookahead", 0.0))
    interval = case["select_interval"]
    opt = zenflow.ZenFlowAdamW(params, **kwargs, select_strategy="step",
                               select_interval=interval if interval else 10 ** 6,
                               device_sum_budget=case.get("device_sum_budget", 0))
    ref = ReferenceZenFlow(ref_params, **kwargs, select_interval=interval,
                           mean_credit=case.get("mean_credit", ()))
    for t in range(case["steps"]):
        grads = [torch.randn(s, generator=gen) * (1 + 3 * (i % 2)) for i, s in enumerate(SHAPES)]
        if case["missing_grads"] and t % 4 == 1:
            grads[t % len(grads)] = None
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
        ref.step([None if g is None else g.clone() for g in grads], lr=lr)
        lr *= case["lr_decay"]
        for i, (p, r) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"step {t}, param {i} {SHAPES[i]}: {m}")
    opt.close()
    return opt, params


_PAIRS: dict = {}


def run_pair_once(case, seed):
    """run_pair(case, seed), computed once per (case, seed) in this process (its checks run that
    once): for the runs several test cases compare against, which they only read."""
    key = (tuple(sorted(case.items())), seed)
    if key not in _PAIRS:
        _PAIRS[key] = run_pair(case, seed)
    return _PAIRS[key]


# deferred_credit="factored" against the reference (factored_against_reference)
FACTORED = dict(lr=1e-2, topk_ratio=0.25, update_interval=3, full_warm_up_rounds=1,
                max_grad_norm=4.0, deferred_credit="factored", install_lookahead=0.0)


def factored_against_reference(dtype, sum_dtype="float32", overlap=True, steps=16, skip_at=None,
                               before=None):
    """ZenFlowAdamW under "factored" with every sum on the device, kept in `sum_dtype`, and the
    reference (which sums in fp32) fed the same gradients of `dtype`; at step `skip_at` one
    gradient holds inf (the optimizer skips it, the reference is not stepped). `before(opt)` runs
    once the optimizer is made. Returns (ours, theirs, stats): each step's weights of both, and
    the optimizer's stats() before close()."""
    kw = dict(FACTORED, overlap_step=overlap)
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    params, ref_params = [v.clone().requires_grad_() for v in values], [v.clone() for v in values]
    opt = zenflow.ZenFlowAdamW(params, select_strategy="step", select_interval=4,
                               device_sum_budget=10 ** 9, device_sum_dtype=sum_dtype,
                               worker=False, **kw)
    ref = ReferenceZenFlow(ref_params, select_interval=4, **kw)
    if before is not None:
        before(opt)
    first_matrix = next(i for i, s in enumerate(SHAPES) if len(s) >= 2)
    ours, theirs = [], []
    try:
        for t in range(steps):
            grads = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
            if t == skip_at:
                grads[first_matrix][0, 0] = float("inf")
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            if t != skip_at:
                ref.step([g.clone() for g in grads], reselect=(t, "reselect") in opt.decisions)
            ours.append([p.detach().clone() for p in params])
            theirs.append([r.clone() for r in ref_params])
        stats = opt.stats()
    finally:
        opt.close()
    return ours, theirs, stats
