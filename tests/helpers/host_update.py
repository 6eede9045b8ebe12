"""A host state of several matrices and its update done as separate passes (a whole-run AdamW kernel,
then the rates, then the install values): the oracle the one-pass host update is held to
(tests/test_host_update.py, tests/test_teams.py)."""
from __future__ import annotations

import torch

from zenflow.adamw import adam_rate, adamw_, adamw_lookahead, adamw_moments_
from zenflow.host.buffers import HostState, landing_of, widen_
from zenflow.host.layout import HostJob, HostLayout, HostUpdate

SHAPES = [(37, 129, torch.bfloat16), (3, 7, torch.bfloat16), (0, 5, torch.bfloat16),
          (300, 333, torch.bfloat16), (64, 65, torch.float32), (129, 31, torch.float32),
          (5, 1000, torch.bfloat16)]
HYPER = (1e-3, 0.9, 0.999, 1e-8, 0.01)


def _job(i, step=3, n=4, lr=1e-3, lookahead=0.0, moments=False, widen=False):
    return HostJob(i, step, n, HostUpdate(lr, *HYPER[1:], lookahead=lookahead, moments=moments),
                   widen=widen)


# Every kind of job at once: plain, a lookahead, "moments", sums landed in bf16, and groups
# differing in step, window length and learning rate (so several runs and passes).
JOBS = [_job(0, widen=True), _job(1), _job(2), _job(3, lookahead=1.0, widen=True),
        _job(4, step=5, n=2, moments=True), _job(5, lr=2e-3, lookahead=0.5),
        _job(6, moments=True)]


def _host(seed: int = 0) -> HostState:
    host = HostState.allocate(HostLayout.build(SHAPES, sum_slots=2, rates=True))
    gen = torch.Generator().manual_seed(seed)
    v = host.arena.views
    for name in ("master", "exp_avg", "grad_sum0"):
        v[name].copy_(torch.randn(v[name].shape, generator=gen))
    # the other slot holds the "moments" matrices' sums of squares
    v["grad_sum1"].copy_(torch.randn(v["grad_sum1"].shape, generator=gen).square())
    v["exp_avg_sq"].copy_(torch.rand(v["exp_avg_sq"].shape, generator=gen) * 1e-2)
    for job in JOBS:
        if job.widen:   # a device's bf16 sum, landed in the first half of the fp32 slot
            fp32 = host.fp32("grad_sum0", job.matrix)
            landing_of(fp32, torch.bfloat16).copy_(torch.randn(fp32.shape, generator=gen))
    return host


def _update_in_passes(host: HostState, jobs: list[HostJob], sum_slot: int) -> None:
    """The update as it was before the one-pass update: widen, one AdamW call over each run,
    then the rates, the lookahead and the install copy, each a pass of its own."""
    for job in jobs:
        if job.widen:
            widen_(host.fp32(f"grad_sum{sum_slot}", job.matrix))
    groups: dict[tuple, list[int]] = {}
    for job in jobs:
        groups.setdefault((job.step, job.num_grads, job.update), []).append(job.matrix)
    v = host.arena.views
    sums = v[f"grad_sum{sum_slot}"]
    for key, matrices in groups.items():
        step, num_grads, u = key
        lr, beta1, beta2, eps, weight_decay, moments = (u.lr, u.beta1, u.beta2, u.eps,
                                                        u.weight_decay, u.moments)
        cut = [slice(o, o + n) for o, n, _ in host.layout.fp32_runs(matrices) if n]
        state = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        if moments:
            squares = v[f"grad_sum{1 - sum_slot}"]
            adamw_moments_([v["master"][s] for s in cut], [sums[s] for s in cut],
                           [squares[s] for s in cut], [v["exp_avg"][s] for s in cut],
                           [v["exp_avg_sq"][s] for s in cut], step, num_grads, **state)
        else:
            adamw_([v["master"][s] for s in cut], [sums[s] for s in cut],
                   [v["exp_avg"][s] for s in cut], [v["exp_avg_sq"][s] for s in cut], step,
                   grad_divisor=float(num_grads), **state)
    for job, u in ((job, job.update) for job in jobs):
        if u.moments and host.layout.matrices[job.matrix].numel:
            adam_rate(host.rate(job.matrix), host.fp32("exp_avg_sq", job.matrix), job.step,
                      beta2=u.beta2, eps=u.eps)
        if u.lookahead:
            adamw_lookahead(host.install(job.matrix), host.fp32("master", job.matrix),
                            host.fp32("exp_avg", job.matrix), host.fp32("exp_avg_sq", job.matrix),
                            job.step, lr=u.lr, beta1=u.beta1, beta2=u.beta2, eps=u.eps,
                            weight_decay=u.weight_decay, fraction=u.lookahead)
        else:
            host.install(job.matrix).copy_(host.fp32("master", job.matrix))


def _results(host: HostState) -> dict[str, torch.Tensor]:
    return {name: view.clone() for name, view in host.arena.views.items()
            if not name.startswith(("grad_sum", "staging"))}   # the sums are consumed
