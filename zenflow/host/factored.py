"""The host's update of a "factored" matrix (deferred_credit="factored", docs/semantics.md): the
window's mean square estimated from its sum and the row and column sums of its squares, the
window as n AdamW steps ("moments"), and the rate factors fitted for the device.

A window of n gradients with sum S, row sums Rs and column sums Cs of the squared gradients over
the host-owned columns (mask d), as benchmarks/prototypes/bf16_rules.py's "residual" squares and
"factored" rates:

    mean = S / n,  sq = mean^2
    vr_i = max(0, Rs_i / n - sum_j d_j sq_ij),  vc_j = max(0, Cs_j / n - sum_i sq_ij)
    msq  = sq + vr_i vc_j / max(sum_i vr_i, 1e-30)       (exact where n = 1, or where the
                                                         window's gradients are equal)
    m <- b1^n m + (1 - b1^n) mean,  v <- b2^n v + (1 - b2^n) msq,  count += n
    x <- x (1 - n lr wd) - n lr m_hat / (sqrt(v_hat) + eps)
    r = 1 / (sqrt(v_hat) + eps),  a_i = mean over the host's columns of log r_ij,
    b_j = mean_i (log r_ij - a_i),  alpha = exp(a),  beta = exp(b) d

Whole matrices at a time (a few fp32 temporaries of the matrix's size), in the calling thread.
"""
from __future__ import annotations

import math

import torch


def window_mean_square(grad_sum: torch.Tensor, row_sq: torch.Tensor, col_sq: torch.Tensor,
                       deferred: torch.Tensor, num_grads: int) -> torch.Tensor:
    """msq above, [rows, cols] fp32 (the host's columns; the device's hold the mean squared)."""
    mean = grad_sum / num_grads
    sq = mean * mean
    vr = (row_sq / num_grads - (sq * deferred).sum(1)).clamp_min(0.0)
    vc = (col_sq / num_grads - sq.sum(0)).clamp_min(0.0)
    return sq + vr[:, None] * vc[None, :] / vr.sum().clamp_min(1e-30)


def moments_step_(x: torch.Tensor, grad_sum: torch.Tensor, mean_square: torch.Tensor,
                  m: torch.Tensor, v: torch.Tensor, step: int, num_grads: int, *, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float) -> torch.Tensor:
    """The window's n AdamW steps at once (`lr`: n times the group's), in place; returns the
    rates 1 / (sqrt(v_hat) + eps) of the new moments."""
    decay1, decay2 = beta1 ** num_grads, beta2 ** num_grads
    m.mul_(decay1).add_(grad_sum, alpha=(1.0 - decay1) / num_grads)
    v.mul_(decay2).add_(mean_square, alpha=1.0 - decay2)
    denom = v.sqrt().div_(math.sqrt(1.0 - beta2 ** step)).add_(eps)
    x.mul_(1.0 - lr * weight_decay).addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))
    return denom.reciprocal_()


def fit_rates_(rate: torch.Tensor, deferred: torch.Tensor, alpha: torch.Tensor,
               beta: torch.Tensor) -> None:
    """alpha, beta := the row and column factors of log `rate` over the host's columns (beta 0
    elsewhere; both 0 where the host owns no column)."""
    count = float(deferred.sum())
    if count == 0:
        alpha.zero_()
        beta.zero_()
        return
    logs = rate.log()
    a = (logs * deferred).sum(1) / count
    alpha.copy_(a.exp())
    beta.copy_((logs - a[:, None]).mean(0).exp() * deferred)


def factored_pass(host, jobs: list, sum_slot: int | None) -> None:
    """HostState.update() (`sum_slot` given) or publish() (None) of "factored" jobs: the install
    buffer gets the new values; the factors buffer the new alpha and beta (publish keeps the
    ones there: a load restores them)."""
    for job in jobs:
        i = job.matrix
        x = host.fp32("master", i)
        if sum_slot is not None:
            grad_sum = host.fp32(f"grad_sum{sum_slot}", i)
            if job.widen:   # a bf16 sum landed in the first half of its fp32 slot
                narrow = grad_sum.view(-1).view(torch.bfloat16)[:grad_sum.numel()]
                grad_sum = narrow.view(grad_sum.shape).float()
            row_sq, col_sq, deferred, alpha, beta = host.factors(i)
            u = job.update
            rate = moments_step_(
                x, grad_sum, window_mean_square(grad_sum, row_sq, col_sq, deferred, job.num_grads),
                host.fp32("exp_avg", i), host.fp32("exp_avg_sq", i), job.step, job.num_grads,
                lr=u.lr, beta1=u.beta1, beta2=u.beta2, eps=u.eps, weight_decay=u.weight_decay)
            fit_rates_(rate, deferred, alpha, beta)
        host.install(i).copy_(x)
